"""Server + client against a real ExpertCache on real-layout fixtures (in-process daemon thread)."""
import threading
import time

import msgpack
import pytest
import zmq

from moecached.service.server import Server, ServerError
from moecache_client import Client, ServerError as CError

from daemon_util import Daemon
from fixtures import file_bytes

pytestmark = pytest.mark.usefixtures("hot_path")


@pytest.fixture
def daemon(model_factory, tmp_path):
    d = Daemon(model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=8), tmp_path, heartbeat_s=1.0)
    yield d
    d.stop()


def raw(endpoint, payload, frames=None):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    s.send_multipart(frames if frames is not None else [payload])
    assert s.poll(5000), "daemon did not answer"
    rep = msgpack.unpackb(s.recv_multipart()[-1], raw=False)
    s.close()
    return rep


def test_acquire_bytes_exact_and_stats(daemon):
    idx = daemon.idx
    with Client(daemon.endpoint, name="t1") as c:
        assert c.expert_layers == idx.expert_layers
        for layer in idx.expert_layers:
            with c.acquire(layer, [0, 3, 5]) as lease:
                assert len(lease.slots) == 3
                for e in (0, 3, 5):
                    want = file_bytes(idx, layer, e)
                    got = lease.parts(e)
                    assert set(got) == set(want)
                    for p in want:
                        assert bytes(got[p]) == want[p], (layer, e, p)
                    assert not got["down"].flags.writeable
        # second time: hits
        lease = c.acquire(idx.expert_layers[-1], [0, 3, 5])
        assert lease.hits == 3 and lease.misses == 0
        lease.release()
        st = c.stats()
        me = [x for x in st["clients"] if x["name"] == "t1"]
        assert me and me[0]["hits"] >= 3 and me[0]["demand_misses"] >= 3 * len(idx.expert_layers)
    assert daemon.cache.pinned_count() == 0


def test_multi_layer_acquire_and_prefetch(daemon):
    idx = daemon.idx
    L = idx.expert_layers
    with Client(daemon.endpoint) as c:
        assert c.prefetch(L[0], [1, 2], wait=True) == 2
        with c.acquire_many([(L[0], [1, 2]), (L[1], [4])]) as lease:
            assert [(l, e) for l, e, _, _ in lease.items] == [(L[0], 1), (L[0], 2), (L[1], 4)]
            assert bytes(lease.part(4, "gate", layer=L[1])) == file_bytes(idx, L[1], 4)["gate"]


def test_prefetch_conf_over_the_wire(model_factory, tmp_path):
    """The client's conf reaches the cache parallel to the experts (both request forms): the
    daemon's prefetch_min_confidence drops exactly the unsure ones; a bad conf is answered
    bad_type naming the field, nothing is queued, and the daemon keeps serving."""
    with Daemon(model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=8), tmp_path,
                prefetch_min_confidence=0.5) as d, Client(d.endpoint) as c:
        L = d.idx.expert_layers
        assert c.prefetch(None, layers=[(L[0], [1, 2]), (L[1], [3, 4])],
                          conf=[[0.9, 0.1], [0.4, 0.6]], wait=True) == 2
        assert c.prefetch(L[2], [5, 6], conf=[0.5, 0.49], wait=True) == 1
        with c.acquire_many([(L[0], [1, 2]), (L[1], [3, 4]), (L[2], [5, 6])]) as lease:
            assert (lease.prefetch_hits, lease.misses) == (3, 3)
        assert c.stats()["prefetches_dropped_low_confidence"] == 3
        for conf, text in [([0.5], "'conf' has 1 values for 2"), ([0.5, 2], "'conf' holds 2"),
                           ("x", "'conf' has str values")]:
            rep = raw(d.endpoint, msgpack.packb({"v": 1, "id": 5, "op": "prefetch", "layer": L[3],
                                                 "experts": [0, 1], "conf": conf}))
            assert rep["error"]["code"] == "bad_type" and text in rep["error"]["message"], rep
        rep = raw(d.endpoint, msgpack.packb({"v": 1, "id": 5, "op": "prefetch",
                                             "layers": [[L[3], [0, 1]]], "conf": [[0.5, 0.7], [1]]}))
        assert rep["error"]["code"] == "bad_type" and "'conf' must be" in rep["error"]["message"], rep
        assert c.prefetch(L[3], [0], conf=[0.7], wait=True) == 1     # still serving


