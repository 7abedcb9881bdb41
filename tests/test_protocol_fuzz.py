"""Property-based fuzz of the message layer: whatever arrives, the daemon answers with a
structured reply (never crashes, never hangs), and keeps serving."""

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moecached.facts import protocol as P

from daemon_util import Daemon

pytestmark = pytest.mark.usefixtures("hot_path")

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=False),
                    st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(scalars, lambda ch: st.lists(ch, max_size=6) | st.dictionaries(st.text(max_size=8), ch, max_size=6),
                      max_leaves=20)
ops = st.sampled_from(list(P.OPS) + ["", "nope"])


def request_like():
    return st.fixed_dictionaries(
        {"v": st.one_of(st.just(1), values), "id": st.one_of(st.integers(0, 2**64 - 1), values), "op": st.one_of(ops, values)},
        optional={"layer": st.one_of(st.integers(-3, 10), values), "experts": st.one_of(st.lists(st.integers(-2, 20), max_size=10), values),
                  "layers": values, "lease": st.one_of(st.integers(0, 2**64 - 1), values), "leases": values,
                  "tag": values, "timeout_ms": values, "client": values, "path": st.just(123), "noreply": st.booleans()})


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_factory, hot_path):
    d = Daemon(model_factory("qwen3-30b-a3b-Q4_K_M", layers=2, experts=8),
               tmp_path_factory.mktemp("fuzz"), sock="f.sock", readers=2, heartbeat_s=30)
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(d.endpoint)
    yield d.server, s
    s.close()
    d.stop()


def roundtrip(sock, payload: bytes, expect_reply=True):
    sock.send(payload)
    if not expect_reply:
        return None
    assert sock.poll(5000), "no reply: the daemon hung or crashed"
    return msgpack.unpackb(sock.recv(), raw=False, strict_map_key=False)


def check_alive(sock):
    sock.send(msgpack.packb({"v": 1, "id": 424242, "op": "ping"}))
    while True:  # skip errors answering earlier noreply requests
        assert sock.poll(5000), "no reply: the daemon hung or crashed"
        rep = msgpack.unpackb(sock.recv(), raw=False, strict_map_key=False)
        if rep["id"] == 424242:
            break
        assert rep["ok"] is False and rep["error"]["code"] != "internal", rep
    assert rep["ok"]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(max_size=64))
def test_random_bytes(server, data):
    srv, sock = server
    rep = roundtrip(sock, data)
    assert rep["v"] == 1 and isinstance(rep["ok"], bool)
    if not rep["ok"]:
        assert set(rep["error"]) == {"code", "message"} and rep["error"]["code"] != "internal"


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(msg=request_like())
def test_request_shaped_maps(server, msg):
    srv, sock = server
    if msg.get("op") in ("trace_start", "bye"):
        msg["op"] = "status"
    noreply = msg.get("noreply") is True and msg.get("op") in ("prefetch", "release") and msg.get("v") == 1
    try:
        payload = msgpack.packb(msg, use_bin_type=True)
    except (OverflowError, ValueError):
        return
    rep = roundtrip(sock, payload, expect_reply=True) if not noreply else None
    if rep is not None:
        assert isinstance(rep["ok"], bool)
        if not rep["ok"]:
            assert rep["error"]["code"] != "internal", rep
        # release any lease the fuzzer happened to get, so pins never pile up
        if rep["ok"] and "lease" in rep:
            roundtrip(sock, msgpack.packb({"v": 1, "id": 1, "op": "release", "lease": rep["lease"]}))
    check_alive(sock)


def test_no_pins_left(server):
    srv, sock = server
    check_alive(sock)
    assert srv.cache.pinned_count() == 0
