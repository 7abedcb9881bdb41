"""The daemon's side of the shared-memory hit path (docs/protocol.md, "Shared-memory hit path").

A real daemon process; the test process is a fast-path client through ``tests/shm_shim.py``
(the client half of ``moecache_shm.h`` over ctypes), and socket clients churn the cache.
Every byte read through a pin is checked against the model.
"""
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from daemon_util import start_daemon, stop_daemon, wait_for
from moecache_client import Client
from moecached.service.server import Server
from moecached.tools.synth import verify_expert_bytes
from shm_shim import FastClient

N_EXP = 16


pytestmark = pytest.mark.usefixtures("hot_path")

@pytest.fixture
def model(model_factory):
    # 4 blocks x 16 experts of real Qwen3-30B-A3B Q4_K_M sizes (two size classes)
    return model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 7, 8], experts=N_EXP)


@pytest.fixture
def daemon(daemon_procs):
    """``daemon(*args) -> endpoint``: a daemon process with 64 slots unless ``args`` say."""
    return lambda *args: daemon_procs("--slots", "64", *args)[0]


def churn(endpoint, layers, rounds=2, experts=range(N_EXP)):
    with Client(endpoint, name="churn") as c:
        for _ in range(rounds):
            for layer in layers:
                for e in experts:
                    c.acquire(layer, [e]).release()


def bytes_right(fc, layer, expert, item):
    c = next(c for c in fc.arena["classes"] if c["id"] == item.cls)
    for part in c["parts"]:
        data = fc.part(item.cls, item.slot, part)
        assert verify_expert_bytes(data, layer, part, expert, 0) is None, (layer, expert, part)
    return True


def pin_resident(fc, layer, experts):
    """Make ``experts`` resident over the socket, release, then pin them through shared memory."""
    r = fc.acquire(layer, experts)
    fc.release(r["lease"])
    items = fc.pin(layer, experts)
    assert isinstance(items, list), f"pin returned {items}"
    return items


def pin_file_pins(fc):
    """Pin file words: head and tail (8, 16)."""
    w = fc.pin_words()
    return w[8], w[16]


def test_hello_offers_pins_only_to_watched_clients_and_when_enabled(daemon, tmp_path):
    ep = daemon()
    fc = FastClient(ep)
    p = fc.pins
    assert p is not None and "path" not in p and os.path.exists(p["door"])
    assert set(p) == {"door", "token", "size", "ring_n", "pins_off", "ring_off", "quota"}
    assert p["ring_n"] & (p["ring_n"] - 1) == 0 and p["quota"] >= 1
    assert os.readlink(f"/proc/self/fd/{fc.pin_fd}").startswith("/memfd:moecached-pins-")
    assert os.fstat(fc.pin_fd).st_size == p["size"]
    w = fc.pin_words()
    assert w[0].to_bytes(8, "little") == b"MOEPIN01" and w[1] == fc.session and w[6] == p["quota"]
    # the token opens the door once, and only for the process that said hello
    import socket
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(p["door"])
        s.sendall(p["token"].encode())
        assert s.recv(16) == b"no"
    assert FastClient(ep, watched=False, name="unwatched").pins is None
    assert FastClient(ep, fast_path=False, name="plain").pins is None
    st = fc.stats()
    assert st["fast_path"]["pin_files"] == 1
    fc.close()
    c = FastClient(ep, fast_path=False, name="observer")
    wait_for(lambda: c.stats()["fast_path"]["pin_files"] == 0, "pin file closed after bye")
    c.close()
    ep2 = daemon("--no-fast-path")
    assert FastClient(ep2).pins is None