@pytest.mark.parametrize("msg,code", [
    ({"v": 1, "id": 7, "op": "nope"}, "unknown_op"),
    ({"v": 2, "id": 7, "op": "ping"}, "version"),
    ({"v": True, "id": 7, "op": "ping"}, "version"),
    ({"v": 1.0, "id": 7, "op": "ping"}, "version"),
    ({"v": 1, "id": 7, "op": "acquire", "layer": "x", "experts": [1]}, "bad_type"),
    ({"v": 1, "id": 7, "op": "acquire", "layer": 999, "experts": [1]}, "out_of_range"),
    ({"v": 1, "id": 7, "op": "acquire", "layer": 0, "experts": [99]}, "out_of_range"),
    ({"v": 1, "id": 7, "op": "acquire", "layer": 0, "experts": [1, 1]}, "bad_type"),
    ({"v": 1, "id": 7, "op": "acquire", "layer": 0, "experts": []}, "bad_type"),
    ({"v": 1, "id": 7, "op": "release", "lease": 12345}, "stale_lease"),
    ({"v": 1, "id": 7, "op": "release", "lease": "a"}, "bad_type"),
])
def test_structured_errors(daemon, msg, code):
    rep = raw(daemon.endpoint, msgpack.packb(msg))
    assert rep["ok"] is False and rep["error"]["code"] == code, rep
    assert rep["id"] == 7
    assert raw(daemon.endpoint, msgpack.packb({"v": 1, "id": 8, "op": "ping"}))["ok"]


@pytest.mark.parametrize("pid,pid_start", [
    (2**63, 1), (2**64 - 1, 2**64 - 1), (-2**63, -1), (True, 1), (1.5, 2.0), ("1", "x"), ([1], {}),
])
def test_hello_with_a_pid_no_process_can_have_is_unwatched(daemon, pid, pid_start):
    """A hello whose pid is no possible process id (beyond pid_t, negative, not an integer) is
    served like one without a pid: heartbeat expiry, never an ``internal`` error."""
    rep = raw(daemon.endpoint, msgpack.packb({"v": 1, "id": 7, "op": "hello", "pid": pid,
                                              "pid_start": pid_start}))
    assert rep["ok"] is True and rep["lease_watch"] == "heartbeat", rep.get("error")
    assert daemon.server.counters.get("errors", 0) == 0


def test_malformed_and_huge_declared_array(daemon):
    for payload in (b"\xc1garbage", b"\x93\x01", msgpack.packb([1, 2]),
                    b"\xdd\xff\xff\xff\xff",                    # array32 declaring 4G entries
                    b"\xdf\x7f\xff\xff\xff",                    # map32 declaring 2G pairs
                    b"\xdb\xff\xff\xff\x00abc"):                # str32 declaring 4 GB
        rep = raw(daemon.endpoint, payload)
        assert rep["ok"] is False and rep["error"]["code"] == "malformed", (payload, rep)
    rep = raw(daemon.endpoint, None, frames=[b"a", b"b", b"c"])
    assert rep["error"]["code"] == "malformed"
    # a large legitimate batch works: every layer x every expert in one acquire... (within slots)
    L = daemon.idx.expert_layers
    rep = raw(daemon.endpoint, msgpack.packb({"v": 1, "id": 9, "op": "prefetch",
                                              "layers": [[l, list(range(8))] for l in L]}))
    assert rep["ok"], rep


def test_too_large_request(daemon):
    # 16 slots over 4 layers of 8 experts: one class can never hold 8 experts x 4 layers
    L = daemon.idx.expert_layers
    with Client(daemon.endpoint) as c:
        with pytest.raises(CError) as ei:
            c.acquire_many([(l, list(range(8))) for l in L])
        assert ei.value.code == "too_large"
        c.acquire(L[0], [0]).release()  # still serving


