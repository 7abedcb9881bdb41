"""The Python client's shared-memory hit path against a real daemon, end to end.

An acquire of resident experts sends no message (the daemon's per-client request count does
not move, its fast-path hit count does), the bytes are the model's, a held fast lease survives
another client's eviction churn, a release is a store, and after a daemon restart the stale
session is dropped and the client says hello again. Under ``MOECACHE_CLIENT_PURE=1`` the same
calls go over the socket (the request counts say so) and give the same bytes.
"""

import pytest

import moecache_client
from daemon_util import stop_daemon
from moecache_client import Client
from moecached.tools.synth import verify_expert_bytes

FAST = moecache_client.IMPLEMENTATION == "cython"
N_EXP = 16


@pytest.fixture
def model(model_factory):
    # 4 blocks x 16 experts of real Qwen3-30B-A3B Q4_K_M sizes (two size classes)
    return model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 7, 8], experts=N_EXP)


@pytest.fixture
def daemon(daemon_procs):
    """``daemon(*args) -> (endpoint, process)``: a daemon with 24 slots unless ``args`` say, at
    one endpoint (a second start is a restart)."""
    return lambda *args: daemon_procs("--slots", "24", *args, sock="d.sock")


def me(c):
    return next(x for x in c.stats()["clients"] if x["name"] == c.name)


def check_bytes(lease):
    for layer, expert, _, _ in lease.items:
        for part, data in lease.parts(expert, layer).items():
            assert verify_expert_bytes(data, layer, part, expert, 0) is None, (layer, expert, part)


def pin_file_counts(c):
    """The pin counts of the client's pin file, read as the daemon reads them."""
    import numpy as np
    p = c.info["pins"]
    raw = bytes(c.pin_map)   # a sealed memfd: no path, the client's own mapping
    n = int(np.frombuffer(raw, dtype=np.uint64, count=3)[2])
    return np.frombuffer(raw, dtype=np.uint32, count=n, offset=p["pins_off"])


def test_resident_acquire_sends_no_message_and_release_is_a_store(daemon):
    ep, _ = daemon()
    with Client(ep, name="fast-e2e") as c:
        L = c.expert_layers
        assert c.fast_path is FAST
        c.acquire_many([(L[0], [1, 2, 3]), (L[1], [4, 5])]).release()    # resident now
        r0 = me(c)["requests"]
        h0 = c.stats()["fast_path"]["fast_hits"]
        lease = c.acquire(L[0], [3, 1, 2])
        many = c.acquire_many([(L[0], [2]), (L[1], [5, 4])])
        check_bytes(lease)
        check_bytes(many)
        assert lease.valid() and many.valid()
        if FAST:
            assert lease.id < 0 and many.id < 0
            assert pin_file_counts(c).sum() == 6
        lease.release()
        many.release()
        if FAST:
            assert pin_file_counts(c).sum() == 0
        # the stats calls below are the only requests since r0 (each counted once it is served);
        # socket only, also 2 acquires, 2 releases and the 2 valid() checks (check op)
        st1 = me(c)
        assert st1["requests"] - r0 == (2 if FAST else 2 + 4 + 2)
        assert c.stats()["fast_path"]["fast_hits"] - h0 == (6 if FAST else 0)


def test_held_fast_lease_survives_eviction_churn(daemon):
    """Another client cycles every expert through a small cache: the held lease's slots are
    never taken (its pins are honoured), its bytes stay the model's, it stays valid."""
    ep, _ = daemon("--slots", "12")
    with Client(ep, name="holder") as c, Client(ep, name="churn", fast_path=False) as other:
        L = c.expert_layers
        c.acquire(L[0], [0, 1, 2]).release()
        held = c.acquire(L[0], [0, 1, 2])
        assert (held.id < 0) is FAST
        for _ in range(2):
            for layer in L:
                for e in range(3, N_EXP):
                    other.acquire(layer, [e]).release()
        assert held.valid()
        check_bytes(held)
        assert held.valid()
        held.release()
        # released: the churn may take those slots now, and an old view would read as invalid
        for layer in L:
            for e in range(3, N_EXP):
                other.acquire(layer, [e]).release()
        assert not held.valid()


