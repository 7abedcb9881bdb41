"""Fairness between clients: per-client prefetch cap, per-client rate limit, cheap no-op
prefetches, prefetch chunks yielding to demand reads in the reader pool."""
import mmap
import ctypes
import threading

import msgpack
import pytest
import zmq

from moecached.engine import readers as readers_mod
from moecached.daemon.config import Config
from moecached.engine.readers import ReaderPool
from moecached.service.server import Server
from moecache_client import Client, ServerError as CError

from daemon_util import Daemon, Gate

pytestmark = pytest.mark.usefixtures("hot_path")

MODEL = ("qwen3-30b-a3b-Q4_K_M", 4, 8)   # layout, layers, experts
SLOTS = 32


def model(model_factory):
    name, layers, experts = MODEL
    return model_factory(name, layers=layers, experts=experts)


def client_stats(c: Client, name: str) -> dict:
    return next(x for x in c.stats()["clients"] if x["name"] == name)


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "general-path"])
def test_prefetch_flood_beyond_its_cap_is_dropped_and_counted_per_client(model_factory, tmp_path,
                                                                         monkeypatch, fast):
    d = Daemon(model(model_factory), tmp_path, slots=SLOTS, max_prefetch_loads=8, client_max_prefetch=4,
               fast=fast)
    gate = Gate(readers_mod.read_many)
    try:
        L = d.idx.expert_layers
        with Client(d.endpoint, name="engine") as eng, Client(d.endpoint, name="flood") as fl:
            eng.acquire(L[3], [0, 1]).release()              # resident before reads stall
            monkeypatch.setattr(readers_mod, "read_many", gate)  # prefetch loads stay in flight
            assert fl.prefetch(L[0], list(range(8)), wait=True) == 4   # its cap, not the cache's 8
            assert fl.prefetch(L[1], list(range(8)), wait=True) == 0
            for _ in range(50):                               # noreply flood over the cap
                fl.prefetch(L[1], [0, 1, 2])
            fl.ping()                                         # all of them handled
            # the other client still gets its own share of prefetch loads and its acquires
            assert eng.prefetch(L[2], [0, 1, 2], wait=True) == 3
            with eng.acquire(L[3], [0, 1]) as lease:
                assert lease.hits == 2
            s_fl, s_eng = client_stats(eng, "flood"), client_stats(eng, "engine")
            assert s_fl["prefetches_dropped"] == 4 + 8 + 50 * 3
            assert s_fl["prefetch_loads_in_flight"] == 4
            assert s_eng["prefetches_dropped"] == 0 and s_eng["prefetch_loads_in_flight"] == 3
            assert eng.stats()["prefetches_dropped"] == 4 + 8 + 150
            gate.open()
            # the prefetched bytes land: no demand miss. (Once a read has landed, the client's
            # shared-memory path may take the expert without a message; such a lease reports a
            # hit where the daemon's counters report a prefetch hit.)
            with eng.acquire(L[2], [0, 1, 2]) as lease:
                assert lease.misses == 0 and lease.prefetch_hits + lease.hits == 3
            with fl.acquire(L[0], [0, 1]) as lease:
                assert lease.misses == 0 and lease.prefetch_hits + lease.hits == 2
            for _ in range(200):
                if client_stats(eng, "flood")["prefetch_loads_in_flight"] == 0:
                    break
                threading.Event().wait(0.02)
            assert client_stats(eng, "flood")["prefetch_loads_in_flight"] == 0
    finally:
        gate.open()
        d.stop()


def test_default_prefetch_share_splits_between_active_engines(model_factory, tmp_path, monkeypatch):
    """Without client_max_prefetch, a lone engine may use every prefetch load, and one that
    prefetches beside an active demand-only engine gets half: the storm leaves slots and
    disk time to the other's misses."""
    d = Daemon(model(model_factory), tmp_path, slots=SLOTS, max_prefetch_loads=8)
    gate = Gate(readers_mod.read_many)
    try:
        L = d.idx.expert_layers
        with Client(d.endpoint, name="flood") as fl:
            monkeypatch.setattr(readers_mod, "read_many", gate)   # prefetch loads stay in flight
            assert fl.prefetch(L[0], [0, 1, 2], wait=True) == 3     # alone: up to all 8
            assert client_stats(fl, "flood")["prefetch_loads_in_flight"] == 3
            gate.open()
            fl.acquire(L[0], [0, 1, 2]).release()
            with Client(d.endpoint, name="engine") as eng:
                eng.acquire(L[3], [0, 1]).release()                  # an active demand engine
                gate.ev.clear()
                assert fl.prefetch(L[1], list(range(8)), wait=True) == 4   # half of 8
                assert client_stats(fl, "flood")["prefetches_dropped"] == 4
    finally:
        gate.open()
        d.stop()