def test_pinned_slot_is_never_reused_and_keeps_its_bytes(daemon):
    ep = daemon("--slots", "8")
    fc = FastClient(ep)
    L = fc.layers
    items = pin_resident(fc, L[1], [3, 5])
    gens = [it.gen for it in items]
    churn(ep, L, rounds=2)
    for e, it, g in zip([3, 5], items, gens):
        assert fc.generation(it.cls, it.slot) == g, "pinned slot's generation moved"
        assert fc.resident(L[1], e) == it.slot + 1
        assert bytes_right(fc, L[1], e, it)
    assert fc.valid(items)
    fp = fc.stats()["fast_path"]
    assert fp["evictions_held"] > 0 and fp["pins_honoured"] == 2
    assert fc.me()["pins_honoured"] == 2
    fc.unpin(items)
    for rounds in range(1, 9):   # the daemon sees the release at a sweep, not at once
        churn(ep, L, rounds=2)
        if not fc.valid(items):
            break
    print(f"released slots evicted after {2 * rounds} churn rounds")
    assert not fc.valid(items), "released slots were never evicted under 16 rounds of churn"
    assert fc.resident(L[1], 3) in (0,) or fc.generation(items[0].cls, items[0].slot) != gens[0]
    assert fc.me()["pins_honoured"] == 0
    fc.close()


def test_pins_past_the_quota_are_ignored(daemon):
    ep = daemon("--slots", "8", "--fast-path-quota", "2")
    fc = FastClient(ep)
    assert fc.pins["quota"] == 2
    L = fc.layers
    items = pin_resident(fc, L[1], [1, 2, 3, 4])
    churn(ep, L, rounds=2)
    kept = [fc.generation(it.cls, it.slot) == it.gen for it in items]
    assert sum(kept) == 2, kept                 # two honoured, the others went
    assert not fc.valid(items)                  # the holder can tell
    for e, it, k in zip([1, 2, 3, 4], items, kept):
        if k:
            assert bytes_right(fc, L[1], e, it)
    me = fc.me()
    assert me["pins_honoured"] == 2 and me["pins_ignored"] > 0
    fc.unpin(items)
    fc.close()


KILLED = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from shm_shim import FastClient
    fc = FastClient(sys.argv[1], name="victim")
    L = fc.layers
    r = fc.acquire(L[1], [6, 7]); fc.release(r["lease"])
    items = fc.pin(L[1], [6, 7])
    print("memfd", items[0].cls, items[0].slot, items[0].gen, flush=True)
    time.sleep(600)