def test_lease_ownership_and_double_release(daemon):
    L = daemon.idx.expert_layers
    with Client(daemon.endpoint, name="a") as a, Client(daemon.endpoint, name="b") as b:
        lease = a.acquire(L[0], [1])
        with pytest.raises(CError) as ei:
            b._call({"op": "release", "lease": lease.id})
        assert ei.value.code == "not_owner"
        a._call({"op": "release", "lease": lease.id})
        with pytest.raises(CError) as ei:
            a._call({"op": "release", "lease": lease.id})
        assert ei.value.code == "unknown_lease"
        lease.released = True
    assert daemon.cache.pinned_count() == 0


def test_check_says_which_leases_a_client_holds(daemon):
    """``check``: the lease validity of a client without the shared-memory rule. True for a
    lease this client holds, false once released, for another client's lease and for an id
    never issued; a malformed list is one bad_type line."""
    L = daemon.idx.expert_layers
    with Client(daemon.endpoint, name="a", fast_path=False) as a, Client(daemon.endpoint, name="b") as b:
        mine, other = a.acquire(L[0], [1, 2]), b.acquire(L[1], [3])
        assert a._call({"op": "check", "leases": [mine.id, other.id, 2**63]})["held"] == [True, False, False]
        mine.release()
        assert a._call({"op": "check", "leases": [mine.id]})["held"] == [False]
        assert b._call({"op": "check", "leases": [other.id]})["held"] == [True]
        with pytest.raises(CError) as ei:
            a._call({"op": "check", "leases": "all"})
        assert ei.value.code == "bad_type" and "leases" in str(ei.value)
        other.release()


def test_heartbeat_expiry_releases_pins(daemon, monkeypatch):
    """A client the daemon cannot watch by its process (no verifiable pid) loses its leases
    after ``heartbeat_s`` of silence (a watched one keeps them: test_lease_validity.py)."""
    import moecache_client
    monkeypatch.setattr(moecache_client, "_own_start_time", lambda: None)
    L = daemon.idx.expert_layers
    c = Client(daemon.endpoint, heartbeat_s=100)  # never pings: looks dead to the daemon
    assert c.info["lease_watch"] == "heartbeat"
    c.acquire(L[0], [1, 2])
    assert daemon.cache.pinned_count() == 2
    deadline = time.time() + 5
    while daemon.cache.pinned_count() and time.time() < deadline:
        time.sleep(0.05)
    assert daemon.cache.pinned_count() == 0
    c._closed = True


def test_second_daemon_refused_and_stale_socket(daemon, model_factory, tmp_path):
    with pytest.raises(ServerError, match="another moecached"):
        Server(daemon.cache, endpoint=daemon.endpoint)


def test_stale_socket_file_replaced(model_factory, tmp_path):
    sock = tmp_path / "d.sock"
    sock.write_text("left by a crash")
    d = Daemon(model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=8), tmp_path)
    try:
        with Client(d.endpoint) as c:
            assert c.ping() < 5
    finally:
        d.stop()
    assert not sock.exists() and not (tmp_path / "d.sock.lock").exists()


def test_client_shared_between_threads(daemon):
    from moecached.tools.synth import verify_expert_bytes
    idx = daemon.idx
    L = idx.expert_layers
    errors = []
    with Client(daemon.endpoint) as c:
        def work(k):
            try:
                import random
                rng = random.Random(k)
                for _ in range(40):
                    l = rng.choice(L)
                    ex = rng.sample(range(8), 2)
                    with c.acquire(l, ex) as lease:
                        for e in ex:
                            for part, v in lease.parts(e).items():
                                r = verify_expert_bytes(v, l, part, e, 0)
                                if r:
                                    errors.append(r)
            except Exception as e:  # noqa
                errors.append(repr(e))
        ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not errors, errors[:3]
    assert daemon.cache.pinned_count() == 0