def raw_socket(endpoint):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def ask(s, rid, op, **fields):
    s.send(msgpack.packb({"v": 1, "id": rid, "op": op, **fields}))


def answer(s):
    assert s.poll(5000), "daemon did not answer"
    return msgpack.unpackb(s.recv(), raw=False)


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "general-path"])
def test_rate_limit_refuses_and_drops_only_the_flooding_client(model_factory, tmp_path, fast):
    # 1 request/s with bursts of 20: 100 back-to-back requests are far over it on any machine
    d = Daemon(model(model_factory), tmp_path, slots=SLOTS, client_rate_limit=1.0, client_rate_burst=20,
               fast=fast)
    try:
        L = d.idx.expert_layers
        with Client(d.endpoint, name="engine") as eng:
            eng.acquire(L[0], [0, 1]).release()
            s = raw_socket(d.endpoint)
            try:
                codes = []
                for i in range(1, 101):               # resident acquires: the hot path's shape
                    ask(s, i, "acquire", layer=L[0], experts=[0, 1])
                    rep = answer(s)
                    assert rep["id"] == i
                    if rep["ok"]:
                        ask(s, 10_000 + i, "release", lease=rep["lease"], noreply=True)
                    else:
                        codes.append(rep["error"]["code"])
                assert codes and set(codes) == {"rate_limited"}
                refused = len(codes)
                assert refused >= 100 - 20 - 5
                for i in range(200):                  # noreply prefetches: dropped, no reply
                    ask(s, 20_000 + i, "prefetch", layer=L[0], experts=[0, 1], noreply=True)
                ask(s, 99_999, "ping")                # answered rate_limited, nothing before it
                rep = answer(s)
                assert rep["id"] == 99_999 and rep["error"]["code"] == "rate_limited"
                assert "rate limit" in rep["error"]["message"]
                ask(s, 99_998, "release", lease=2**62 + 5)   # releases are never limited
                assert answer(s)["error"]["code"] in ("stale_lease", "unknown_lease")
                flood = next(c for c in d.server.stats()["clients"] if c["name"] != "engine")
                dropped = flood["rate_limited"] - refused - 1
                assert 200 - 5 <= dropped <= 200
                assert flood["leases"] == 0
                # the engine, under the same limit, was never refused
                for _ in range(10):
                    eng.acquire(L[0], [0, 1]).release()
                st = client_stats(eng, "engine")
                assert st["rate_limited"] == 0 and st["errors"] == 0
                assert d.server.stats()["server"]["rate_limited"] == flood["rate_limited"]
            finally:
                s.close()
    finally:
        d.stop()


@pytest.mark.slow
def test_defaults_do_not_limit_a_normal_decode_loop(model_factory, tmp_path):
    cfg = Config()
    # one acquire + one prefetch per layer and token, 48 layers at 100 tokens/s (releases
    # are never limited), with room to spare
    engine_rate = 48 * 100 * 2
    assert cfg.client_rate_limit >= 2 * engine_rate and cfg.client_rate_burst >= engine_rate
    d = Daemon(model(model_factory), tmp_path, slots=16, client_rate_limit=cfg.client_rate_limit,
               client_rate_burst=cfg.client_rate_burst, client_max_prefetch=cfg.client_max_prefetch)
    try:
        L = d.idx.expert_layers
        k = max(1, min(d.idx.top_k or 2, 4))
        # every acquire over the socket: the one prefetched a step before may otherwise be
        # taken through shared memory (the client's hit path), which counts no acquire
        with Client(d.endpoint, name="engine", fast_path=False) as eng:
            for t in range(60):                      # as fast as this client can go
                for i, layer in enumerate(L):
                    picks = [(t * 3 + i + j) % 8 for j in range(k)]
                    nxt = L[(i + 1) % len(L)]
                    eng.prefetch(nxt, [(t * 3 + i + 1 + j) % 8 for j in range(k)])
                    eng.acquire(layer, picks).release()
            st = client_stats(eng, "engine")
        assert st["acquires"] == 60 * len(L), st
        assert st["rate_limited"] == 0 and st["prefetches_dropped"] == 0 and st["errors"] == 0
    finally:
        d.stop()


def test_no_op_prefetch_is_served_by_the_hot_path(model_factory, tmp_path, monkeypatch):
    """A prefetch of experts already resident or loading queues nothing and is answered in
    Cython; one with work to do, or a bad one, still goes to the general path."""
    calls = []
    real = Server._handle
    monkeypatch.setattr(Server, "_handle", lambda self, frames: (calls.append(1), real(self, frames)))
    d = Daemon(model(model_factory), tmp_path, slots=SLOTS, fast=True)
    try:
        L = d.idx.expert_layers
        with Client(d.endpoint, name="engine") as eng:
            eng.acquire(L[0], [0, 1, 2]).release()
            n0 = len(calls)
            for _ in range(20):
                eng.prefetch(L[0], [2, 0, 1])
            eng.ping()
            assert len(calls) == n0 + 1              # only the ping took the general path
            eng.prefetch(L[0], [0, 0])               # a repeat: the general path's error
            eng.prefetch(L[1], [3])                  # work to do
            eng.ping()
            assert len(calls) == n0 + 4
            st = client_stats(eng, "engine")
            assert st["requests"] >= 24 and st["prefetches"] == 1 and st["errors"] == 1
    finally:
        d.stop()


