"""Start-up of the daemon: memory limits checked before the arena is reserved, the endpoint
locked before anything else, the arena's name survives a client that unlinks it, and progress
on stderr while it starts."""
import ctypes
import ctypes.util
import io
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon_util import start_daemon, stop_daemon
from moecached.engine.arena import Arena, remove_stale_arenas
from moecached.daemon.floor import MIN_MARGIN, MemoryLimitError, fit_arena, read_memory_limit
from moecached.engine.index import open_index
from moecached.tools.synth import verify_expert_bytes
from moecache_client import Client

MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture
def model(model_factory):
    return model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=8)


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# -- the memory limit, read from a fake cgroup tree ---------------------------------------------

def _v2_tree(tmp_path, limit, current, parent_limit="max"):
    root = tmp_path / "cg"
    _write(root / "cgroup.controllers", "cpu memory\n")
    leaf = root / "system.slice" / "moecached.service"
    _write(leaf / "memory.max", f"{limit}\n")
    _write(leaf / "memory.current", f"{current}\n")
    _write(leaf / "memory.stat", "anon 1\ninactive_file 0\n")
    _write(root / "system.slice" / "memory.max", f"{parent_limit}\n")
    _write(root / "system.slice" / "memory.current", f"{current}\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/system.slice/moecached.service\n")
    return root, proc


def test_v2_limit_refuses_with_one_line_naming_limit_budget_and_fix(tmp_path):
    root, proc = _v2_tree(tmp_path, 8 * GiB, 100 * MiB)
    s = read_memory_limit(str(root), proc_cgroup=str(proc), mem_available=lambda: 100 * GiB)
    assert s.cgroup_limit == 8 * GiB and s.limit_file == "memory.max"
    with pytest.raises(MemoryLimitError) as e:
        fit_arena(32 * GiB, s)
    msg = str(e.value)
    assert "\n" not in msg
    assert "budget 32.00 GiB" in msg
    assert "memory cgroup limit 8.00 GiB of /system.slice/moecached.service (memory.max)" in msg
    assert "lower --budget or raise MemoryMax=" in msg
    # what fits is taken as is
    assert fit_arena(4 * GiB, s) == 4 * GiB
    # exactly the room: limit - in use - the daemon's own margin
    room = 8 * GiB - 100 * MiB - MIN_MARGIN
    assert fit_arena(room, s) == room
    with pytest.raises(MemoryLimitError):
        fit_arena(room + 1, s)


def test_v2_ancestor_limit_counts(tmp_path):
    root, proc = _v2_tree(tmp_path, "max", 100 * MiB, parent_limit=2 * GiB)
    s = read_memory_limit(str(root), proc_cgroup=str(proc), mem_available=lambda: 100 * GiB)
    assert s.cgroup_limit == 2 * GiB and s.cgroup_path == "/system.slice"
    with pytest.raises(MemoryLimitError, match=r"limit 2.00 GiB of /system.slice \(memory.max\)"):
        fit_arena(3 * GiB, s)