@pytest.mark.slow
def test_timed_out_acquire_never_leaks_into_later_calls(model_factory, tmp_path):
    from moecache_client import Timeout
    d = Daemon(model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=8), tmp_path, sock="t.sock",
               slots=32, readers=1, chunk_bytes=4096)
    srv, cache = d.server, d.cache
    try:
        with Client(srv.endpoint) as c:
            L = c.expert_layers
            with pytest.raises(Timeout):
                c.acquire_many([(l, list(range(8))) for l in L[:3]], timeout=0.001)
            # the next call gets its own reply, not the late lease
            lease = c.acquire(L[3], [0])
            assert [(l, e) for l, e, _, _ in lease.items] == [(L[3], 0)]
            lease.release()
            # a future that timed out stays timed out: waiting on it again raises at once
            fut = c.acquire_async(L[3], [7, 6, 5, 4])
            with pytest.raises(Timeout):
                fut.result(0.001)
            t0 = time.monotonic()
            with pytest.raises(Timeout):
                fut.result(5.0)
            assert fut.done() and time.monotonic() - t0 < 0.5
            deadline = time.time() + 20
            while cache.pinned_count() and time.time() < deadline:
                c.ping()  # the late reply arrives, and its lease is given back
                time.sleep(0.05)
            assert cache.pinned_count() == 0
    finally:
        d.stop()


def test_trace_paths_are_safe(daemon, tmp_path):
    """The daemon (often root) only creates a new file in an existing directory."""
    victim = tmp_path / "precious.txt"
    victim.write_text("precious")
    with Client(daemon.endpoint) as c:
        for path, code, text in [("rel.npz", "refused", "expected an absolute path"),
                                 (str(tmp_path / "no" / "t.npz"), "refused", "does not exist"),
                                 (str(victim), "refused", "file exists")]:
            with pytest.raises(CError) as ei:
                c.trace_start(path)
            assert ei.value.code == code and text in str(ei.value), ei.value
        assert victim.read_text() == "precious" and not (tmp_path / "no").exists()
        with pytest.raises(CError) as ei:
            c.trace_stop()
        assert ei.value.code == "invalid_state"
        out = str(tmp_path / "t.npz")
        assert c.trace_start(out)["path"] == out
        with pytest.raises(CError) as ei:
            c.trace_start(str(tmp_path / "t2.npz"))
        assert ei.value.code == "invalid_state"
        L = c.expert_layers
        for l in L:
            c.acquire(l, [1, 2], tag="decode").release()
        info = c.trace_stop()["info"]
        assert info["tokens"] == 1 and info["moe_layers"] == len(L) and info["decode_tokens"] == 1
    from moecached.engine.trace import load_trace
    tr = load_trace(out)
    assert [sorted(x for x in tr.experts[0, i] if x >= 0) for i in range(len(L))] == [[1, 2]] * len(L)


def test_request_shape_errors(daemon):
    rep = raw(daemon.endpoint, msgpack.packb({"v": 1, "op": "ping"}))
    assert rep["error"]["code"] == "bad_type" and "'id' missing" in rep["error"]["message"]
    L = daemon.idx.expert_layers
    rep = raw(daemon.endpoint, msgpack.packb({"v": 1, "id": 3, "op": "acquire", "layer": L[0], "experts": [1],
                                              "layers": [[L[1], [2]]]}))
    assert rep["error"]["code"] == "bad_type" and "not both" in rep["error"]["message"]


def test_client_refuses_bad_values_locally(daemon):
    from moecache_client import ClientError
    with Client(daemon.endpoint) as c:
        L = c.expert_layers
        for bad in ([1.5], ["a"], [None]):
            with pytest.raises(ClientError) as ei:
                c.acquire(L[0], bad)
            assert "expected integers" in str(ei.value)
        c.info["limits"]["max_request_experts"] = 4
        t0 = time.time()
        with pytest.raises(ClientError) as ei:
            c.acquire(L[0], list(range(5)))
        assert "at most 4" in str(ei.value) and time.time() - t0 < 1
        import numpy as _np
        c.acquire(L[0], _np.array([1, 2], dtype=_np.int16)).release()  # numpy ints are fine


def test_max_message_bytes_is_enforced(model_factory, tmp_path):
    d = Daemon(model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=8), tmp_path, sock="m.sock",
               readers=2, max_message_bytes=4096)
    srv = d.server
    try:
        rep = raw(srv.endpoint, msgpack.packb({"v": 1, "id": 5, "op": "ping", "pad": "x" * 3000}))
        assert rep["ok"]
        rep = raw(srv.endpoint, msgpack.packb({"v": 1, "id": 5, "op": "ping", "pad": "x" * 5000}))
        assert rep["error"]["code"] == "malformed" and "at most 4096" in rep["error"]["message"]
        with Client(srv.endpoint) as c:
            assert c.info["limits"]["max_message_bytes"] == 4096
    finally:
        d.stop()


