"""The service contract against a real daemon process: READY=1 to a test NOTIFY_SOCKET, the
memory floor shrinking the arena for real (Shmem falls) and growing back, and access control
by group with a second user."""
import grp
import os
import pwd
import shutil
import subprocess
import time

import pytest

from daemon_util import start_daemon, stop_daemon
from moecache_client import Client
from notify_receiver import NotifyReceiver
from moecached.tools.synth import verify_expert_bytes


def shmem_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem line")


def mem_available() -> int:
    import psutil
    return psutil.virtual_memory().available


def test_ready_notification(model_factory, tmp_path):
    model = model_factory("qwen3-30b-a3b-Q4_K_M", layers=2, experts=8)
    r = NotifyReceiver()
    try:
        env = dict(os.environ, NOTIFY_SOCKET=r.address)
        d = start_daemon(model, str(tmp_path / "d.sock"), "--slots", "8", env=env)
        try:
            m = r.wait_for("READY=1", timeout=10)
            assert any(l.startswith("STATUS=serving") for l in m.split("\n")), m
            assert f"MAINPID={d.pid}" in m.split("\n")
        finally:
            stop_daemon(d)
        r.wait_for("STOPPING=1", timeout=10)
    finally:
        r.close()


def test_reload_and_long_start_are_told_to_systemd(model_factory, tmp_path):
    """SIGHUP: RELOADING=1 (with MONOTONIC_USEC, systemd >= 253) then READY=1, also when the
    new file is refused; while the arena is reserved the start asks for more time
    (EXTEND_TIMEOUT_USEC), so a big arena does not run into TimeoutStartSec."""
    model = model_factory("qwen3-30b-a3b-Q4_K_M", layers=2, experts=8)
    conf = tmp_path / "d.toml"
    conf.write_text("heartbeat_s = 5\n")
    r = NotifyReceiver()
    try:
        env = dict(os.environ, NOTIFY_SOCKET=r.address)
        d = start_daemon(model, str(tmp_path / "d.sock"), "--slots", "8", "--config", str(conf), env=env)
        try:
            r.wait_for("READY=1", timeout=10)
            before = list(r.messages)
            ext = [l for m in before for l in m.split("\n") if l.startswith("EXTEND_TIMEOUT_USEC=")]
            assert ext and all(int(l.split("=")[1]) >= 30_000_000 for l in ext), before
            for body in ("heartbeat_s = 7\n", "heartbeat_s = \"soon\"\n"):   # applied, refused
                conf.write_text(body)
                n = len(r.messages)
                d.send_signal(1)
                m = r.wait_for("RELOADING=1", timeout=10, since=n)
                assert any(l.startswith("MONOTONIC_USEC=") for l in m.split("\n")), m
                r.wait_for("READY=1", timeout=10, since=n + 1)
                seen = [x for x in r.messages[n:] if "RELOADING=1" in x or "READY=1" in x]
                assert "RELOADING=1" in seen[0] and "READY=1" in seen[-1], seen
        finally:
            stop_daemon(d)
    finally:
        r.close()


def _write_conf(path, floor, extra=""):
    path.write_text(f'floor = "{floor}"\nfloor_hysteresis = "64MiB"\nfloor_interval_s = 0.2\n'
                    f'floor_min_change_s = 0.5\nmin_budget = "32MiB"\n{extra}')


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for memory locking")
def test_floor_shrinks_for_real_and_regrows(model_factory, tmp_path):
    # 4 layers x 64 experts of Qwen3-30B-A3B sizes: ~0.75 GiB arena
    model = model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 7, 8], experts=64)
    conf = tmp_path / "m.toml"
    _write_conf(conf, "1GiB")
    sock = str(tmp_path / "d.sock")
    shm0 = shmem_bytes()
    d = start_daemon(model, sock, "--slots", "256", "--config", str(conf))
    c = Client(f"ipc://{sock}", timeout=60)
    try:
        arena = c.info["arena"]["path"]
        size = os.path.getsize(arena)
        assert os.stat(arena).st_blocks * 512 >= size * 0.99  # reserved up front
        shm_full = shmem_bytes()
        L = c.expert_layers
        for l in L:  # fill the cache
            c.acquire(l, list(range(64))).release()
        held = c.acquire(L[0], [1, 2, 3])  # a lease survives the shrink
        # raise the floor 300 MiB above what is available now: the daemon must give back memory
        _write_conf(conf, f"{(mem_available() + (300 << 20)) >> 20}MiB")
        d.send_signal(1)  # SIGHUP: reload
        t0 = time.time()
        while time.time() - t0 < 20:
            st = c.stats()
            if st["budget"]["current_bytes"] < st["budget"]["configured_bytes"] - (250 << 20):
                break
            time.sleep(0.2)
        assert st["floor"]["shrinks"] >= 1, st["floor"]
        allocated = os.stat(arena).st_blocks * 512
        assert allocated <= size - (250 << 20), (allocated, size)       # holes punched
        assert shmem_bytes() < shm_full - (200 << 20)                    # Shmem fell
        # clients keep working and bytes stay right, the old lease too
        for e in (1, 2, 3):
            for part, v in held.parts(e).items():
                assert verify_expert_bytes(v, L[0], part, e, 0) is None
        held.release()
        for l in L:
            with c.acquire(l, [5, 9, 63]) as lease:
                for e in (5, 9, 63):
                    for part, v in lease.parts(e).items():
                        assert verify_expert_bytes(v, l, part, e, 0) is None
        # pressure ends: lower the floor, the budget grows back to the configured size
        _write_conf(conf, "256MiB")
        d.send_signal(1)
        t0 = time.time()
        while time.time() - t0 < 30:
            st = c.stats()
            if st["budget"]["current_bytes"] == st["budget"]["configured_bytes"]:
                break
            time.sleep(0.3)
        assert st["budget"]["current_bytes"] == st["budget"]["configured_bytes"], st["floor"]
        assert st["floor"]["grows"] >= 1
        assert os.stat(arena).st_blocks * 512 >= size * 0.99
    finally:
        c.close()
        stop_daemon(d)
    assert not os.path.exists(arena)  # arena removed on stop
    del shm0


