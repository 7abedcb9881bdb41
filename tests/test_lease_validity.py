"""A lease is valid, or its holder knows it is not.

Real daemon processes and real client processes: stalls (SIGSTOP past the heartbeat) of a
client and of the daemon, exits, releases, restarts, revocation of an unwatched client.
Every byte read through a lease that still says ``valid()`` is checked against the model.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import moecache_client
from daemon_util import start_daemon, stop_daemon, wait_for
from moecache_client import Client, LeaseInvalid
from moecached.engine.arena import EPOCH_OFF, remove_stale_arenas
from moecached.tools.synth import verify_expert_bytes


@pytest.fixture
def model(model_factory):
    # 4 blocks x 16 experts of real Qwen3-30B-A3B Q4_K_M sizes (two size classes)
    return model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 7, 8], experts=16)


def bytes_ok(lease, layer, experts):
    """Copy every part of ``experts``, then check the lease; True when the copies are right."""
    copies = {e: {p: np.array(v) for p, v in lease.parts(e, layer).items()} for e in experts}
    assert lease.valid(), "lease went invalid while the test held it"
    for e, parts in copies.items():
        for p, v in parts.items():
            assert verify_expert_bytes(v, layer, p, e, 0) is None, (layer, e, p)
    return True


def churn(endpoint, layers, rounds=3):
    """Another client touching every expert of every layer (evicts on a small cache)."""
    with Client(endpoint, name="churn") as c:
        for _ in range(rounds):
            for layer in layers:
                for e in range(16):
                    c.acquire(layer, [e]).release()


HOLDER = textwrap.dedent("""
    import sys, time, numpy as np
    from moecache_client import Client, LeaseInvalid
    from moecached.tools.synth import verify_expert_bytes
    c = Client(sys.argv[1], name="holder")
    L = c.expert_layers
    lease = c.acquire(L[1], [1, 2, 3, 4])
    print("held", c.info["lease_watch"], flush=True)
    sys.stdin.readline()                      # the test stalls us here (SIGSTOP/SIGCONT)
    try:
        copies = {e: {p: np.array(v) for p, v in lease.parts(e).items()} for e in (1, 2, 3, 4)}
    except LeaseInvalid as e:
        print("invalid", e, flush=True); sys.exit(0)
    ok = lease.valid()
    bad = sum(verify_expert_bytes(v, L[1], p, e, 0) is not None
              for e, ps in copies.items() for p, v in ps.items())
    print("valid" if ok else "invalid-after", bad, flush=True)
    lease.release()
    c.close()
""")


def test_stalled_client_keeps_its_lease_and_reads_right_bytes(model, tmp_path):
    """SIGSTOP a client holding a lease for 3x the heartbeat while another client churns the
    cache: the daemon keeps the pins of a live process, so the bytes stay right."""
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "24", "--heartbeat", "1")
    try:
        p = subprocess.Popen([sys.executable, "-c", HOLDER, f"ipc://{sock}"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().split() == ["held", "process"]
        p.send_signal(signal.SIGSTOP)
        time.sleep(3.0)
        with Client(f"ipc://{sock}") as c:
            churn(f"ipc://{sock}", c.expert_layers)
            assert c.stats()["pinned"] == 4          # the stalled holder's four experts
        p.send_signal(signal.SIGCONT)
        p.stdin.write("\n")
        p.stdin.flush()
        out = p.stdout.readline().split()
        assert p.wait(30) == 0
        assert out == ["valid", "0"], out
    finally:
        stop_daemon(d)


def test_stalled_daemon_keeps_leases(model, tmp_path):
    """SIGSTOP the daemon past the heartbeat: on SIGCONT the clients' leases still hold (it
    must not read its own stall as every client's silence) and the clients keep the session."""
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "24", "--heartbeat", "1")
    try:
        c = Client(f"ipc://{sock}", name="engine")
        L = c.expert_layers
        lease = c.acquire(L[0], [5, 6])
        session = c.session
        d.send_signal(signal.SIGSTOP)
        time.sleep(3.5)                 # > 3 heartbeats of the client's pings unanswered
        d.send_signal(signal.SIGCONT)
        churn(f"ipc://{sock}", L)
        assert c.session == session
        assert bytes_ok(lease, L[0], [5, 6])
        assert c.stats()["pinned"] == 2
        lease.release()
        c.close()
    finally:
        stop_daemon(d)