def test_req_style_envelope_is_echoed(daemon):
    """docs/protocol.md: a client may put an empty delimiter frame first; the reply carries it."""
    s = zmq.Context.instance().socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(daemon.endpoint)
    s.send(msgpack.packb({"v": 1, "id": 11, "op": "ping"}))  # REQ adds the delimiter itself
    assert s.poll(5000)
    rep = msgpack.unpackb(s.recv(), raw=False)
    assert rep["ok"] and rep["id"] == 11
    s.close()


def test_release_and_noreply_field_checks(daemon):
    L = daemon.idx.expert_layers
    for msg, text in [({"op": "release", "lease": 1, "leases": [1]}, "not both"),
                      ({"op": "release", "lease": -1}, "unsigned 64-bit"),
                      ({"op": "prefetch", "layer": L[0], "experts": [1], "noreply": 1}, "true or false"),
                      ({"op": "ping"}, None)]:
        msg.update(v=1, id=21)
        rep = raw(daemon.endpoint, msgpack.packb(msg))
        if text is None:
            assert rep["ok"]
        else:
            assert rep["error"]["code"] == "bad_type" and text in rep["error"]["message"], rep
    rep = raw(daemon.endpoint, msgpack.packb({"id": 3, "op": "ping"}))
    assert rep["error"]["code"] == "version" and "'v' missing" in rep["error"]["message"]
    rep = raw(daemon.endpoint, b"\xc1\xc1")
    assert not rep["error"]["message"].endswith(": ")
    with Client(daemon.endpoint) as c:
        lim = c.info["limits"]
        assert {"max_message_bytes", "max_array_len", "max_map_len", "max_str_len", "max_request_experts"} <= set(lim)
        st = msgpack.unpackb(msgpack.packb(c.stats()), strict_map_key=True)  # string keys only
        assert all(isinstance(k, str) for k in st["layers"])


def test_hit_path_refuses_what_the_general_path_refuses(model_factory, tmp_path):
    """With every expert resident the server takes the Cython hit path; each malformed request
    must still get the general path's error (never a lease), and leave no pin behind."""
    d = Daemon(model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=8), tmp_path,
               max_request_experts=3)
    try:
        L = d.idx.expert_layers
        with Client(d.endpoint) as c:
            c.acquire(L[1], [0, 1, 2]).release()   # resident now
            c.acquire(L[1], [3]).release()
        cases = [
            ({"layer": True, "experts": [0]}, "bad_type"),        # True == 1 as a dict key
            ({"layer": L[1], "experts": [0, True]}, "bad_type"),
            ({"layer": L[1], "experts": [0, 1.0]}, "bad_type"),
            ({"layer": L[1], "experts": [0, 0]}, "bad_type"),
            ({"layer": L[1], "experts": [0, 1, 2, 3]}, "too_large"),  # over max_request_experts
            ({"layer": L[1], "experts": [0, 99]}, "out_of_range"),
            ({"layer": L[1], "experts": [0], "tag": "bogus"}, "bad_type"),
        ]
        for i, (fields, code) in enumerate(cases):
            msg = {"v": 1, "id": 100 + i, "op": "acquire", **fields}
            rep = raw(d.endpoint, msgpack.packb(msg))
            assert rep["ok"] is False and rep["error"]["code"] == code, (fields, rep)
            assert rep["id"] == 100 + i
        assert d.cache.pinned_count() == 0
        rep = raw(d.endpoint, msgpack.packb({"v": 1, "id": 7, "op": "acquire", "layer": L[1], "experts": [2, 0]}))
        assert rep["ok"] and rep["hits"] == 2 and [it[1] for it in rep["items"]] == [2, 0]
    finally:
        d.stop()


