"""A socket hit is one call into Cython that runs no Python-level code.

The server's loop hands each request frame to ``FastPath.handle`` (``moecached.service._serve``);
for an acquire of resident experts (and the noreply release of its lease) that one call reads
the request, takes the lease through the cache's ``HitPath`` (``moecached.engine._hits``),
writes and sends the reply and registers the lease. Here a live server's loop runs that call
under a profiler and with a spy on every Python hook the hot path holds: during the hits no
Python function runs and no hook is called, and the bytes the leases name are the file's.
The hot path's own msgpack reader and writer are checked against msgpack.
"""
import gc
import random
import sys
import threading

import msgpack
import pytest

from moecached.engine.pins import Lease
from moecached.facts import protocol as P
from moecached.service._serve import lease_reply, parse_request

from fixtures import file_bytes

N_HITS = 200


class Spy:
    """A hook that counts its calls, then does what the hook did."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *a, **kw):
        self.calls += 1
        return self.fn(*a, **kw)


@pytest.fixture
def server(model_factory, tmp_path):
    """A Server on a real cache, its loop in a thread, every request the hot path handles run
    under a profiler of the loop thread (``server.calls``: (op, served, Python calls seen)),
    the hot path's Python hooks spied on (``server.spies``)."""
    from moecached.engine.cache import ExpertCache
    from moecached.engine.index import open_index
    from moecached.service.server import Server
    path = model_factory("qwen3-30b-a3b-Q4_K_M", layers=2, experts=16)
    idx = open_index(str(path))
    cache = ExpertCache(idx, slots=32, readers=2, lock_memory=False)
    srv = Server(cache, endpoint=f"ipc://{tmp_path}/hp.sock", model_path=str(path))
    srv.fast_path = True
    srv.idx = idx
    srv.calls = []
    srv.spies = {}
    build = srv._fast_handler

    def profiled():
        fast = build()
        hooks = srv._hooks
        if hooks is None:
            return fast
        # every callable the hot path holds goes through a spy: a new FastPath over them
        from moecached.service._serve import FastPath
        for name in dir(hooks):
            v = getattr(hooks, name)
            if not name.startswith("_") and callable(v) and not isinstance(v, type) \
                    and name not in ("hits", "sock", "limit", "counters", "clients", "leases",
                                     "fields"):
                srv.spies[name] = spy = Spy(v)
                setattr(hooks, name, spy)
        fast = FastPath(hooks).handle

        def run(frames):
            seen = []

            def prof(frame, event, arg):
                if event == "call":   # a Python frame (C calls are "c_call", from Python only)
                    seen.append(frame.f_code.co_qualname)
            try:
                op = msgpack.unpackb(frames[-1]).get("op")
            except Exception:
                op = None
            sys.setprofile(prof)
            try:
                served = fast(frames)
            finally:
                sys.setprofile(None)
            srv.calls.append((op, served, seen))
            return served
        return run

    srv._fast_handler = profiled
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.stop()
    t.join(10)
    cache.close()


def test_a_socket_hit_runs_no_python_and_calls_no_hook(server):
    from moecache_client import Client
    idx = server.idx
    layer = idx.expert_layers[0]
    experts = [0, 3, 5, 9, 12, 14, 1, 7]
    assert server.spies, "the hot path holds Python hooks: they must be spied on"
    with Client(server.endpoint, name="hp", fast_path=False) as c:
        c.acquire(layer, experts).release()            # a miss: reads, general path
        c.ping()   # its release (noreply) is handled before the calls are counted from the mark
        want = {e: file_bytes(idx, layer, e) for e in experts}
        gc.disable()   # no collection (and no finalizer) inside a measured call
        try:
            mark = len(server.calls)
            leases = []
            for i in range(N_HITS):
                lease = c.acquire(layer, experts)
                assert lease.hits + lease.prefetch_hits == len(experts) and lease.misses == 0
                if i % 50 == 0:
                    for e in experts:
                        got = lease.parts(e)
                        assert {p: bytes(v) for p, v in got.items()} == want[e], (layer, e)
                leases.append(lease.id)
                lease.release()
            c.ping()   # the last release (noreply) has been handled once the ping is answered
        finally:
            gc.enable()
    calls = server.calls[mark:]
    hits = [seen for op, served, seen in calls if op == "acquire" and served]
    releases = [seen for op, served, seen in calls if op == "release" and served]
    assert len(hits) == N_HITS, f"{N_HITS - len(hits)} resident acquires took the general path"
    assert len(releases) == N_HITS
    ran = sorted({name for seen in hits + releases for name in seen})
    assert not ran, f"Python code ran during socket hits: {ran}"
    assert {name: s.calls for name, s in server.spies.items() if s.calls} == {}
    assert server.cache.pinned_count() == 0
    st = server.cache.stats()
    assert st["hits"] >= N_HITS * len(experts) and st["leases_open"] == 0


