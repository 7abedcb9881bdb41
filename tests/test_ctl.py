"""``moecache-ctl`` as an operator meets it: where it looks for the daemon, its version, its
output, its help texts."""
import pytest

import moecached.config
from moecached.ctl import main as ctl


def _err(capsys, *argv) -> str:
    assert ctl(list(argv)) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    """The daemon's config file (moved into tmp_path), naming its own endpoint."""
    path = tmp_path / "moecached.toml"
    path.write_text(f'endpoint = "ipc://{tmp_path}/from-config.sock"\nbudget = "1GiB"\n')
    monkeypatch.setattr(moecached.config, "DEFAULT_PATH", str(path))
    monkeypatch.delenv("MOECACHED_ENDPOINT", raising=False)
    return path


@pytest.mark.parametrize("cmd", ["status", "stats", "trace stop"])
def test_endpoint_precedence_flag_env_config(cmd, config_file, tmp_path, monkeypatch, capsys):
    argv = cmd.split()
    err = _err(capsys, *argv)
    assert f"ipc://{tmp_path}/from-config.sock (endpoint from {config_file})" in err
    monkeypatch.setenv("MOECACHED_ENDPOINT", f"ipc://{tmp_path}/from-env.sock")
    err = _err(capsys, *argv)
    assert f"ipc://{tmp_path}/from-env.sock (endpoint from $MOECACHED_ENDPOINT)" in err
    err = _err(capsys, *argv, "--endpoint", f"ipc://{tmp_path}/from-flag.sock")
    assert f"ipc://{tmp_path}/from-flag.sock (endpoint from --endpoint)" in err


def test_endpoint_default_without_config(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(moecached.config, "DEFAULT_PATH", str(tmp_path / "absent.toml"))
    monkeypatch.delenv("MOECACHED_ENDPOINT", raising=False)
    from moecached.ctlstats import resolve_endpoint
    assert resolve_endpoint() == (moecached.config.DEFAULT_ENDPOINT, "the built-in default")


def test_unreadable_config_falls_back_to_default_and_says_why(config_file, monkeypatch):
    config_file.write_text("endpoint = [")
    from moecached.ctlstats import resolve_endpoint
    endpoint, source = resolve_endpoint()
    assert endpoint == moecached.config.DEFAULT_ENDPOINT
    assert source.startswith(f"the built-in default; config file skipped: {config_file}: invalid TOML")


def test_bad_env_endpoint_is_one_line_error(config_file, monkeypatch, capsys):
    monkeypatch.setenv("MOECACHED_ENDPOINT", "localhost:5555")
    assert _err(capsys, "status") == ("moecache-ctl status: error: $MOECACHED_ENDPOINT 'localhost:5555': "
                                      "expected ipc:///absolute/path (at most 107 bytes) or tcp://HOST:PORT")


def test_version(capsys):
    from moecached import __version__
    assert ctl(["--version"]) == 0
    assert capsys.readouterr().out == f"moecache-ctl {__version__}\n"
    assert "--version" in (ctl(["--help"]), capsys.readouterr().out)[1]