def test_exited_client_loses_its_pins_at_once(model, tmp_path):
    """A watched client that exits without releasing: its pins go within a tick, long before
    a generous heartbeat would have expired it."""
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "24", "--heartbeat", "30")
    try:
        with Client(f"ipc://{sock}") as watch:
            p = subprocess.Popen([sys.executable, "-c", HOLDER, f"ipc://{sock}"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
            assert p.stdout.readline().split()[0] == "held"
            assert watch.stats()["pinned"] == 4
            p.kill()
            p.wait()
            wait_for(lambda: watch.stats()["pinned"] == 0, "the dead client's pins to go", 15)
            gone = watch.stats()["departed_clients"]
            assert any(x["name"] == "holder" and x["left"] == "process exited" for x in gone)
    finally:
        stop_daemon(d)


def test_unwatched_client_is_revoked_and_knows(model, tmp_path, monkeypatch):
    """A client the daemon cannot watch (no verifiable pid: remote, or another pid
    namespace) loses its leases after a silence; once the slots are reused the lease says so
    and ``part()`` raises, never handing out another expert's bytes."""
    monkeypatch.setattr(moecache_client, "_own_start_time", lambda: None)
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "24", "--heartbeat", "1")
    try:
        c = Client(f"ipc://{sock}", heartbeat_s=100)    # never pings: looks silent
        assert c.info["lease_watch"] == "heartbeat"
        L = c.expert_layers
        lease = c.acquire(L[1], [1, 2, 3, 4])
        assert lease.valid()
        time.sleep(2.5)
        churn(f"ipc://{sock}", L)
        assert not lease.valid()
        with pytest.raises(LeaseInvalid, match="revoked"):
            lease.part(1, "gate")
        with pytest.raises(LeaseInvalid):
            lease.parts(2)
        c._closed = True
    finally:
        stop_daemon(d)


def test_silent_client_is_told_its_pending_acquire_was_dropped(model, tmp_path, monkeypatch):
    """An unwatched client silent past the heartbeat while its acquire waits (for a slot here;
    a SIGSTOP, a GC pause) is dropped with its pending acquire: that acquire must be answered
    with an error, not left without a reply (a client waiting with timeout=None hung for ever)."""
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "24", "--heartbeat", "1", "--on-pressure", "wait",
                     "--pressure-timeout", "60")
    try:
        with Client(f"ipc://{sock}", name="pinner") as b:
            cls = b.info["arena"]["classes"][0]
            n, layer = cls["n_slots"], cls["layers"][0]
            assert n < 16
            held = b.acquire(layer, list(range(n)))          # every slot of the class pinned
            monkeypatch.setattr(moecache_client, "_own_start_time", lambda: None)
            a = Client(f"ipc://{sock}", name="silent", heartbeat_s=100)   # never pings
            assert a.info["lease_watch"] == "heartbeat"
            fut = a.acquire_async(layer, [15])
            with pytest.raises(moecache_client.ServerError) as ei:
                fut.result(20)
            assert ei.value.code == "timeout" and "silent" in str(ei.value), ei.value
            assert any(x["name"] == "silent" and x["left"].startswith("silent")
                       for x in b.stats()["departed_clients"])
            held.release()
            a.acquire(layer, [15]).release()                 # it can go on (hello-less is fine)
            a.close()
    finally:
        stop_daemon(d)


def test_released_lease_is_not_readable(model, tmp_path):
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "24")
    try:
        with Client(f"ipc://{sock}") as c:
            L = c.expert_layers
            lease = c.acquire(L[2], [0, 1])
            assert bytes_ok(lease, L[2], [0, 1])
            lease.release()
            assert not lease.valid()
            with pytest.raises(LeaseInvalid, match="released"):
                lease.part(0, "up")
            with c.acquire(L[2], [3]) as other:
                pass
            with pytest.raises(LeaseInvalid):
                other.parts(3)
    finally:
        stop_daemon(d)


def test_lease_of_a_closed_client_is_not_readable(model, tmp_path):
    """``close()`` says bye, and the daemon releases every lease of the client with it: those
    leases no longer pin, so ``valid()`` is False and ``part()`` raises, as after release."""
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "24")
    try:
        c = Client(f"ipc://{sock}")
        L = c.expert_layers
        lease = c.acquire(L[2], [0, 1])
        assert bytes_ok(lease, L[2], [0, 1])
        c.close()
        with Client(f"ipc://{sock}") as other:
            assert other.stats()["pinned"] == 0      # the bye released it
        assert not lease.valid()
        with pytest.raises(LeaseInvalid, match="closed"):
            lease.part(0, "up")
        lease.release()                              # still harmless
    finally:
        stop_daemon(d)