def test_pins_stay_within_the_quota_and_the_rest_goes_over_the_socket(daemon):
    """The daemon honours a client's pins on at most ``quota`` slots and reuses the others
    (their leases go invalid): the client pins no more than that; an acquire that would take
    it past the quota goes over the socket, and every lease survives another client's churn."""
    ep, _ = daemon("--slots", "12", "--fast-path-quota", "2")
    with Client(ep, name="holder") as c, Client(ep, name="churn", fast_path=False) as other:
        L = c.expert_layers
        if FAST:
            assert c.info["pins"]["quota"] == 2
        c.acquire(L[0], [0, 1, 2]).release()
        three = c.acquire(L[0], [0, 1, 2])           # resident, but 3 > quota 2: the socket
        assert three.id >= 0
        three.release()
        two = c.acquire(L[0], [0, 1])
        assert (two.id < 0) is FAST
        one = c.acquire(L[0], [2])                   # 2 pinned already: the socket
        assert one.id >= 0
        for _ in range(2):
            for layer in L:
                for e in range(3, N_EXP):
                    other.acquire(layer, [e]).release()
        for lease in (two, one):
            assert lease.valid()
            check_bytes(lease)
            assert lease.valid()
        assert me(c)["pins_ignored"] == 0
        two.release()
        one.release()
        again = c.acquire(L[0], [0, 1])              # released: room for two again
        assert (again.id < 0) is FAST
        again.release()


def test_daemon_restart_makes_the_session_stale_and_the_client_says_hello_again(daemon):
    ep, p = daemon()
    with Client(ep, name="restart") as c:
        L = c.expert_layers
        c.acquire(L[0], [7]).release()
        old = c.acquire(L[0], [7])
        s0 = c.session
        stop_daemon(p)
        assert not old.valid()
        daemon()
        lease = None
        for _ in range(3):      # a call in flight when the connection dropped fails once
            try:
                lease = c.acquire(L[0], [7])
                break
            except moecache_client.DaemonRestarted:
                pass
        assert lease is not None and c.session != s0
        check_bytes(lease)
        lease.release()
        again = c.acquire(L[0], [7])       # resident in the new daemon: fast again
        assert (again.id < 0) is FAST and c.fast_path is FAST
        check_bytes(again)
        again.release()
        old.release()      # a lease of the old session: dropped quietly


def test_a_departed_fast_client_keeps_its_hits_in_the_stats(daemon):
    """Hits taken through shared memory stay in the client's counters after it leaves, as
    socket hits do (``departed_clients``)."""
    ep, _ = daemon()
    with Client(ep, name="leaver") as c:
        L = c.expert_layers
        c.acquire(L[0], [1, 2]).release()
        for _ in range(5):
            c.acquire(L[0], [1, 2]).release()
        before = me(c)
    assert before["hits"] == 10
    with Client(ep, name="watcher", fast_path=False) as w:
        st = w.stats()
    gone = next(x for x in st["departed_clients"] if x["name"] == "leaver")
    assert gone["hits"] + gone["prefetch_hits"] == 10


def test_a_connection_that_only_pings_leaves_no_departure(daemon):
    """A health check's connection (ping, then bye, no hello: libmoecache's mc_probe) is not
    listed among the departed clients, which keep the engines' last summaries; a client that
    said hello is."""
    import msgpack
    import zmq
    ep, _ = daemon()
    with Client(ep, name="engine") as c:
        c.acquire(c.expert_layers[0], [1]).release()
    ctx = zmq.Context()
    try:
        for i in range(40):   # more than the departed list holds
            s = ctx.socket(zmq.DEALER)
            s.connect(ep)
            s.send(msgpack.packb({"v": 1, "id": 1, "op": "ping"}))
            assert msgpack.unpackb(s.recv())["ok"]
            s.send(msgpack.packb({"v": 1, "id": 2, "op": "bye"}))
            assert msgpack.unpackb(s.recv())["ok"]
            s.close(linger=0)
    finally:
        ctx.term()
    with Client(ep, name="watcher", fast_path=False) as w:
        st = w.stats()
    gone = st["departed_clients"]
    assert "engine" in [x["name"] for x in gone], gone
    assert not [x for x in gone if x["name"] == x["id"]], gone   # (no hello: named by its routing id)
    assert [x["name"] for x in st["clients"]] == ["watcher"], st["clients"]