""")


def test_killed_client_pins_stop_counting_and_its_file_goes(daemon):
    ep = daemon("--slots", "8")
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.Popen([sys.executable, "-c", KILLED, ep, here], stdout=subprocess.PIPE, text=True)
    try:
        path, cls, slot, gen = p.stdout.readline().split()
        cls, slot, gen = int(cls), int(slot), int(gen)
        fc = FastClient(ep, fast_path=False, name="observer")
        churn(ep, fc.layers, rounds=1)
        assert fc.generation(cls, slot) == gen, "pinned slot evicted while its client lives"
        assert fc.stats()["fast_path"]["pin_files"] == 1
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    wait_for(lambda: fc.stats()["fast_path"]["pin_files"] == 0, "pin file of a killed client closed")
    churn(ep, fc.layers, rounds=2)
    assert fc.generation(cls, slot) != gen, "a dead client's pin still holds the slot"
    st = fc.stats()
    assert st["fast_path"]["pin_files"] == 0 and st["fast_path"]["held_keys"] == 0
    (gone,) = [x for x in st["departed_clients"] if x["name"] == "victim"]
    assert gone["left"] == "process exited"
    assert gone["fast_hits"] == 2 and gone["hits"] == 2 and gone["demand_misses"] == 2, gone
    fc.close()


def _run_sequence(ep, seq, fast):
    """Acquire/release ``seq`` [(layer, [experts])]: through shared memory when ``fast`` (the
    socket when a pin misses), else over the socket only. Returns (stats, client entry)."""
    fc = FastClient(ep, fast_path=fast, name="seq")
    for layer, ex in seq:
        got = fc.pin(layer, ex) if fast else None
        if isinstance(got, list):
            fc.unpin(got)
        else:
            fc.release(fc.acquire(layer, ex)["lease"])
    st = fc.stats()
    me = fc.me(st)
    resident = {(l, e) for l in fc.layers for e in range(N_EXP) if fc.resident(l, e)}
    fc.close()
    return st, me, resident


def test_ring_hits_count_like_socket_hits_and_keep_the_eviction_order(daemon):
    rnd = random.Random(7)
    layers = None
    eps = [daemon("--slots", "10"), daemon("--slots", "10")]
    layers = FastClient(eps[0], fast_path=False, name="peek").layers
    seq = []
    for _ in range(300):                        # skewed: many repeats (hits), some misses
        layer = rnd.choice(layers)
        seq.append((layer, rnd.sample([0, 1, 2, 3, 4, 5, rnd.randrange(N_EXP)], 2)
                    if rnd.random() < 0.8 else rnd.sample(range(N_EXP), 2)))
    seq = [(l, ex) for l, ex in seq if len(set(ex)) == 2]
    st_s, me_s, res_s = _run_sequence(eps[0], seq, fast=False)
    st_f, me_f, res_f = _run_sequence(eps[1], seq, fast=True)
    assert me_f["fast_hits"] > 0
    for k in ("hits", "prefetch_hits", "demand_misses", "evictions"):
        assert st_f[k] == st_s[k], (k, st_f[k], st_s[k])
    assert st_f["layers"] == st_s["layers"]
    for k in ("hits", "prefetch_hits", "demand_misses"):
        assert me_f[k] == me_s[k], (k, me_f[k], me_s[k])
    assert res_f == res_s, "different experts resident: the eviction order differs"
    # and both are the daemon's LRU as the replay check computes it without a daemon
    from moecached.tools.replayplan import reference_lru
    fc = FastClient(eps[1], fast_path=False, name="peek2")
    lc = fc.arena["layer_class"]
    classes = sorted(fc.arena["classes"], key=lambda c: c["id"])
    sets = [[ex if l == layer else [] for l in layers] for layer, ex in seq]
    H, A = reference_lru(sets, [True] * len(sets), [lc[str(l)] for l in layers],
                         [c["n_slots"] for c in classes], N_EXP)
    assert A == st_f["hits"] + st_f["prefetch_hits"] + st_f["demand_misses"]
    assert st_f["hits"] + st_f["prefetch_hits"] == H
    assert st_f["fast_path"]["ring_drops"] == 0


def test_garbage_in_a_pin_file_never_crashes_or_serves_wrong_bytes(daemon):
    ep = daemon("--slots", "8", "--fast-path-quota", "3")
    fc = FastClient(ep)
    L = fc.layers
    w = fc.pin_words()
    n = len(w)
    rnd = random.Random(3)
    ring = fc.pins["ring_off"] // 8
    # out-of-range and absent keys in the ring, then a plausible head
    for j in range(8):
        w[ring + 2 * j] = rnd.choice([0, 2**64 - 1, 10**9, len(L) * N_EXP + 1, 1 + j])
        w[ring + 2 * j + 1] = rnd.getrandbits(64)
    w[8] = w[16] + 8
    churn(ep, L, rounds=1)
    fp = fc.stats()["fast_path"]
    assert fp["ring_drops"] >= 4
    w[8] = w[16] + 2**40                        # a huge head
    churn(ep, L, rounds=1)
    assert fc.stats()["fast_path"]["ring_resets"] >= 1
    for _ in range(3):                          # random words everywhere, header included
        for _ in range(2000):
            w[rnd.randrange(n)] = rnd.getrandbits(64)
        with Client(ep, name="check") as c:
            for layer in L:
                for e in range(N_EXP):
                    lease = c.acquire(layer, [e])
                    for p, v in lease.parts(e, layer).items():
                        assert verify_expert_bytes(v, layer, p, e, 0) is None
                    assert lease.valid()
                    lease.release()
    st = fc.stats()
    assert st["fast_path"]["pins_honoured"] <= 3
    fc.close()


def test_fast_path_counters_reach_the_exporter(daemon):
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from moecached.tools.metrics import StatsCollector
    ep = daemon()
    fc = FastClient(ep)
    L = fc.layers
    items = pin_resident(fc, L[0], [1, 2])
    fc.unpin(items)
    items = fc.pin(L[0], [1, 2, 3])             # 3 is not resident: a miss, nothing pinned
    assert items == 1
    held = fc.pin(L[0], [2])
    st = fc.stats()                             # drains the ring first
    reg = CollectorRegistry(auto_describe=False)
    col = StatsCollector(ep, timeout=5)
    reg.register(col)
    try:
        m = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for f in text_string_to_metric_families(generate_latest(reg).decode()) for s in f.samples}
    finally:
        col.close()
    me = fc.me(st)
    assert st["fast_path"]["fast_hits"] == me["fast_hits"] == 3
    assert m[("moecached_fast_hits_total", ())] == 3
    assert m[("moecached_fast_pin_files", ())] == 1
    lab = (("client", "fast"),)   # labelled by name, no pid
    assert m[("moecached_client_fast_hits_total", lab)] == 3
    assert m[("moecached_client_hits_total", lab)] == me["hits"]
    fc.unpin(held)
    fc.close()


def test_reload_and_stop_remove_pin_files(model_factory, tmp_path):
    import shutil
    a = model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 7, 8], experts=N_EXP, seed=0)
    b = model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 7, 8], experts=N_EXP, seed=1)
    path = str(tmp_path / "model.gguf")
    shutil.copyfile(a, path)
    sock = str(tmp_path / "r.sock")
    d = start_daemon(path, sock, "--slots", "64", "--arena-dir", str(tmp_path), "--on-model-change", "reload")
    try:
        fc = FastClient(f"ipc://{sock}")
        items = pin_resident(fc, fc.layers[0], [1])
        old = pin_memfds(d.pid)
        assert len(old) == 1
        shutil.copyfile(b, path + ".new")
        os.rename(path + ".new", path)
        wait_for(lambda: not pin_memfds(d.pid) & old, "pin file closed by the reload", timeout=30)
        wait_for(lambda: not fc.valid(items), "the old session's pins void (epoch cleared)")
        fc2 = FastClient(f"ipc://{sock}", name="again")
        assert fc2.pins is not None and fc2.session != fc.session
        new = pin_memfds(d.pid)
        assert len(new) == 1 and not new & old
        items = pin_resident(fc2, fc2.layers[0], [2])
        assert fc2.valid(items)
    finally:
        out = stop_daemon(d)
    assert "Traceback" not in out, out
    assert not [n for n in os.listdir(tmp_path) if n.startswith("moecached-")]


def pin_memfds(pid) -> set:
    """Names of the pin files (sealed memfds) process ``pid`` holds open."""
    out = set()
    for n in os.listdir(f"/proc/{pid}/fd"):
        try:
            t = os.readlink(f"/proc/{pid}/fd/{n}")
        except OSError:
            continue
        if t.startswith("/memfd:moecached-pins-"):
            out.add(t.split()[0])
    return out


def test_no_one_can_truncate_a_pin_file(daemon):
    """A pin file is a memfd whose size is sealed: truncating it (through any fd of it: the
    client's own, or one reopened through /proc) is refused by the kernel, so its client's
    mapping never faults; the client goes on pinning."""
    import errno
    ep = daemon("--slots", "8")
    fc = FastClient(ep)
    L = fc.layers
    items = pin_resident(fc, L[1], [3])
    for how in (lambda: os.ftruncate(fc.pin_fd, 0),
                lambda: os.truncate(f"/proc/self/fd/{fc.pin_fd}", 0),
                lambda: os.ftruncate(fc.pin_fd, 1 << 30)):
        with pytest.raises(PermissionError) as ei:
            how()
        assert ei.value.errno == errno.EPERM
    fc.unpin(items)
    churn(ep, L, rounds=2)
    items = pin_resident(fc, L[1], [3])
    assert fc.valid(items)
    assert fc.stats()["server"]["pin_files_truncated"] == 0
    fc.unpin(items)
    fc.close()


def _loop_wakes(pid):
    """Voluntary context switches of the daemon's main thread (its event loop) so far."""
    with open(f"/proc/{pid}/task/{pid}/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("voluntary_ctxt_switches"))


def test_an_idle_fast_path_client_does_not_keep_the_loop_awake(daemon_procs):
    """With a pin file open and nothing waiting on a pinned slot, the loop drains the rings
    every PIN_SWEEP_MS, not every PIN_DRAIN_MS: each wake costs an engine sharing the cores
    its CPU time (every 3 ms took 8 % of a decode on a 2-core machine)."""
    ep, proc = daemon_procs("--slots", "64")
    fc = FastClient(ep)
    L = fc.layers
    items = pin_resident(fc, L[0], [1, 2])
    fc.unpin(items)
    w0 = _loop_wakes(proc.pid)
    time.sleep(1.0)
    wakes = _loop_wakes(proc.pid) - w0
    print(f"loop wakes in 1 s with an idle fast-path client: {wakes}")
    assert wakes < 3 * 1000 / Server.PIN_SWEEP_MS, wakes
    assert wakes < 1000 / Server.PIN_DRAIN_MS / 2, wakes
    fc.close()


def test_a_release_through_shared_memory_frees_a_waiting_acquire_soon(daemon):
    """While an acquire waits for a slot that a fast-path pin holds, the loop sweeps every
    PIN_DRAIN_MS: the release (which sends no message) frees the acquire within milliseconds."""
    ep = daemon("--slots", "4")
    fc = FastClient(ep)
    L = fc.layers
    r = fc.acquire(L[0], [0])
    fc.release(r["lease"])
    probe = fc.pin(L[0], [0])
    fc.unpin(probe)
    n = next(c["n_slots"] for c in fc.arena["classes"] if c["id"] == probe[0].cls)
    for e in range(n):   # every slot of L[0]'s size class resident and pinned through shm
        fc.release(fc.acquire(L[0], [e])["lease"])
    items = fc.pin(L[0], list(range(n)))
    assert isinstance(items, list) and len(items) == n, items
    got = {}

    def want():
        with Client(ep, name="waiter") as c:
            t0 = time.monotonic()
            c.acquire(L[0], [n], timeout=10.0).release()
            got["t"] = time.monotonic()
            got["waited"] = got["t"] - t0

    th = threading.Thread(target=want)
    th.start()
    time.sleep(0.5)
    assert "t" not in got, "the acquire was served while every slot was pinned"
    t_release = time.monotonic()
    fc.unpin(items)
    th.join(10)
    assert "t" in got, "the acquire never got the released slot"
    print(f"acquire served {1000 * (got['t'] - t_release):.1f} ms after the release")
    assert got["t"] - t_release < 0.25, got
    fc.close()


def test_a_sighup_shrink_that_meets_pins_finishes_once_they_go(daemon_procs, tmp_path):
    """slots 32 -> 8 while a fast-path client pins 16 slots: the shrink stops short at the
    pins, and finishes by itself once they are released (docs/operations.md: "a shrink that
    meets pins stops short and finishes at the next period")."""
    conf = tmp_path / "shrink.toml"
    conf.write_text("slots = 32\n")
    ep, d = daemon_procs("--config", str(conf))
    fc = FastClient(ep)
    L = fc.layers
    slots = lambda: sum(c["slots"] for c in fc.stats()["classes"])
    items = pin_resident(fc, L[1], list(range(8))) + pin_resident(fc, L[2], list(range(8)))
    conf.write_text("slots = 8\n")
    d.send_signal(signal.SIGHUP)
    wait_for(lambda: slots() < 32, "the shrink")
    short = slots()
    assert short >= 16 > 8, short          # the pinned slots stay
    assert fc.valid(items)
    for e, it in zip(range(8), items):
        assert bytes_right(fc, L[1], e, it)
    fc.unpin(items)
    wait_for(lambda: slots() == 8, f"the shrink stopped at {short} slots to finish", timeout=15)
    st = fc.stats()
    assert st["budget"]["current_bytes"] < st["budget"]["configured_bytes"]
    fc.close()


def test_a_floor_shrink_that_meets_pins_finishes_once_they_go(daemon_procs, tmp_path):
    """The memory floor's shrink (a floor above all the box's memory: down to the least
    budget) stops short at a fast-path client's pins and finishes once they are released,
    though the floor, already at its minimum, asks for nothing more."""
    import psutil
    conf = tmp_path / "floor.toml"
    conf.write_text("slots = 64\n")
    ep, d = daemon_procs("--config", str(conf))
    fc = FastClient(ep)
    # the floor's least budget holds two layers' top-k (16) of each class: pin 24 of one class
    layers = fc.arena["classes"][0]["layers"]
    items = [it for l in layers for it in pin_resident(fc, l, list(range(24 // len(layers))))]
    huge = psutil.virtual_memory().total * 4
    conf.write_text(f'slots = 64\nfloor = {huge}\nfloor_interval_s = 0.2\nmin_budget = "1MiB"\n')
    d.send_signal(signal.SIGHUP)
    st = wait_for(lambda: (lambda s: s if s.get("floor", {}).get("shrinks") else None)(fc.stats()),
                  "the floor's shrink")
    want = st["floor"]["current_budget"]
    assert st["budget"]["current_bytes"] > want, st["budget"]   # held up by the pins
    assert fc.valid(items)
    fc.unpin(items)
    wait_for(lambda: fc.stats()["budget"]["current_bytes"] <= want,
             "the floor's shrink to finish", timeout=15)
    assert fc.stats()["floor"]["shrinks"] == st["floor"]["shrinks"]
    fc.close()


def test_a_client_flooding_its_hit_ring_gets_its_rate_and_a_warning(daemon_procs):
    """A client refilling its hit ring as fast as it can (head = tail + ring_n, valid entries)
    while another client acquires: the daemon applies that client's entries at
    fast_path_hit_rate (bursts of one ring), skips and counts the rest, and names its uid
    and the client in one warning line."""
    rate = 20000
    ep, proc = daemon_procs("--slots", "64", "--fast-path-hit-rate", str(rate))
    fc = FastClient(ep, name="flooder")
    assert fc.hello["limits"]["fast_path_hit_rate"] == rate
    L = fc.layers
    fc.unpin(pin_resident(fc, L[0], [0, 1]))
    w = fc.pin_words()
    ring, n = fc.pins["ring_off"] // 8, fc.pins["ring_n"]
    for j in range(n):
        w[ring + 2 * j], w[ring + 2 * j + 1] = 1 + fc.key(L[0], j % 2), j
    stop = threading.Event()

    def flood():
        while not stop.is_set():
            w[8] = w[16] + n

    t0 = time.monotonic()
    hits0 = fc.me()["fast_hits"]
    th = threading.Thread(target=flood)
    th.start()
    try:
        with Client(ep, name="other", fast_path=False) as c:   # its every request drains first
            t_end = time.monotonic() + 1.5
            while time.monotonic() < t_end:
                for layer in L[1:]:
                    c.acquire(layer, [1, 2]).release()
    finally:
        stop.set()
        th.join()
    st = fc.stats()
    elapsed = time.monotonic() - t0
    me, fp = fc.me(st), st["fast_path"]
    applied = me["fast_hits"] - hits0
    assert applied <= n + rate * elapsed, (applied, elapsed)
    assert me["ring_skipped"] > 0 and fp["ring_skipped"] == me["ring_skipped"]
    assert me["ring_drops"] == me["ring_resets"] == 0
    time.sleep(1.2)                             # a tick: the warning
    fc.close()
    out = stop_daemon(proc)
    lines = [l for l in out.splitlines() if "fast_path_hit_rate" in l and "flooder" in l]
    assert len(lines) >= 1 and f"uid {os.getuid()} records" in lines[0], out
    assert f"flooder (pid {os.getpid()})" in lines[0] and f"({rate} entries/s" in lines[0], out
    assert len(lines) == 1, "more than one warning per uid per period"