@pytest.fixture
def two_users():
    if os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("perl") is None:
        pytest.skip("needs root, useradd and perl")
    names = ("mctest_in", "mctest_out", "mctestgrp")
    for n in names[:2]:
        subprocess.run(["userdel", n], capture_output=True)
    subprocess.run(["groupdel", names[2]], capture_output=True)
    subprocess.run(["groupadd", names[2]], check=True)
    subprocess.run(["useradd", "-M", "-G", names[2], names[0]], check=True)
    subprocess.run(["useradd", "-M", names[1]], check=True)
    yield names
    for n in names[:2]:
        subprocess.run(["userdel", n], capture_output=True)
    subprocess.run(["groupdel", names[2]], capture_output=True)


# The probe runs as another user, who cannot reach root's Python; perl-base is on every Debian.
PROBE = r"""
use IO::Socket::UNIX; use Fcntl;
my ($sock, $arena) = @ARGV;
my $ro = sysopen(my $f, $arena, O_RDONLY) ? "ok" : "$!";
my $rw = sysopen(my $g, $arena, O_RDWR) ? "ok" : "$!";
my $s = IO::Socket::UNIX->new(Type => SOCK_STREAM(), Peer => $sock);
my $conn = $s ? "ok" : "$!";
print "$ro|$rw|$conn\n";
"""


def test_group_access_control(model_factory, tmp_path, two_users):
    member, outsider, group = two_users
    gid = grp.getgrnam(group).gr_gid
    model = model_factory("qwen3-30b-a3b-Q4_K_M", layers=2, experts=8)
    import tempfile
    from pathlib import Path
    run = Path(tempfile.mkdtemp(prefix="moecached-run-", dir="/tmp"))  # pytest's tmp is 0700
    os.chown(run, 0, gid)
    os.chmod(run, 0o750)
    sock = str(run / "d.sock")
    d = start_daemon(model, sock, "--slots", "8", "--group", group)
    try:
        with Client(f"ipc://{sock}") as c:
            arena = c.info["arena"]["path"]
        assert os.stat(sock).st_mode & 0o777 == 0o660 and os.stat(sock).st_gid == gid
        assert os.stat(arena).st_mode & 0o777 == 0o640 and os.stat(arena).st_gid == gid
        res = {}
        for user in (member, outsider):
            pw = pwd.getpwnam(user)
            groups = [g.gr_gid for g in grp.getgrall() if user in g.gr_mem]

            def drop(pw=pw, groups=groups):
                os.setgroups(groups)
                os.setgid(pw.pw_gid)
                os.setuid(pw.pw_uid)
            p = subprocess.run(["perl", "-e", PROBE, sock, arena], capture_output=True, text=True,
                               preexec_fn=drop, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
            assert p.returncode == 0, p.stderr
            res[user] = p.stdout.strip()
        # a member maps the arena read-only and connects; an outsider can do neither
        assert res[member] == "ok|Permission denied|ok", res
        assert res[outsider] == "Permission denied|Permission denied|Permission denied", res
    finally:
        stop_daemon(d)
        shutil.rmtree(run, ignore_errors=True)
