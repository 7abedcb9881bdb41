"""Real daemon and client processes: sharing, killed clients, restarts, SIGTERM, SIGHUP."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon_util import start_daemon, stop_daemon, wait_for
from fixtures import trace_path
from moecache_client import Client, ClientError

HERE = Path(__file__).resolve().parent
TRACE_NAME = "qwen3_30b_a3b_sharegpt_prefill_2080.npz"


@pytest.fixture
def model(model_factory):
    # 4 blocks x 16 experts of real Qwen3-30B-A3B Q4_K_M sizes (two size classes)
    return model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 7, 8], experts=16)


@pytest.mark.slow
def test_two_clients_share_one_copy(model, tmp_path):
    trace = trace_path(TRACE_NAME)
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "64")  # everything fits: nothing is evicted
    try:
        procs = [subprocess.Popen([sys.executable, str(HERE / "replay_client.py"), f"ipc://{sock}",
                                   str(trace), f"client{i}", "60", "0"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(2)]
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            outs.append(json.loads(out.strip().splitlines()[-1]))
        for o in outs:
            assert o["n_bad"] == 0, o["bad"]
            assert o["accesses"] > 0
        with Client(f"ipc://{sock}") as c:
            st = c.stats()
        # each expert read from disk once however many clients wanted it
        assert st["evictions"] == 0
        loaded = st["reads"]
        touched = st["classes"][0]["used"] + sum(x["used"] for x in st["classes"][1:])
        assert loaded == touched, (loaded, touched)
        total = outs[0]["accesses"] + outs[1]["accesses"]
        assert st["hits"] + st["prefetch_hits"] + st["demand_misses"] == total
        # a miss of one client on an expert the other one is already loading waits for that
        # read instead of issuing a second one, so misses may exceed reads but reads == touched
        assert st["demand_misses"] >= loaded
        names = {x["name"]: x for x in st["clients"] + st["departed_clients"]}
        for o in outs:
            assert names[o["name"]]["hits"] + names[o["name"]]["prefetch_hits"] == o["hits"]
        assert st["pinned"] == 0
    finally:
        stop_daemon(d)
    assert not os.path.exists(sock)


def test_sigkilled_client_loses_pins(model, tmp_path):
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "32", "--heartbeat", "1")
    # socket leases (the daemon's "pinned"); a killed fast-path client: test_fast_path_daemon.py
    code = ("import sys,time; from moecache_client import Client; c=Client(sys.argv[1], fast_path=False);"
            "L=c.expert_layers; ls=[c.acquire(L[i], [1,2,3]) for i in range(len(L))];"
            "print('held', flush=True); time.sleep(60)")
    try:
        with Client(f"ipc://{sock}") as watch:
            for rnd in range(5):
                p = subprocess.Popen([sys.executable, "-c", code, f"ipc://{sock}"],
                                     stdout=subprocess.PIPE, text=True)
                assert p.stdout.readline().strip() == "held"
                assert watch.stats()["pinned"] == 12
                p.send_signal(signal.SIGKILL)
                p.wait()
                t0 = time.time()
                while watch.stats()["pinned"] and time.time() - t0 < 5:
                    time.sleep(0.1)
                assert watch.stats()["pinned"] == 0, f"round {rnd}: pins survived the client"
                assert time.time() - t0 < 6  # heartbeat 1 s (+ loop granularity, + a loaded CI box)
    finally:
        stop_daemon(d)


def test_daemon_restart_while_waiting(model, tmp_path):
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "32", "--heartbeat", "2", "--readers", "1",
                     "--chunk", "4KiB")
    c = Client(f"ipc://{sock}", timeout=30)
    try:
        L = c.expert_layers
        old_session = c.session
        old_arena = c.info["arena"]["path"]
        fut = c.acquire_async(None, None, layers=[(L[0], list(range(8))), (L[1], list(range(8)))])
        time.sleep(0.05)
        d.send_signal(signal.SIGKILL)
        d.wait()
        with pytest.raises(ClientError):
            fut.result(20)  # an error, never a stale lease
        assert os.path.exists(old_arena)  # a SIGKILLed daemon cannot clean up...
        d = start_daemon(model, sock, "--slots", "32")
        assert not os.path.exists(old_arena)  # ...the next one removes its stale arena
        t0 = time.time()
        while c.session == old_session and time.time() - t0 < 10:
            try:
                c.ping()
            except ClientError:
                time.sleep(0.2)
        assert c.session != old_session
        from moecached.tools.synth import verify_expert_bytes
        with c.acquire(L[0], [0, 7]) as lease:
            for e in (0, 7):
                for part, v in lease.parts(e).items():
                    assert verify_expert_bytes(v, L[0], part, e, 0) is None
    finally:
        c.close()
        stop_daemon(d)


def test_sigterm_cleans_up(model, tmp_path):
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "16")
    with Client(f"ipc://{sock}") as c:
        arena = c.info["arena"]["path"]
        assert os.path.exists(arena)
        fut = c.acquire_async(c.expert_layers[0], [1])
        fut.result(10)
    out = stop_daemon(d)
    assert d.returncode == 0, out
    assert not os.path.exists(sock) and not os.path.exists(arena)


def test_second_daemon_refused(model, tmp_path):
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "16")
    try:
        p = subprocess.run([sys.executable, "-P", "-m", "moecached.daemon", "--model", model, "--slots", "16",
                            "--endpoint", f"ipc://{sock}", "--no-lock-memory"],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 1
        assert "another moecached (pid %d) is serving it" % d.pid in p.stderr
    finally:
        stop_daemon(d)


def start_with_config(model, tmp_path, text: str):
    """A daemon reading ``text`` as its TOML config file; returns (config path, socket, process)."""
    conf = tmp_path / "m.toml"
    conf.write_text(text)
    sock = str(tmp_path / "d.sock")
    return conf, sock, start_daemon(model, sock, "--config", str(conf), "--log-level", "info")


def test_sighup_applies_what_it_says(model, tmp_path):
    conf, sock, d = start_with_config(model, tmp_path, 'max_request_experts = 16384\nslots = 32\n')
    try:
        with Client(f"ipc://{sock}") as c:
            L = c.expert_layers
            c.acquire(L[0], list(range(8))).release()
            conf.write_text('max_request_experts = 4\nslots = 16\nreaders = 3\n')
            d.send_signal(signal.SIGHUP)
            t0 = time.time()
            while time.time() - t0 < 10:
                try:
                    c._call({"op": "acquire", "layer": L[0], "experts": list(range(8))})
                except Exception as e:
                    err = e
                    break
                time.sleep(0.1)
            assert getattr(err, "code", None) == "too_large", err
            st = c.stats()
            assert st["budget"]["current_bytes"] < st["budget"]["configured_bytes"]  # slots 32 -> 16
            assert sum(x["slots"] for x in st["classes"]) == 16
            # readers back as it runs: nothing needs a restart (the value not applied was not taken
            # as the running one)
            conf.write_text('max_request_experts = 5\nslots = 16\n')
            d.send_signal(signal.SIGHUP)
            t0 = time.time()
            while True:
                try:
                    c.acquire(L[0], list(range(5))).release()
                    break
                except Exception:
                    assert time.time() - t0 < 10, "the second SIGHUP was not applied"
                    time.sleep(0.1)
    finally:
        out = stop_daemon(d)
    assert "SIGHUP: applied" in out and "max_request_experts" in out and "slots" in out, out
    assert out.count("need a restart: readers") == 1, out


def test_sighup_shrink_moves_the_arena_releases_word(model, tmp_path):
    # a smaller budget punches holes in the freed slots; the control block's releases word moves
    # first, so that a client whose device registered the arena's pages registers them again
    conf, sock, d = start_with_config(model, tmp_path, 'slots = 32\n')
    try:
        with Client(f"ipc://{sock}") as c:
            desc = c.arena.descriptor
            path, off = desc["path"], desc["control"]["releases_off"]
            L = c.expert_layers
            c.acquire(L[0], list(range(8))).release()
            word = lambda: int.from_bytes(open(path, "rb").read(64)[off:off + 8], "little")
            assert word() == 0
            conf.write_text('slots = 8\n')
            d.send_signal(signal.SIGHUP)
            wait_for(lambda: sum(x["slots"] for x in c.stats()["classes"]) < 32, "the shrink", 10)
            wait_for(lambda: word() >= 1, "the releases word to move", 10)
    finally:
        stop_daemon(d)


def test_a_client_reading_the_given_back_slots_does_not_undo_a_shrink(model, tmp_path):
    """A client that reads the whole arena through its read-only mapping after a shrink makes
    tmpfs allocate pages in the holes the shrink punched; the daemon finds the file holding
    more than its slots need, punches the given-back slots again (counted in
    ``repunched_bytes``) and says so in one warning line."""
    import mmap
    conf, sock, d = start_with_config(model, tmp_path, 'slots = 32\n')
    try:
        with Client(f"ipc://{sock}") as c:
            path = c.arena.descriptor["path"]
            c.acquire(c.expert_layers[0], list(range(8))).release()
            conf.write_text('slots = 8\n')
            d.send_signal(signal.SIGHUP)
            wait_for(lambda: sum(x["slots"] for x in c.stats()["classes"]) == 8, "the shrink", 10)
            shrunk = os.stat(path).st_blocks
            fd = os.open(path, os.O_RDONLY)
            try:
                m = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
                sum(m[off] for off in range(0, len(m), mmap.PAGESIZE))   # every page, holes too
                wait_for(lambda: c.stats().get("repunched_bytes", 0) > 0, "the pages punched again", 10)
                wait_for(lambda: os.stat(path).st_blocks <= shrunk, "the file back to its shrunk size", 10)
                m.close()
            finally:
                os.close(fd)
            assert sum(x["slots"] for x in c.stats()["classes"]) == 8
            c.acquire(c.expert_layers[0], [0]).release()
    finally:
        out = stop_daemon(d)
    assert out.count("punched again in the arena's given-back slots since the last warning") == 1, out


def test_sighup_turns_the_floor_on_and_off(model, tmp_path):
    """A floor above all the box's memory switched on by SIGHUP shrinks the cache to its
    minimum at the next tick; a budget change then keeps that shrink (the floor owns the
    budget), a budget under one slot per class is refused with nothing changed, off gives the
    configured budget back, and on again keeps counting where the floor left off."""
    import psutil

    def until(cond, what):
        t0 = time.time()
        while time.time() - t0 < 10:
            st = c.stats()
            if cond(st):
                return st
            time.sleep(0.1)
        raise AssertionError(f"{what}: {st.get('budget')} {st.get('floor', {}).get('current_budget')}")

    conf, sock, d = start_with_config(model, tmp_path, 'slots = 64\n')
    huge = psutil.virtual_memory().total * 4
    on = f'floor = {huge}\nfloor_interval_s = 0.2\nmin_budget = "1MiB"\n'
    try:
        with Client(f"ipc://{sock}") as c:
            st = c.stats()
            full = st["budget"]["configured_bytes"]
            assert "floor" not in st and st["budget"]["current_bytes"] == full
            conf.write_text('slots = 64\n' + on)
            d.send_signal(signal.SIGHUP)
            st = until(lambda st: "floor" in st and st["floor"]["shrinks"] >= 1, "floor on")
            low = st["budget"]["current_bytes"]
            assert low < full and st["floor"]["current_budget"] == low
            conf.write_text('slots = 60\n' + on)          # a budget change keeps the shrink
            d.send_signal(signal.SIGHUP)
            st = until(lambda st: st["floor"]["configured_budget"] < full, "budget change")
            assert st["budget"]["current_bytes"] == st["floor"]["current_budget"] == low
            conf.write_text('budget = "2MiB"\n' + on)     # under one slot per class: refused
            d.send_signal(signal.SIGHUP)
            time.sleep(1.0)
            st = c.stats()
            assert st["budget"]["current_bytes"] == low and st["floor"]["configured_budget"] < full
            shrinks = st["floor"]["shrinks"]
            conf.write_text('slots = 64\n')
            d.send_signal(signal.SIGHUP)
            st = until(lambda st: "floor" not in st and st["budget"]["current_bytes"] == full, "floor off")
            c.acquire(c.expert_layers[0], list(range(8))).release()   # still serving at full size
            conf.write_text('slots = 64\n' + on)
            d.send_signal(signal.SIGHUP)
            st = until(lambda st: "floor" in st and st["budget"]["current_bytes"] < full, "floor on again")
            assert st["floor"]["shrinks"] >= shrinks + 1     # counters go on, never back
    finally:
        out = stop_daemon(d)
    assert out.count("memory floor on") == 2 and "memory floor off" in out, out
    assert "budget (2097152 bytes is under the smallest arena" in out, out
    assert "failed" not in out and "reload failed" not in out, out
    # min_budget under what serving needs is raised, said once for that value
    assert out.count("is below what serving needs") == 1, out