def test_loop_wakes_for_completions_and_stops_promptly(model_factory, tmp_path):
    """Reader-thread completions and stop() reach the loop through its wake-up messages; a
    client that picks a routing id like the wake-up one is served as a plain client."""
    d = Daemon(model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=8), tmp_path)
    try:
        L = d.idx.expert_layers
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, b"\xffmoecached-wake-" + bytes(8))
        s.connect(d.endpoint)
        for i, layer in enumerate(L):          # misses: every reply comes after a read completes
            t = time.monotonic()
            s.send(msgpack.packb({"v": 1, "id": i + 1, "op": "acquire", "layer": layer, "experts": [4, 5]}))
            assert s.poll(5000), "no reply to an acquire that needed reads"
            rep = msgpack.unpackb(s.recv(), raw=False)
            assert rep["ok"] and rep["misses"] == 2, rep
            assert time.monotonic() - t < 1.0
            s.send(msgpack.packb({"v": 1, "id": 0, "op": "release", "lease": rep["lease"], "noreply": True}))
        s.close()
    finally:
        t = time.monotonic()
        d.server.stop()
        d.t.join(5)
        stopped_in = time.monotonic() - t
        d.cache.close()
    assert not d.t.is_alive() and stopped_in < 1.0, stopped_in


def test_noreply_release_fast_path_keeps_ownership_rules(daemon):
    """A `noreply` release takes the server's short path only for the caller's own live lease;
    another client's lease, a released one and a stale one still get their error replies."""
    L = daemon.idx.expert_layers
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for s in (a, b):
        s.setsockopt(zmq.LINGER, 0)
        s.connect(daemon.endpoint)

    def call(s, msg):
        s.send(msgpack.packb({"v": 1, **msg}))
        assert s.poll(5000), "no reply"
        return msgpack.unpackb(s.recv(), raw=False)

    rep = call(a, {"id": 1, "op": "acquire", "layer": L[0], "experts": [1, 2]})
    lid = rep["lease"]
    rel = {"id": 2, "op": "release", "lease": lid, "noreply": True}
    assert call(b, rel)["error"]["code"] == "not_owner"
    assert daemon.cache.pinned_count() == 2            # still a's
    a.send(msgpack.packb({"v": 1, **rel}))            # a's own: released, no reply
    assert call(a, {"id": 3, "op": "ping"})["id"] == 3
    assert daemon.cache.pinned_count() == 0
    assert call(a, rel)["error"]["code"] == "unknown_lease"
    assert call(a, {**rel, "lease": 5})["error"]["code"] == "stale_lease"
    assert call(a, {**rel, "lease": True})["error"]["code"] == "bad_type"
    for s in (a, b):
        s.close()


@pytest.mark.parametrize("fast", [True, False])
def test_fast_path_and_general_path_count_alike(model_factory, tmp_path, fast):
    """The same request sequence served with and without the Cython hot path leaves the same
    per-client and cache counters (hits, prefetch hits, misses, requests, leases)."""
    d = Daemon(model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=8), tmp_path, sock="f.sock",
               readers=2, fast=fast)
    idx, cache, srv = d.idx, d.cache, d.server
    try:
        L = idx.expert_layers
        # every request over the socket (the client's shared-memory hit path would bypass both)
        with Client(srv.endpoint, name="seq", fast_path=False) as c:
            c.prefetch(L[2], [6], wait=True)
            deadline = time.time() + 5
            while cache.stats()["reads_in_flight"] and time.time() < deadline:
                time.sleep(0.01)
            for step in range(3):
                for layer in L[:3]:
                    with c.acquire(layer, [1, 2] if step else [1]) as lease:
                        assert lease.hits + lease.prefetch_hits + lease.misses == len(lease.items)
            with c.acquire(L[2], [6, 1]) as lease:
                assert lease.prefetch_hits == 1 and lease.hits == 1
                assert bytes(lease.part(6, "up")) == file_bytes(idx, L[2], 6)["up"]
            st = c.stats()
        me = next(x for x in st["clients"] if x["name"] == "seq")
        got = {k: me[k] for k in ("requests", "acquires", "hits", "prefetch_hits", "demand_misses", "leases", "errors")}
        # requests: hello + prefetch + 10 acquires + 10 releases + stats = 23. Per layer L0..L2:
        # step 0 [1] misses; step 1 [1, 2] one hit one miss; step 2 [1, 2] two hits; then
        # [6, 1] on L2: a prefetch hit and a hit. Hits 3 + 6 + 1, misses 3 + 3.
        assert got == {"requests": 23, "acquires": 10, "hits": 10, "prefetch_hits": 1,
                       "demand_misses": 6, "leases": 0, "errors": 0}, got
        assert st["hits"] == 10 and st["prefetch_hits"] == 1 and st["demand_misses"] == 6
        assert cache.pinned_count() == 0 and not srv.leases
    finally:
        d.stop()