def test_v1_limit(tmp_path):
    root = tmp_path / "cg"
    d = root / "memory" / "docker" / "abc"
    _write(d / "memory.usage_in_bytes", str(GiB))
    _write(d / "memory.limit_in_bytes", str(3 * GiB))
    _write(d / "memory.stat", "total_inactive_file 0\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("4:memory:/docker/abc\n0::/\n")
    s = read_memory_limit(str(root), proc_cgroup=str(proc), mem_available=lambda: 100 * GiB)
    assert s.limit_file == "memory.limit_in_bytes"
    with pytest.raises(MemoryLimitError) as e:
        fit_arena(4 * GiB, s)
    assert "memory cgroup limit 3.00 GiB of /docker/abc (memory.limit_in_bytes)" in str(e.value)


def test_memavailable_and_swap(tmp_path):
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/\n")
    s = read_memory_limit(str(tmp_path / "none"), proc_cgroup=str(proc), mem_available=lambda: 4 * GiB)
    assert s.cgroup_limit is None
    with pytest.raises(MemoryLimitError) as e:
        fit_arena(6 * GiB, s)
    assert "budget 6.00 GiB exceeds available memory 4.00 GiB (MemAvailable)" in str(e.value)
    # an arena that is not locked may go to swap
    assert fit_arena(6 * GiB, s, swap_free=4 * GiB) == 6 * GiB


def test_floor_sizes_the_arena_down(tmp_path):
    root, proc = _v2_tree(tmp_path, 8 * GiB, 0)
    s = read_memory_limit(str(root), proc_cgroup=str(proc), mem_available=lambda: 100 * GiB)
    got = fit_arena(32 * GiB, s, floor=GiB)
    assert got == 8 * GiB - MIN_MARGIN - GiB
    # nothing useful fits above the floor: refused, naming the floor
    with pytest.raises(MemoryLimitError, match="floor"):
        fit_arena(32 * GiB, s, floor=8 * GiB, smallest=MiB)


def test_guard_and_floor_share_one_probe():
    from moecached.daemon import floor
    from moecached.tools import guard
    assert guard.MemoryProbe is floor.MemoryProbe


# -- a real daemon in a real memory cgroup -----------------------------------------------------

def _child_cgroup(limit: int):
    """A new memory cgroup under ours with ``limit`` bytes; (dir, procs file) or skip."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a memory cgroup")
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        hier, ctrl, path = line.split(":", 2)
        if "memory" in ctrl.split(","):
            d = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / f"moecached-test-{os.getpid()}"
            try:
                d.mkdir()
                (d / "memory.limit_in_bytes").write_text(str(limit))
            except OSError as e:
                pytest.skip(f"cannot make a v1 memory cgroup: {e}")
            return d
    for line in lines:
        hier, ctrl, path = line.split(":", 2)
        if hier == "0" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            d = Path("/sys/fs/cgroup") / path.lstrip("/") / f"moecached-test-{os.getpid()}"
            try:
                d.mkdir()
                (d / "memory.max").write_text(str(limit))
                (d / "memory.swap.max").write_text("0")
            except OSError as e:
                pytest.skip(f"cannot make a v2 memory cgroup: {e}")
            return d
    pytest.skip("no memory cgroup controller")


def _run_in_cgroup(cg, argv, timeout=60):
    script = f'echo $$ > {cg}/cgroup.procs && exec "$@"'
    return subprocess.run(["sh", "-c", script, "sh", *argv], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def big_model(model_factory):
    # 4 layers x 32 experts of 2.9 MiB: 370 MiB of experts
    return model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=32)


def test_budget_over_cgroup_limit_is_refused_not_oom_killed(big_model, tmp_path):
    cg = _child_cgroup(250 * MiB)
    arena_dir = tmp_path / "shm"
    arena_dir.mkdir()
    sock = tmp_path / "d.sock"
    base = [sys.executable, "-P", "-m", "moecached.daemon", "--model", big_model,
            "--endpoint", f"ipc://{sock}", "--arena-dir", str(arena_dir), "--no-lock-memory"]
    try:
        p = _run_in_cgroup(cg, base + ["--budget", "360MiB"])
        assert p.returncode == 1, (p.returncode, p.stderr)
        err = [l for l in p.stderr.splitlines() if "ERROR" in l]
        assert len(err) == 1, p.stderr
        assert re.search(r"budget [0-9.]+ MiB exceeds the memory cgroup limit 250.00 MiB of /", err[0])
        assert "lower --budget or raise" in err[0]
        assert os.listdir(arena_dir) == []
        # with a floor the daemon starts with the arena that fits, and says so once
        p = subprocess.Popen(["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh",
                              *base, "--budget", "360MiB", "--floor", "16MiB"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.time() + 60
            while time.time() < deadline and p.poll() is None:
                try:
                    with Client(f"ipc://{sock}", connect_timeout=1) as c:
                        size = c.info["arena"]["size"]
                        lease = c.acquire(c.expert_layers[0], [3])
                        for part, view in lease.parts(3).items():
                            assert verify_expert_bytes(view, c.expert_layers[0], part, 3) is None
                        lease.release()
                    break
                except Exception:
                    time.sleep(0.2)
            assert p.poll() is None, p.stdout.read()
            assert size < 250 * MiB
        finally:
            out = stop_daemon(p)
        assert p.returncode == 0, out
        assert len(re.findall(r"sized the arena down", out)) == 1, out
    finally:
        for f in arena_dir.iterdir():
            f.unlink()
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


# -- a second daemon on a live endpoint ------------------------------------------------------

IN_CREATE, IN_MOVED_TO = 0x100, 0x80


def test_second_daemon_refuses_before_touching_an_arena(model, tmp_path):
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "16")
    try:
        other = tmp_path / "other-shm"
        other.mkdir()
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert fd >= 0
        try:
            assert libc.inotify_add_watch(fd, str(other).encode(), IN_CREATE | IN_MOVED_TO) >= 0
            p = subprocess.run([sys.executable, "-P", "-m", "moecached.daemon", "--model", model,
                                "--slots", "16", "--endpoint", f"ipc://{sock}", "--no-lock-memory",
                                "--arena-dir", str(other)],
                               capture_output=True, text=True, timeout=60)
            try:
                created = os.read(fd, 4096)
            except BlockingIOError:
                created = b""
        finally:
            os.close(fd)
        assert p.returncode == 1
        assert "another moecached (pid %d) is serving it" % d.pid in p.stderr
        assert created == b"", "the refused daemon created a file in its arena dir"
        assert "indexing" not in p.stderr and "reserving" not in p.stderr, p.stderr
        # the first one keeps serving
        with Client(f"ipc://{sock}") as c:
            L = c.expert_layers[1]
            with c.acquire(L, [5]) as lease:
                for part, view in lease.parts(5).items():
                    assert verify_expert_bytes(view, L, part, 5) is None
    finally:
        out = stop_daemon(d)
    assert d.returncode == 0, out


def test_second_daemon_refused_when_the_lock_file_was_removed(model, tmp_path):
    """Someone removed the live daemon's ``<socket>.lock`` (a clean-up of /run, ``rm *.lock``):
    a second daemon must still not take the endpoint. It used to take a fresh lock, remove the
    live socket as "stale" and bind: two arenas, the first daemon unreachable for new clients."""
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "16")
    try:
        os.unlink(sock + ".lock")
        p = subprocess.run([sys.executable, "-P", "-m", "moecached.daemon", "--model", model,
                            "--slots", "16", "--endpoint", f"ipc://{sock}", "--no-lock-memory",
                            "--arena-dir", str(tmp_path)],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 1, p.stderr
        err = [l for l in p.stderr.splitlines() if "ERROR" in l]
        assert len(err) == 1 and "is listening on" in err[0] and sock in err[0], p.stderr
        assert "indexing" not in p.stderr, p.stderr
        with Client(f"ipc://{sock}") as c:      # new clients still reach the first daemon
            assert c.status()["pid"] == d.pid
    finally:
        out = stop_daemon(d)
    assert d.returncode == 0, out


def test_removed_socket_file_is_bound_again(model, tmp_path):
    """Someone removed the live daemon's socket file (``rm /run/moecached/*``): it used to go on
    saying ``serving`` while no new client could reach it. It binds the path again at its next
    tick (one warning, ``server.socket_rebinds``); connected clients never notice."""
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "16")
    try:
        with Client(f"ipc://{sock}", name="old") as old:
            held = old.acquire(old.expert_layers[0], [1])
            os.unlink(sock)
            deadline = time.time() + 15
            while not os.path.exists(sock) and time.time() < deadline:
                time.sleep(0.1)
            assert os.path.exists(sock), "the daemon did not bind its removed socket again"
            assert oct(os.stat(sock).st_mode & 0o777) == oct(0o660)
            with Client(f"ipc://{sock}") as new:
                assert new.status()["pid"] == d.pid
                L = new.expert_layers[1]
                with new.acquire(L, [2]) as lease:
                    for part, view in lease.parts(2).items():
                        assert verify_expert_bytes(view, L, part, 2) is None
            st = old.stats()     # the old connection was never dropped: same session, lease held
            assert st["server"]["socket_rebinds"] == 1
            assert held.valid() and st["pinned"] == 1
            # one connection of "old" (a dropped one would have come back as a second client)
            assert sum(x["name"].split("#")[0] == "old" for x in st["clients"]) == 1, st["clients"]
            held.release()
    finally:
        out = stop_daemon(d)
    assert d.returncode == 0, out
    assert len(re.findall(r"socket .* was removed", out)) == 1, out


# -- the arena survives a client that unlinks it ---------------------------------------------

def test_arena_opened_with_shared_memory_stays_reachable(model, tmp_path):
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "16", "--log-level", "info")
    try:
        with Client(f"ipc://{sock}") as c:
            path = c.info["arena"]["path"]
        assert os.path.dirname(path) == "/dev/shm"
        name = os.path.basename(path)
        code = ("from multiprocessing.shared_memory import SharedMemory\n"
                f"s = SharedMemory(name={name!r})\nprint(s.size)\ns.close()\n")
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert child.returncode == 0, child.stderr
        # the child's resource tracker unlinks the name once the child is gone; the daemon
        # puts it back at its next tick
        deadline = time.time() + 15
        relinks = 0
        while time.time() < deadline:
            with Client(f"ipc://{sock}", map_arena=False) as c:
                relinks = c.stats().get("arena", {}).get("relinks", 0)
            if relinks:
                break
            time.sleep(0.2)
        with Client(f"ipc://{sock}") as c:
            assert c.info["arena"]["path"] == path
            L = c.expert_layers[2]
            with c.acquire(L, [1, 6]) as lease:
                for e in (1, 6):
                    for part, view in lease.parts(e).items():
                        assert verify_expert_bytes(view, L, part, e) is None
            st = c.stats()["arena"]
            status = c.status()
        assert relinks == 1 and st["relinks"] == 1 and st["problem"] is None
        assert status["state"] == "serving"
    finally:
        out = stop_daemon(d)
    assert d.returncode == 0, out
    assert len(re.findall(r"arena .* was unlinked", out)) == 1, out
    assert not os.path.exists(path)
    assert not [n for n in os.listdir("/dev/shm") if name in n]


def test_arena_relinks_its_name_and_reports_what_it_cannot_repair(model, tmp_path):
    idx = open_index(model)
    a = Arena(idx, slots=8, dir=str(tmp_path), lock=False)
    try:
        a.view(a.classes[0].id, 0, a.classes[0].parts[0])[:4] = [1, 2, 3, 4]
        ino = os.stat(a.path).st_ino
        assert a.check_link() == "ok"
        os.unlink(a.path)
        assert a.check_link() == "relinked"
        assert os.stat(a.path).st_ino == ino and a.relinks == 1
        with open(a.path, "rb") as f:
            f.seek(a.classes[0].part_off[a.classes[0].parts[0]])
            assert f.read(4) == bytes([1, 2, 3, 4])
        # both names gone: nothing left to link from
        os.unlink(a.path)
        os.unlink(a.keep_path)
        r = a.check_link()
        assert r != "ok" and "cannot" in r and a.link_problem == r
        assert a.check_link() == r  # stays reported, not repeated work
    finally:
        a.close()
    assert os.listdir(tmp_path) == []


def test_stale_cleanup_removes_both_names(model, tmp_path):
    idx = open_index(model)
    live = Arena(idx, slots=8, dir=str(tmp_path), lock=False)
    try:
        # a dead daemon's arena: both names, nobody holds the lock
        dead = tmp_path / "moecached-1-deadbeef"
        dead.write_bytes(b"x" * 4096)
        os.link(dead, tmp_path / ".moecached-1-deadbeef")
        # a dead daemon's arena whose public name a client unlinked
        (tmp_path / ".moecached-2-cafecafe").write_bytes(b"y" * 4096)
        removed = remove_stale_arenas(str(tmp_path))
        # one entry per arena, by its public name when it still had one
        assert [os.path.basename(p) for p in removed] == [".moecached-2-cafecafe", "moecached-1-deadbeef"]
        assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(live.path),
                                                       os.path.basename(live.keep_path)])
    finally:
        live.close()
    assert os.listdir(tmp_path) == []


# -- progress ---------------------------------------------------------------------------------

class _Tty(io.StringIO):
    def isatty(self):
        return True


def _progress_run(stream):
    from moecached.daemon.logs import setup_logging, stage
    h = setup_logging("info", stream=stream, journal=False)
    try:
        with stage("reserving and locking 1.00 GiB", total=100) as st:
            for i in range(0, 101, 10):
                st.update(i)
        with stage("indexing m.gguf"):
            pass
    finally:
        logging.getLogger().removeHandler(h)
    return stream.getvalue()


def test_progress_one_line_per_stage_when_not_a_tty():
    out = _progress_run(io.StringIO())
    lines = out.splitlines()
    assert len(lines) == 2, out
    assert "reserving and locking 1.00 GiB" in lines[0] and "indexing m.gguf" in lines[1]
    assert "\r" not in out


def test_progress_live_percentage_on_a_tty():
    out = _progress_run(_Tty())
    assert "\r" in out and "50%" in out and "100%" in out
    assert out.count("indexing m.gguf") == 1


def test_daemon_says_what_it_is_doing(model, tmp_path):
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "16", "--log-level", "info")
    out = stop_daemon(d)
    assert d.returncode == 0, out
    stages = [m for m in ("indexing", "experts", "reserving", "ready") if m in out]
    assert stages == ["indexing", "experts", "reserving", "ready"], out
    i = out.index
    assert i("indexing") < i("reserving") < i("ready")


def test_budget_below_the_models_minimum_exits_2(model, tmp_path):
    # a configuration no start can serve with: exit 2 (systemd's RestartPreventExitStatus), one
    # line naming the minimum; not 1, which the unit restarts every 2 s
    p = subprocess.run([sys.executable, "-P", "-m", "moecached.daemon", "--model", model, "--budget", "1KiB",
                        "--endpoint", f"ipc://{tmp_path}/d.sock", "--no-lock-memory"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, (p.returncode, p.stderr)
    err = [l for l in p.stderr.splitlines() if "ERROR" in l]
    assert len(err) == 1 and "budget 1024 bytes gives size class(es)" in err[0] and "raise the budget" in err[0], p.stderr
