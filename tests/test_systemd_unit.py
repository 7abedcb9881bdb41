"""systemd/moecached.service passes ``systemd-analyze verify``; the sysusers snippet applies.

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

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
UNIT = os.path.join(HERE, "..", "systemd", "moecached.service")
SYSUSERS = os.path.join(HERE, "..", "systemd", "moecached.sysusers")
ANALYZE = shutil.which("systemd-analyze")
SYSUSERS_BIN = shutil.which("systemd-sysusers")
EXEC = "/usr/local/bin/moecached"


def _verify(text, tmp_path, name="moecached.service"):
    stub = tmp_path / "moecached"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    assert f"ExecStart={EXEC} " in text
    unit = tmp_path / name
    unit.write_text(text.replace(f"ExecStart={EXEC} ", f"ExecStart={stub} "))
    r = subprocess.run([ANALYZE, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=120)
    return r.returncode, (r.stdout + r.stderr).strip()


def _unit_text():
    with open(UNIT) as f:
        return f.read()


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
