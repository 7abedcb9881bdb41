"""sd_notify: a NOTIFY_SOCKET the test provides receives READY=1, STATUS=, WATCHDOG=1."""
import io
import logging
import os
import subprocess
import sys

import pytest

from moecached.daemon import logs, notify
from notify_receiver import NotifyReceiver


@pytest.mark.parametrize("abstract", [False, True])
def test_ready_reaches_test_socket(monkeypatch, abstract):
    with NotifyReceiver(abstract=abstract) as r:
        monkeypatch.setenv("NOTIFY_SOCKET", r.address)
        assert r.address.startswith("@") == abstract
        assert notify.status("indexing\nmodel") is True
        assert notify.ready("serving 10 slots") is True
        assert r.wait_for("READY=1") == "READY=1\nSTATUS=serving 10 slots"
        assert r.messages[0] == "STATUS=indexing model"
        assert notify.watchdog_ping()
        assert r.wait_for("WATCHDOG=1") == "WATCHDOG=1"
        assert notify.reloading()
        m = r.wait_for("RELOADING=1")
        assert m.split("\n")[1].startswith("MONOTONIC_USEC=")
        assert notify.stopping()
        assert r.wait_for("STOPPING=1") == "STOPPING=1"


def test_ready_from_a_child_process():
    # the way systemd sees it: another process, environment variable only
    with NotifyReceiver() as r:
        env = dict(os.environ, NOTIFY_SOCKET=r.address)
        subprocess.run([sys.executable, "-c", "from moecached.daemon import notify; assert notify.ready()"],
                       env=env, check=True, timeout=30)
        assert r.wait_for("READY=1") == "READY=1"


def test_noop_without_socket(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify.notify("READY=1") is False
    assert notify.ready() is False
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent/notify.sock")
    assert notify.ready() is False            # failure is quiet
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    assert notify.ready() is False


def test_unset_environment(monkeypatch):
    with NotifyReceiver() as r:
        monkeypatch.setenv("NOTIFY_SOCKET", r.address)
        assert notify.notify("READY=1", unset_environment=True)
        assert "NOTIFY_SOCKET" not in os.environ
        assert r.wait_for("READY=1")


def test_wait_for_times_out():
    with NotifyReceiver() as r:
        with pytest.raises(TimeoutError):
            r.wait_for("READY=1", timeout=0.2)


def test_watchdog_interval(monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert notify.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert notify.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert notify.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert notify.watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_PID")
    monkeypatch.setenv("WATCHDOG_USEC", "garbage")
    assert notify.watchdog_interval() is None


# -- logs -----------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_journal_prefixes():
    buf = io.StringIO()
    logs.setup_logging("debug", stream=buf, journal=True)
    log = logging.getLogger("moecached.test")
    log.info("hello")
    log.warning("careful")
    log.debug("detail")
    log.error("two\nlines")
    assert buf.getvalue().splitlines() == [
        "<6>moecached.test: hello", "<4>moecached.test: careful", "<7>moecached.test: detail",
        "<3>moecached.test: two", "<3>lines"]


def test_plain_format_and_level():
    buf = io.StringIO()
    logs.setup_logging("warning", stream=buf, journal=False)
    log = logging.getLogger("moecached.test")
    log.info("hidden")
    log.warning("shown")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].endswith(" WARNING moecached.test: shown")
    logs.set_level("info")
    log.info("now shown")
    assert buf.getvalue().splitlines()[-1].endswith(" INFO moecached.test: now shown")
    with pytest.raises(ValueError):
        logs.setup_logging("loud", stream=buf)
    # setup twice replaces, not duplicates
    logs.setup_logging("info", stream=buf, journal=False)
    n = len(buf.getvalue().splitlines())
    log.info("once")
    assert len(buf.getvalue().splitlines()) == n + 1


def test_under_journald_detects_matching_stream(monkeypatch, tmp_path):
    f = open(tmp_path / "err", "w")
    st = os.fstat(f.fileno())
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    assert logs.under_journald(f)
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")
    assert not logs.under_journald(f)
    monkeypatch.delenv("JOURNAL_STREAM")
    assert not logs.under_journald(f)
    f.close()
