"""``moecache-ctl guard``: kills a command that allocates past the floor, leaves others alone.

The real-memory tests size the floor relative to MemAvailable at the time of the test: the
floor sits ~1 GiB under what is available now, the hog touches up to 2.5 GiB, so it must cross
the floor; the well-behaved command touches 64 MiB with the floor 3 GiB under MemAvailable.
"""
import io
import shlex
import signal
import subprocess
import sys
import time

import psutil
import pytest

from moecached.tools import guard
from moecached.tools.guard import EXIT_FLOOR, MemoryProbe, MemorySample, run_guarded
from moecached.facts.units import format_bytes

from daemon_util import HOG

GiB = 1 << 30
MiB = 1 << 20


def _ctl(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "moecached.tools.ctl", "guard", *args],
                          capture_output=True, text=True, timeout=timeout)


def _pid_alive(pid):
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_kills_hog_past_floor_and_its_group(tmp_path):
    avail = psutil.virtual_memory().available
    if avail < 6 * GiB:
        pytest.skip(f"needs 6 GiB available, have {format_bytes(avail)}")
    floor = avail - 1 * GiB
    pidfile = tmp_path / "grandchild.pid"
    t0 = time.monotonic()
    r = _ctl("--floor", str(floor), "--interval", "0.05", "--grace", "1", "--",
             sys.executable, "-c", HOG, str(int(2.5 * GiB)), str(pidfile))
    elapsed = time.monotonic() - t0
    assert r.returncode == EXIT_FLOOR, (r.returncode, r.stdout, r.stderr)
    assert "HOG-SURVIVED" not in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    msg = lines[0]
    assert msg.startswith("moecache-ctl guard: available memory ")
    assert f"fell under the floor {format_bytes(floor, precision=2)}" in msg
    assert "killed process group" in msg and sys.executable in msg
    assert "\\nimport os, sys, time, subprocess\\n" in msg   # newlines escaped: one line
    assert elapsed < 45
    # the grandchild was in the hog's process group and must be gone too
    gpid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _pid_alive(gpid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pid_alive(gpid)


@pytest.mark.slow
def test_leaves_well_behaved_command_alone():
    avail = psutil.virtual_memory().available
    if avail < 5 * GiB:
        pytest.skip(f"needs 5 GiB available, have {format_bytes(avail)}")
    floor = avail - 3 * GiB
    code = HOG.replace("time.sleep(60)", "sys.exit(7)")
    r = _ctl("--floor", str(floor), "--interval", "0.05", "--", sys.executable, "-c", code, str(64 * MiB))
    assert r.returncode == 7, (r.stdout, r.stderr)
    assert "HOG-SURVIVED" in r.stdout
    assert r.stderr == ""


def test_exit_codes_pass_through():
    assert _ctl("--floor", "1M", "--", "sh", "-c", "exit 3").returncode == 3
    assert _ctl("--floor", "1M", "--", "true").returncode == 0
    r = _ctl("--floor", "1M", "--", "sh", "-c", "kill -9 $$")
    assert r.returncode == 128 + signal.SIGKILL
    r = _ctl("--floor", "1M", "--", "/nonexistent/moecache-test-cmd")
    assert r.returncode == 127
    assert r.stderr.strip() == "moecache-ctl guard: command not found: /nonexistent/moecache-test-cmd"


def test_refuses_to_start_under_floor():
    r = _ctl("--floor", "1PiB", "--", "sh", "-c", "echo RAN")
    assert r.returncode == EXIT_FLOOR
    assert "RAN" not in r.stdout
    assert "is already under the floor 1.00 PiB; not starting: sh -c 'echo RAN'" in r.stderr


def test_usage_errors():
    r = _ctl("--floor", "8GG", "--", "true")
    assert r.returncode == 2
    assert "invalid --floor '8GG'" in r.stderr
    r = _ctl("--floor", "1G")
    assert r.returncode == 2 and "no command given" in r.stderr
    r = _ctl("--floor", "1G", "--interval", "0", "--", "true")
    assert r.returncode == 2 and "--interval 0.0: expected seconds > 0" in r.stderr
    assert guard.main(["--floor", "1G"]) == 2


class FakeProbe:
    """Available memory drops under the floor after ``drop_after`` samples."""

    def __init__(self, high, low, drop_after):
        self.high, self.low, self.n, self.drop_after = high, low, 0, drop_after

    def sample(self):
        self.n += 1
        a = self.low if self.n > self.drop_after else self.high
        return MemorySample(a, a)


def test_sigterm_then_sigkill_after_grace():
    # a command that ignores SIGTERM must still die, after the grace period
    err = io.StringIO()
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    t0 = time.monotonic()
    r = run_guarded([sys.executable, "-c", code], floor=10 * GiB, interval=0.05, grace=0.5,
                    probe=FakeProbe(20 * GiB, 5 * GiB, drop_after=10), stderr=err)
    assert r.returncode == EXIT_FLOOR and r.killed
    assert 0.5 <= time.monotonic() - t0 < 10
    assert not _pid_alive(r.pid)
    assert err.getvalue().strip() == (
        f"moecache-ctl guard: available memory 5.00 GiB (MemAvailable) fell under the floor 10.00 GiB (by 5.0 GiB); "
        f"killed process group {r.pid}: {shlex.join([sys.executable, '-c', code])}")


def test_fake_probe_no_drop_returns_command_status():
    r = run_guarded(["sh", "-c", "sleep 0.3; exit 5"], floor=GiB, interval=0.05,
                    probe=FakeProbe(2 * GiB, 0, drop_after=10 ** 9), stderr=io.StringIO())
    assert r.returncode == 5 and not r.killed


# -- MemoryProbe's cgroup maths on a fake tree ---------------------------------------------------

def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_probe_cgroup_v2_headroom(tmp_path):
    root = tmp_path / "cg"
    _write(root / "cgroup.controllers", "cpu memory\n")
    leaf = root / "system.slice" / "moecached.service"
    _write(leaf / "memory.max", "max\n")          # leaf unlimited ...
    _write(leaf / "memory.current", "123\n")
    _write(root / "system.slice" / "memory.max", str(4 * GiB) + "\n")   # ... parent limited
    _write(root / "system.slice" / "memory.current", str(3 * GiB) + "\n")
    _write(root / "system.slice" / "memory.stat", f"anon 1\ninactive_file {512 * MiB}\nactive_file 9\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/system.slice/moecached.service\n")
    p = MemoryProbe(proc_cgroup=str(proc), cgroup_root=str(root), mem_available=lambda: 10 * GiB)
    s = p.sample()
    # headroom = 4 GiB - (3 GiB - 512 MiB) = 1.5 GiB
    assert s.cgroup_headroom == 1536 * MiB
    assert s.available == 1536 * MiB
    assert s.source == "cgroup /system.slice"
    assert s.mem_available == 10 * GiB
    # MemAvailable smaller than headroom: it wins
    p2 = MemoryProbe(proc_cgroup=str(proc), cgroup_root=str(root), mem_available=lambda: GiB)
    assert p2.available() == GiB and p2.sample().source == "MemAvailable"
    # usage above the limit clamps at 0
    _write(root / "system.slice" / "memory.current", str(5 * GiB) + "\n")
    assert p.available() == 0


def test_probe_cgroup_v1_headroom(tmp_path):
    root = tmp_path / "cg"
    d = root / "memory" / "docker" / "abc"
    _write(d / "memory.usage_in_bytes", str(2 * GiB))
    _write(d / "memory.limit_in_bytes", str(3 * GiB))
    _write(d / "memory.stat", f"cache 5\ntotal_inactive_file {GiB}\nhierarchical_memory_limit {3 * GiB}\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("4:memory:/docker/abc\n0::/\n")
    p = MemoryProbe(proc_cgroup=str(proc), cgroup_root=str(root), mem_available=lambda: 10 * GiB)
    assert p.available() == 2 * GiB  # 3 GiB - (2 GiB - 1 GiB)
    # unlimited (v1 writes 2**63 - 4096) -> MemAvailable
    _write(d / "memory.stat", "total_inactive_file 0\nhierarchical_memory_limit 9223372036854771712\n")
    assert p.available() == 10 * GiB


def test_probe_real_machine_is_sane():
    s = MemoryProbe().sample()
    assert 0 < s.available <= s.mem_available <= psutil.virtual_memory().total