def test_huge_expert_id_is_out_of_range_on_both_paths(model_factory, tmp_path):
    """An expert id beyond a C long (2**63 and up, valid msgpack uint64) once crashed the
    loop from the Cython hit path; it must be an out_of_range error on the hot path (a known
    client) and on the general path (a REQ-style envelope), and the daemon keeps serving."""
    d = Daemon(model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=8), tmp_path)
    try:
        L = d.idx.expert_layers
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(d.endpoint)

        def call(msg, delim=False):
            s.send_multipart(([b""] if delim else []) + [msgpack.packb({"v": 1, **msg})])
            assert s.poll(5000), "no reply: the daemon died?"
            return msgpack.unpackb(s.recv_multipart()[-1], raw=False)

        assert call({"id": 1, "op": "acquire", "layer": L[0], "experts": [0]})["ok"]  # 0 resident
        for i, ex in enumerate(([2**63], [0, 2**63], [2**64 - 1], [0, -2**63])):
            for delim in (False, True):
                rep = call({"id": 10 + i, "op": "acquire", "layer": L[0], "experts": ex}, delim)
                assert rep["ok"] is False and rep["error"]["code"] == "out_of_range", (ex, delim, rep)
        assert d.cache.pinned_count() == 1
        assert d.cache.acquire_resident(L[0], [2**70]) is None
        assert call({"id": 99, "op": "ping"})["ok"]
        s.close()
    finally:
        d.stop()


