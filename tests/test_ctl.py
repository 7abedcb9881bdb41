"""``moecache-ctl`` as an operator meets it: where it looks for the daemon, its version, its
output, its help texts."""
import pytest

import moecached.daemon.config
from moecached.tools.ctl import main as ctl


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
    monkeypatch.setattr(moecached.daemon.config, "DEFAULT_PATH", str(path))
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
    monkeypatch.setattr(moecached.daemon.config, "DEFAULT_PATH", str(tmp_path / "absent.toml"))
    monkeypatch.delenv("MOECACHED_ENDPOINT", raising=False)
    from moecached.tools.ctlstats import resolve_endpoint
    assert resolve_endpoint() == (moecached.daemon.config.DEFAULT_ENDPOINT, "the built-in default")


def test_unreadable_config_falls_back_to_default_and_says_why(config_file, monkeypatch):
    config_file.write_text("endpoint = [")
    from moecached.tools.ctlstats import resolve_endpoint
    endpoint, source = resolve_endpoint()
    assert endpoint == moecached.daemon.config.DEFAULT_ENDPOINT
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


@pytest.fixture
def daemon(model_factory, tmp_path, monkeypatch):
    from daemon_util import Daemon
    d = Daemon(model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=8), tmp_path)
    monkeypatch.setenv("MOECACHED_ENDPOINT", d.endpoint)
    yield d
    d.stop()


def test_stats_summary_layers_and_json(daemon, capsys):
    import json
    from moecache_client import Client
    with Client(daemon.endpoint, name="engine-a") as a, Client(daemon.endpoint, name="engine-b"):
        layer = a.expert_layers[1]
        a.acquire(layer, [0, 1, 2]).release()
        a.acquire(layer, [0, 1, 5]).release()        # 2 hits, 4 demand misses
        assert ctl(["stats", "--json"]) == 0
        st = json.loads(capsys.readouterr().out)
        assert ctl(["stats"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert ctl(["stats", "--layers"]) == 0
        with_layers = capsys.readouterr().out.splitlines()
    # --json: every counter, as before
    assert {"classes", "layers", "read_latency", "readers", "server", "budget"} <= set(st)
    assert [x["name"] for x in st["clients"]] == ["engine-a", "engine-b"]
    budget = st["budget"]["current_bytes"]
    used = sum(x["used"] * x["slot_bytes"] for x in st["classes"])
    assert used > 0 and budget > used
    by_head = {line.split()[0]: line for line in out}
    assert by_head["hit"].startswith("hit rate  33.3% (2 hits, 0 prefetch hits, 4 demand misses)")
    assert by_head["budget"].startswith(f"budget    {budget / 2**30:.2f} GiB, used {used / 2**30:.2f} GiB "
                                        f"(4 of {sum(x['slots'] for x in st['classes'])} slots")
    assert by_head["reads"].startswith("reads     4 (")
    assert "latency p50 " in by_head["reads"] and " ms, p99 " in by_head["reads"]
    assert by_head["clients"] == "clients   2"
    clients = [line for line in out if line.startswith("  ")]
    assert [c.split()[0] for c in clients] == ["engine-a", "engine-b"]
    assert "hit rate 33.3%, 2 acquires" in clients[0]
    assert len(out) < 12 and not any(line.startswith("layer") for line in out)
    layer_lines = [line for line in with_layers if line.startswith("layer ")]
    assert len(layer_lines) == len(st["layers"])
    assert f"layer {layer}: hit rate 33.3% (2 hits, 0 prefetch hits, 4 demand misses), 4 reads" in layer_lines
    assert len(with_layers) == len(out) + len(layer_lines)


def _help_texts(capsys) -> dict:
    """``--help`` output of ``moecached``, every ``moecache-ctl`` command (and ``trace
    convert``) and ``python -m moecached.tools.workload``, by command."""
    from moecached import daemon
    from moecached.tools import workload
    from moecached.tools.ctl import COMMANDS
    runs = {f"moecache-ctl {name}": lambda n=name: ctl([n, "--help"]) for name in COMMANDS}
    runs["moecache-ctl trace convert"] = lambda: ctl(["trace", "convert", "--help"])
    runs["moecache-ctl synth --runnable"] = lambda: ctl(["synth", "--runnable", "--help"])
    runs["moecache-ctl"] = lambda: ctl(["--help"])
    runs["moecached"] = lambda: daemon.main(["--help"])
    runs["python -m moecached.tools.workload"] = lambda: workload.main(["--help"])
    out = {}
    for name, run in runs.items():
        try:
            rc = run()
        except SystemExit as e:
            rc = e.code
        assert rc in (0, None), name
        out[name] = capsys.readouterr().out
        assert "usage" in out[name], name
    return out


def test_help_texts_are_plain_text(capsys):
    import re
    for name, text in _help_texts(capsys).items():
        assert "%%" not in text and "%(" not in text, (name, text)
        assert "``" not in text, (name, text)
        assert not re.search(r":(func|class|mod|meth|data|ref):`", text), (name, text)


def test_flags_named_in_messages_exist(capsys):
    """Every ``--flag`` a message names (any string in moecached/ but docstrings) is a flag
    of one of the commands."""
    import ast
    import re
    from pathlib import Path
    known = set()
    for text in _help_texts(capsys).values():
        known |= set(re.findall(r"--[a-z][a-z0-9-]*", text))
    unknown = []
    for f in sorted((Path(moecached.daemon.config.__file__).parent).glob("**/*.py")):
        tree = ast.parse(f.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for n in ast.walk(tree):
            # a string that is only a flag is an argument (of a command we run), not a message
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs \
                    and not re.fullmatch(r"--[a-z][a-z0-9-]*", n.value):
                unknown += [(f.name, n.lineno, flag) for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", n.value)
                            if flag not in known]
    assert unknown == []


@pytest.mark.parametrize("cmd", ["stats --endp ipc:///tmp/x.sock", "warm --endp ipc:///tmp/x.sock",
                                 "guard --flo 1GiB -- true", "client drop --endp ipc:///tmp/x.sock 1"])
def test_no_command_takes_an_abbreviated_option(cmd, capsys):
    # a prefix is not the longer option it begins (an admin verb must not guess which one)
    try:
        rc = ctl(cmd.split())
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --" in err or "required: --floor" in err


def test_stats_summary_counts_other_users_clients():
    # a uid that is no admin sees only its own clients: the line says how many others there are
    from moecached.tools.ctlstats import summary
    lines = [line for line in summary({"clients": [], "clients_other": 2}) if line.startswith("clients")]
    assert lines == ["clients   0 of yours, 2 of other users (an admin sees them)"]
    assert [line for line in summary({"clients": [{"name": "a"}]}) if line.startswith("clients")] == ["clients   1"]
