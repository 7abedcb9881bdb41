"""systemd/moecached.service and moecached-metrics.service (the Prometheus exporter) pass
``systemd-analyze verify``; the sysusers snippet applies; the exit status that stops restarts is
the one the daemon gives a refused configuration.

CI (Debian, root) needs ``apt-get install -y systemd`` for systemd-analyze / systemd-sysusers;
the tests skip when they are missing. systemd need not be PID 1.

``verify`` refuses a unit whose ExecStart binary does not exist, and the daemon is not installed
at /usr/local/bin in a test run, so the unit is verified as a copy whose ExecStart points at a
stub executable; every other line is the real file's. ``verify`` exits 0 even for unknown keys or
bad values (it only warns), so any output at all fails the test.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
UNIT = os.path.join(HERE, "..", "systemd", "moecached.service")
METRICS_UNIT = os.path.join(HERE, "..", "systemd", "moecached-metrics.service")
SYSUSERS = os.path.join(HERE, "..", "systemd", "moecached.sysusers")
ANALYZE = shutil.which("systemd-analyze")
SYSUSERS_BIN = shutil.which("systemd-sysusers")
EXEC = "/usr/local/bin/moecached"
METRICS_EXEC = "/usr/local/bin/moecache-ctl"


def _verify(text, tmp_path, name="moecached.service", exe=EXEC):
    stub = tmp_path / os.path.basename(exe)
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    assert f"ExecStart={exe} " in text
    unit = tmp_path / name
    unit.write_text(text.replace(f"ExecStart={exe} ", f"ExecStart={stub} "))
    r = subprocess.run([ANALYZE, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=120)
    return r.returncode, (r.stdout + r.stderr).strip()


def _unit_text(path=UNIT):
    with open(path) as f:
        return f.read()


def _settings(text) -> dict:
    settings = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z]+)=(.*)$", line)
        if m:
            settings.setdefault(m.group(1), []).append(m.group(2))
    return settings


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed (apt-get install -y systemd)")
def test_unit_verifies_cleanly(tmp_path):
    rc, out = _verify(_unit_text(), tmp_path)
    assert rc == 0 and out == "", out


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed (apt-get install -y systemd)")
@pytest.mark.parametrize("bad", [("Type=notify", "Type=notifyy"), ("ProtectSystem=strict", "ProtectSystem=bogus"),
                                 ("LimitMEMLOCK=infinity", "LimitMEMLOK=infinity")])
def test_verify_catches_mistakes(tmp_path, bad):
    # proves the check above can fail
    rc, out = _verify(_unit_text().replace(*bad), tmp_path)
    assert rc != 0 or out != ""


def test_unit_has_required_settings():
    text = _unit_text()
    settings = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z]+)=(.*)$", line)
        if m:
            settings.setdefault(m.group(1), []).append(m.group(2))
    want = {"Type": "notify", "LimitMEMLOCK": "infinity", "RuntimeDirectory": "moecached", "User": "moecached",
            "Group": "moecached", "ProtectSystem": "strict", "PrivateTmp": "yes", "NoNewPrivileges": "yes",
            "Restart": "on-failure", "ExecReload": "/bin/kill -HUP $MAINPID"}
    for k, v in want.items():
        assert settings.get(k) == [v], (k, settings.get(k))
    assert settings["ProtectHome"][0] in ("read-only", "yes")
    assert "/dev/shm" in settings["ReadWritePaths"]
    assert settings["ExecStart"] == [f"{EXEC} --config /etc/moecached/moecached.toml"]
    assert re.search(r"^# ?WatchdogSec=", text, re.M)


@pytest.mark.skipif(SYSUSERS_BIN is None, reason="systemd-sysusers not installed (apt-get install -y systemd)")
def test_sysusers_creates_user_and_group(tmp_path):
    (tmp_path / "etc").mkdir()
    r = subprocess.run([SYSUSERS_BIN, f"--root={tmp_path}", SYSUSERS], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    passwd = (tmp_path / "etc" / "passwd").read_text()
    group = (tmp_path / "etc" / "group").read_text()
    assert re.search(r"^moecached:x:\d+:\d+:[^:]*:/:/usr/sbin/nologin$", passwd, re.M), passwd
    assert re.search(r"^moecached:x:\d+:", group, re.M), group


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed (apt-get install -y systemd)")
def test_metrics_unit_verifies_cleanly(tmp_path):
    rc, out = _verify(_unit_text(METRICS_UNIT), tmp_path, "moecached-metrics.service", METRICS_EXEC)
    assert rc == 0 and out == "", out


def test_metrics_unit_runs_the_exporter_on_the_daemons_socket():
    st = _settings(_unit_text(METRICS_UNIT))
    (cmd,) = st["ExecStart"]
    argv = cmd.split()
    assert argv[:2] == [METRICS_EXEC, "metrics"]
    (daemon_cmd,) = _settings(_unit_text())["ExecStart"]
    assert "--endpoint" in argv and argv[argv.index("--endpoint") + 1] == "ipc:///run/moecached/moecached.sock"
    assert daemon_cmd.startswith(EXEC + " ")
    assert st["SupplementaryGroups"] == ["moecached"] and st["DynamicUser"] == ["yes"]
    assert st["After"] == ["moecached.service network.target"] and "Requires" not in st and "BindsTo" not in st
    assert st["RestartPreventExitStatus"] == ["2"] and st["WantedBy"] == ["multi-user.target"]
    # the exporter accepts the unit's arguments: one scrape with no daemon there says moecached_up 0
    pytest.importorskip("prometheus_client")
    r = subprocess.run([sys.executable, "-P", "-m", "moecached.tools.ctl", *argv[1:], "--once"],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(HERE, ".."),
                                                                        os.environ.get("PYTHONPATH", "")])))
    assert r.returncode == 0 and re.search(r"^moecached_up 0(\.0)?$", r.stdout, re.M), r.stdout + r.stderr


def test_restarts_stop_at_a_refused_configuration(tmp_path, capsys):
    """RestartPreventExitStatus= lists what moecached returns for a configuration it refuses
    (a bad value in the file, no model), and neither a failed start (1) nor the exit of a
    changed model file (3), which a restart is for."""
    from moecached import daemon
    from moecached.daemon.reload import EXIT_MODEL_CHANGED
    (prevent,) = _settings(_unit_text())["RestartPreventExitStatus"]
    prevent = {int(x) for x in prevent.split()}
    bad = tmp_path / "bad.toml"
    bad.write_text('model = "/nonexistent/model.gguf"\nreaders = 0\n')
    nomodel = tmp_path / "nomodel.toml"
    nomodel.write_text("readers = 4\n")
    for cfg in (bad, nomodel):
        rc = daemon.main(["--config", str(cfg), "--endpoint", f"ipc://{tmp_path}/d.sock"])
        err = capsys.readouterr().err
        assert rc in prevent and err.startswith("moecached: error:") and len(err.strip().splitlines()) == 1, (rc, err)
    assert not prevent & {0, 1, EXIT_MODEL_CHANGED}


ARENA_MOUNT = os.path.join(HERE, "..", "systemd", "run-moecached\\x2darena.mount")


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed (apt-get install -y systemd)")
def test_arena_mount_unit_verifies_cleanly(tmp_path):
    unit = tmp_path / os.path.basename(ARENA_MOUNT)
    unit.write_text(_unit_text(ARENA_MOUNT))
    r = subprocess.run([ANALYZE, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and (r.stdout + r.stderr).strip() == "", r.stdout + r.stderr
    # the check can fail: a mount unit named for another path is refused
    other = tmp_path / "run-moecached.mount"
    other.write_text(_unit_text(ARENA_MOUNT))
    r = subprocess.run([ANALYZE, "verify", "--man=no", str(other)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 or (r.stdout + r.stderr).strip() != ""


def test_arena_mount_is_where_the_daemon_may_write_and_gives_huge_pages(tmp_path):
    st = _settings(_unit_text(ARENA_MOUNT))
    (where,) = st["Where"]
    assert "-" + where in _settings(_unit_text())["ReadWritePaths"]   # (absent: ignored)
    assert "Before" in st and st["Before"] == ["moecached.service"]
    (opts,) = st["Options"]
    assert "huge=within_size" in opts.split(",")
    example = open(os.path.join(HERE, "..", "systemd", "moecached.toml.example")).read()
    assert f'"{where}"' in example
    # the unit's options, the service user's ids as root's (the user may not exist here), give
    # a tmpfs the arena takes 2 MiB pages from
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    from moecached.engine.hostmem import tmpfs_huge
    mnt = tmp_path / "arena"
    mnt.mkdir()
    o = ",".join("uid=0" if x.startswith("uid=") else "gid=0" if x.startswith("gid=") else x for x in opts.split(","))
    if subprocess.run(["mount", "-t", "tmpfs", "-o", o, "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs with huge= here")
    try:
        assert tmpfs_huge(str(mnt)) == "within_size"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