def test_client_used_in_a_forked_child_fails_at_once(model, tmp_path):
    """A ZeroMQ socket cannot be used across ``fork()``: a child that calls the parent's
    Client gets a ClientError at once (it used to hang for ever in ``recv``), its
    ``lease.release()`` does not touch the parent's lease, and ``close()`` returns."""
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "24")
    try:
        c = Client(f"ipc://{sock}")
        L = c.expert_layers
        lease = c.acquire(L[1], [3, 4])
        pid = os.fork()
        if pid == 0:                      # the child: exit status says what happened
            code = 3
            try:
                lease.release()
                try:
                    c.ping()
                except moecache_client.ClientError as e:
                    code = 0 if "fork" in str(e) else 4
                c.close()
            finally:
                os._exit(code)
        for _ in range(300):              # a child that hangs fails the test, not the suite
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child hung in the parent's Client")
        assert os.waitstatus_to_exitcode(status) == 0
        assert lease.valid() and c.stats()["pinned"] == 2   # the parent's lease is untouched
        assert bytes_ok(lease, L[1], [3, 4])
        lease.release()
        c.close()
    finally:
        stop_daemon(d)


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_lease_from_before_a_restart_is_not_readable(model, tmp_path, how):
    """After the daemon stops (cleanly or killed) and a new one starts, a lease of the old
    one says it is invalid and ``part()`` raises, although the old mapping is still there."""
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "24")
    c = Client(f"ipc://{sock}", timeout=10)
    try:
        L = c.expert_layers
        lease = c.acquire(L[0], [1, 2])
        assert bytes_ok(lease, L[0], [1, 2])
        if how == "sigterm":
            stop_daemon(d)
        else:
            d.kill()
            d.wait()
        d = start_daemon(model, sock, "--slots", "24")
        # the old arena's epoch reads 0 at once (cleared on shutdown, or by the new daemon's
        # stale-arena cleanup), before this client has even noticed the restart
        assert lease._arena.epoch() == 0
        assert not lease.valid()
        with pytest.raises(LeaseInvalid):
            lease.part(1, "gate")
        # and the client carries on with the new daemon (a call in flight across the restart
        # fails with DaemonRestarted; the next one says hello again)
        wait_for(lambda: _pings(c), "the client to reach the new daemon")
        with c.acquire(L[0], [1]) as fresh:
            assert bytes_ok(fresh, L[0], [1])
    finally:
        c.close()
        stop_daemon(d)


def _pings(c):
    try:
        c.ping()
        return True
    except moecache_client.ClientError:
        return False


def test_wrong_pid_start_is_not_watched(model, tmp_path):
    """A hello naming a live pid with a start time that is not that process's (a reused pid,
    another pid namespace) is not trusted for watching: heartbeat expiry applies."""
    import msgpack
    import zmq
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "24")
    try:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"ipc://{sock}")
        for start, want in ((12345, "heartbeat"), (moecache_client._own_start_time(), "process")):
            s.send(msgpack.packb({"v": 1, "id": 1, "op": "hello", "pid": os.getpid(), "pid_start": start}))
            assert s.poll(5000)
            rep = msgpack.unpackb(s.recv(), raw=False)
            assert rep["ok"] and rep["lease_watch"] == want, rep.get("lease_watch")
        s.close()
    finally:
        stop_daemon(d)


def test_stale_arena_cleanup_voids_its_epoch(tmp_path, model):
    """An arena left by a killed daemon: the cleanup clears its epoch before unlinking, so a
    process that still maps it sees its leases void."""
    code = ("import os, sys; from moecached.engine.arena import Arena; from moecached.engine.index import open_index;"
            "ar = Arena(open_index(sys.argv[1]), slots=8, dir=sys.argv[2], lock=False);"
            "ar.set_epoch(77); print(ar.path, flush=True); os._exit(0)")   # dies without cleanup
    path = subprocess.run([sys.executable, "-c", code, model, str(tmp_path)], capture_output=True,
                          text=True, check=True).stdout.strip()
    fd = os.open(path, os.O_RDONLY)
    try:
        assert int.from_bytes(os.pread(fd, 8, EPOCH_OFF), "little") == 77
        assert remove_stale_arenas(str(tmp_path)) == [path]
        assert int.from_bytes(os.pread(fd, 8, EPOCH_OFF), "little") == 0
    finally:
        os.close(fd)


def test_stale_cleanup_leaves_files_that_are_not_arenas(tmp_path):
    """A file named like an arena but without the control block's magic is someone else's."""
    other = tmp_path / "moecached-test-model.gguf"
    other.write_bytes(b"GGUF" + bytes(100))
    assert remove_stale_arenas(str(tmp_path)) == []
    assert other.exists()