def test_a_release_while_acquires_wait_takes_the_general_release(model_factory, tmp_path):
    """The hit path's release declines (changing nothing) while an acquire waits for slots, so
    the general release grants the waiter: the waiter is never stranded."""
    from moecached.engine.cache import ExpertCache
    from moecached.engine.index import open_index
    idx = open_index(str(model_factory("qwen3-30b-a3b-Q4_K_M", layers=2, experts=16)))
    with ExpertCache(idx, slots=8, readers=2, lock_memory=False) as cache:
        layer = idx.expert_layers[0]
        held = cache.acquire(layer, list(range(8)), timeout=60)
        got = []
        ev = threading.Event()
        cache.acquire_async([(layer, [8])], lambda r: (got.append(r), ev.set()))
        assert cache.stats()["waiting"] == 1
        assert not cache.hit_path.release(held)      # declined: an acquire waits
        assert cache.pinned_count() == 8
        cache.release(held)
        assert ev.wait(60) and isinstance(got[0], Lease)
        cache.release(got[0])
        assert cache.pinned_count() == 0


# ---- the hot path's msgpack reader and writer ----------------------------------------------------
def _shapes(rng):
    n = rng.choice([0, 1, 2, 8, 15, 16, 17, 255, 256, 257])
    ints = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63, 2**64 - 1, -1, -33]
    num = lambda: rng.choice(ints + [rng.randrange(0, 300)])   # noqa: E731
    base = {"v": rng.choice([1, 1, 1, 2, 0, True]), "id": num()}
    acquire = dict(base, op="acquire", layer=num(), experts=[rng.randrange(0, 300) for _ in range(n)])
    release = dict(base, op="release", lease=num(), noreply=rng.choice([True, True, False, 1]))
    prefetch = dict(acquire, op="prefetch", noreply=rng.choice([True, False]))
    msg = rng.choice([acquire, release, prefetch])
    if rng.random() < 0.2:
        msg[rng.choice(["extra", "conf", "tag", "op"])] = rng.choice(["x", 1.5, None, [1], "ping"])
    if rng.random() < 0.2:
        del msg[rng.choice(sorted(msg))]
    return msg


def test_the_request_reader_agrees_with_msgpack():
    """Whatever the hot path's reader accepts decodes to the same fields with msgpack (the
    general path's decoder, with the protocol's limits); every canonical hot-path request
    msgpack writes is accepted; odd encodings and damaged bytes are declined or agree."""
    rng = random.Random(7)
    accepted = 0
    for i in range(4000):
        msg = _shapes(rng)
        payload = msgpack.packb(msg, use_bin_type=True)
        if rng.random() < 0.3:   # damage it
            b = bytearray(payload)
            for _ in range(rng.randrange(1, 4)):
                k = rng.randrange(len(b))
                b[k] = rng.randrange(256)
            if rng.random() < 0.3:
                b = b[:rng.randrange(len(b))] if rng.random() < 0.5 else b + b"\x00"
            payload = bytes(b)
        got = parse_request(payload)
        if got is None:
            continue
        accepted += 1
        want = msgpack.unpackb(payload, **P.UNPACK_LIMITS)
        assert got == want and type(want) is dict, (payload, got, want)
        assert all(type(v) is type(want[k]) for k, v in got.items())
    assert accepted > 500
    for msg in ({"v": 1, "id": 5, "op": "acquire", "layer": 3, "experts": [1, 2, 3]},
                {"v": 1, "id": 2**64 - 1, "op": "release", "lease": 2**62 + 9, "noreply": True},
                {"v": 1, "id": 0, "op": "prefetch", "layer": 0, "experts": list(range(256)),
                 "noreply": True}):
        assert parse_request(msgpack.packb(msg, use_bin_type=True)) == msg
    for odd in (msgpack.packb({"v": 1.0, "id": 1, "op": "acquire", "layer": 3, "experts": [1]}),
                msgpack.packb({b"v": 1, "id": 1, "op": "acquire", "layer": 3, "experts": [1]},
                              use_bin_type=True),
                msgpack.packb({"v": 1, "id": 1, "op": "acquire", "layer": 3, "experts": [-1]}),
                msgpack.packb({"v": 1, "id": 1, "op": "acquire", "layer": 3, "experts": list(range(257))}),
                msgpack.packb([1, 2]), b"", b"\x80\x00"):
        assert parse_request(odd) is None, odd


def test_the_reply_writer_writes_what_msgpack_writes():
    """The hot path's reply to a hit is byte for byte ``msgpack.packb`` of the general path's
    reply (``Server._deliver`` of an all-resident lease)."""
    rng = random.Random(3)
    edges = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**62 + 1, 2**64 - 1]
    for n in (1, 2, 8, 15, 16, 17, 64, 256):
        for _ in range(20):
            pick = lambda: rng.choice(edges + [rng.randrange(0, 2**64)])   # noqa: E731
            items = [(rng.randrange(0, 300), rng.randrange(0, 256), rng.randrange(0, 4),
                      rng.choice(edges[:9])) for _ in range(n)]
            gens = [pick() for _ in range(n)]
            hits = rng.randrange(0, n + 1)
            lease = Lease(pick(), items, hits, n - hits, 0, 0.0)
            rid, session = pick(), pick()
            want = msgpack.packb({"v": P.PROTOCOL_VERSION, "id": rid, "ok": True, "session": session,
                                  "lease": lease.id, "items": lease.items, "gens": gens,
                                  "hits": lease.hits, "prefetch_hits": lease.prefetch_hits,
                                  "misses": 0, "stall_us": 0}, use_bin_type=True)
            assert lease_reply(P.PROTOCOL_VERSION, rid, session, lease, gens) == want