def test_prefetch_chunks_yield_to_a_demand_read(tmp_path, monkeypatch):
    """Prefetch chunks in flight stay within the pool's prefetch_chunks, and while a demand job
    is being read, those started after it was submitted within prefetch_with_demand (the other
    threads wait), whatever the queue holds."""
    threads, chunk = 4, 4096
    size = 256 * chunk
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * (size // 256))
    pf_buf = mmap.mmap(-1, size)
    dm_buf = mmap.mmap(-1, 8 * chunk)
    pf_addr = ctypes.addressof(ctypes.c_char.from_buffer(pf_buf))
    dm_addr = ctypes.addressof(ctypes.c_char.from_buffer(dm_buf))
    lock = threading.Lock()
    # late: prefetch chunks started after the demand job was submitted; peak: most of them in
    # flight at once while a demand chunk was being read
    state = {"demand_submitted": False, "demand_reading": 0, "late": 0, "peak": 0,
             "pf": 0, "pf_peak": 0}
    real = readers_mod.read_many
    started = threading.Event()

    def slow_many(chunks, *a):
        is_pf = pf_addr <= chunks[0][3] < pf_addr + size
        late = False
        with lock:
            if is_pf:
                state["pf"] += len(chunks)
                state["pf_peak"] = max(state["pf_peak"], state["pf"])
            if is_pf and state["demand_submitted"]:
                late = True
                state["late"] += len(chunks)
            elif not is_pf:
                state["demand_reading"] += 1
            if state["demand_reading"]:
                state["peak"] = max(state["peak"], state["late"])
        started.set()
        threading.Event().wait(0.004 * len(chunks))
        try:
            return real(chunks, *a)
        finally:
            with lock:
                if is_pf:
                    state["pf"] -= len(chunks)
                if late:
                    state["late"] -= len(chunks)
                elif not is_pf:
                    state["demand_reading"] -= 1

    monkeypatch.setattr(readers_mod, "read_many", slow_many)
    done = threading.Event()
    pool = ReaderPool([str(path)], threads=threads, chunk_bytes=chunk, direct=False, batch=4,
                      prefetch_chunks=2, prefetch_with_demand=1)
    try:
        for j in range(32):                       # 32 prefetch jobs of 8 chunks
            pool.submit([(0, j * 8 * chunk, 8 * chunk, pf_addr + j * 8 * chunk)], priority=1,
                        callback=lambda *a: None)
        assert started.wait(10)
        with lock:
            state["demand_submitted"] = True
        pool.submit([(0, 0, 8 * chunk, dm_addr)], priority=0, callback=lambda *a: done.set())
        assert done.wait(30)
        assert dm_buf[:] == path.read_bytes()[:8 * chunk]
    finally:
        pool.close()
    assert state["peak"] <= 1, state       # while demand is read: prefetch_with_demand
    assert state["pf_peak"] <= 2, state    # at any time: prefetch_chunks, not one batch per thread


def test_sighup_changes_the_client_limits(model_factory, tmp_path):
    import signal
    import time
    from daemon_util import start_daemon, stop_daemon
    conf = tmp_path / "m.toml"
    conf.write_text("slots = 32\nclient_rate_limit = 0\n")
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model(model_factory), sock, "--config", str(conf), "--log-level", "info")
    err = None
    try:
        with Client(f"ipc://{sock}", name="engine") as c:
            assert c._call({"op": "hello"})["limits"]["client_rate_limit"] == 0
            for _ in range(50):                     # limit off: never refused
                c.ping()
            conf.write_text("slots = 32\nclient_rate_limit = 1.0\nclient_rate_burst = 2\n"
                            "client_max_prefetch = 1\n")
            d.send_signal(signal.SIGHUP)
            t0 = time.time()
            while time.time() - t0 < 10 and err is None:
                try:
                    c.ping()
                except CError as e:
                    err = e
            assert err is not None and err.code == "rate_limited", err
        with Client(f"ipc://{sock}", name="other") as c2:      # a new connection: full bucket
            lim = c2._call({"op": "hello"})["limits"]
            assert (lim["client_rate_limit"], lim["client_rate_burst"], lim["client_max_prefetch"]) == (1.0, 2.0, 1)
    finally:
        out = stop_daemon(d)
    assert "SIGHUP: applied" in out and "client_rate_limit" in out and "client_max_prefetch" in out, out