def test_malformed_frames_answered_without_a_stale_delimiter(daemon):
    """A request with 3+ frames is answered without an envelope, whatever the client's
    previous request looked like."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(daemon.endpoint)
    s.send_multipart([b"", msgpack.packb({"v": 1, "id": 1, "op": "ping"})])   # REQ-style
    assert s.poll(5000) and s.recv_multipart()[0] == b""
    s.send_multipart([b"x", b"y", b"z"])
    assert s.poll(5000)
    frames = s.recv_multipart()
    assert len(frames) == 1 and msgpack.unpackb(frames[0])["error"]["code"] == "malformed"
    s.close()


def test_long_client_name_connects_and_is_cut_to_64(daemon):
    """A very long client name once made hello fail (over the protocol's string limit) and
    left a ghost client behind; the client keeps the 64 characters the daemon shows."""
    name = "engine-" + "x" * 5000
    with Client(daemon.endpoint, name=name, connect_timeout=5) as c:
        c.acquire(daemon.idx.expert_layers[0], [1]).release()
        names = [x["name"] for x in c.stats()["clients"]]
    assert name[:64] in names and not [n for n in names if n != name[:64] and n.startswith("engine-")]


def test_every_malformed_reply_is_counted(daemon):
    """``server.malformed`` counts every reply whose code is ``malformed``, whichever check
    refused the request (frame count, msgpack decoding, size limit, not a map)."""
    def malformed():
        return daemon.server.stats()["server"].get("malformed", 0)
    before = malformed()
    sent = 0
    for payload in (b"\xc1garbage", b"\x93\x01", msgpack.packb([1, 2]), b"\xdd\xff\xff\xff\xff",
                    msgpack.packb({"v": 1, "id": 3, "op": "ping"}) + b"\x00",   # trailing bytes
                    b"\x00" * (daemon.server.max_message_bytes + 1)):            # over the limit
        rep = raw(daemon.endpoint, payload)
        assert rep["error"]["code"] == "malformed", (payload[:16], rep)
        sent += 1
    rep = raw(daemon.endpoint, None, frames=[b"a", b"b", b"c"])
    assert rep["error"]["code"] == "malformed"
    sent += 1
    # other refusals are errors, not malformed
    assert raw(daemon.endpoint, msgpack.packb({"v": 1, "id": 4, "op": "nope"}))["error"]["code"] != "malformed"
    assert malformed() - before == sent


def test_timed_out_acquire_is_cancelled_in_the_daemon(model_factory, tmp_path):
    """A client that gives up on an acquire (Timeout) sends ``cancel``: the daemon drops the
    pending acquire and its pins at once; the reads finish as prefetches; no lease appears."""
    from moecache_client import Timeout
    d = Daemon(model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=8), tmp_path, sock="t.sock",
               slots=32, readers=2)
    cache = d.cache
    held, gate, mu = [], threading.Event(), threading.Lock()
    submit = cache.readers.submit

    def held_submit(reads, *, priority, callback):   # reads run; their completion waits for the gate
        def cb(*a):
            with mu:
                if not gate.is_set():
                    held.append((callback, a))
                    return
            callback(*a)
        return submit(reads, priority=priority, callback=cb)
    cache.readers.submit = held_submit
    srv = d.server

    def mine(st):
        return [x for x in st["clients"] if x["name"] == "giver-up"][0]
    try:
        with Client(srv.endpoint, name="giver-up", fast_path=False) as c:   # lease counts from the reply
            L = c.expert_layers
            with pytest.raises(Timeout):
                c.acquire(L[0], [0, 1, 2, 3], timeout=0.2)
            st = c.stats()            # answered after the cancel: same connection, in order
            assert mine(st)["pending"] == 0 and st["leases_open"] == 0 and st["waiting"] == 0
            assert held                # (the reads are still loading: their slots stay pinned)
            with mu:
                gate.set()
            for cb, a in held:        # the reads complete now, as prefetches
                cb(*a)
            deadline = time.monotonic() + 10   # reads not yet finished when the gate opened
            while cache.stats()["reads_in_flight"] and time.monotonic() < deadline:
                time.sleep(0.01)       # complete on their reader threads
            st = c.stats()
            assert st["pinned"] == 0 and st["leases_open"] == 0 and st["leases_held"] == 0
            assert mine(st)["leases"] == 0 and mine(st)["acquires"] == 0
            lease = c.acquire(L[0], [0, 1, 2, 3])
            assert lease.misses == 0 and lease.prefetch_hits == 4
            lease.release()
            # the op itself: an acquire that is not pending is not cancelled; bad fields refused
            rep = raw(srv.endpoint, msgpack.packb({"v": 1, "id": 5, "op": "cancel", "request": 99}))
            assert rep["ok"] and rep["cancelled"] is False
            rep = raw(srv.endpoint, msgpack.packb({"v": 1, "id": 6, "op": "cancel", "request": "x"}))
            assert rep["error"]["code"] == "bad_type"
        assert cache.pinned_count() == 0 and not srv.leases
    finally:
        d.stop()


def test_hot_path_follows_the_environment(daemon, hot_path):
    """MOECACHED_HOT_PATH=0 starts a Server with the Cython hot path off (the hot_path fixture
    runs this module both ways)."""
    assert daemon.server.fast_path is hot_path


def test_request_limits_changed_live_reach_the_hot_path(daemon):
    """A live change of max_request_experts (SIGHUP) applies to every request at once: an
    acquire of resident experts over the new limit, from a client the hot path knows, is
    refused there too."""
    L = daemon.idx.expert_layers
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(daemon.endpoint)

    def call(msg):
        s.send(msgpack.packb({"v": 1, **msg}))
        assert s.poll(5000), "daemon did not answer"
        return msgpack.unpackb(s.recv(), raw=False)
    try:
        lease = call({"id": 1, "op": "acquire", "layer": L[1], "experts": [0, 1]})["lease"]
        call({"id": 2, "op": "release", "lease": lease})   # resident now: the hot path may serve it
        daemon.server.set_request_limits(1, daemon.server.max_message_bytes)
        rep = call({"id": 3, "op": "acquire", "layer": L[1], "experts": [0, 1]})
        assert rep["ok"] is False and rep["error"]["code"] == "too_large", rep
        rep = call({"id": 4, "op": "acquire", "layer": L[1], "experts": [1]})
        assert rep["ok"] and rep["hits"] == 1, rep
        assert call({"id": 5, "op": "release", "lease": rep["lease"]})["released"] == 1
    finally:
        s.close()
    assert daemon.cache.pinned_count() == 0
