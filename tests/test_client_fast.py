"""The Python client's shared-memory hit path against a scripted daemon side (fake_fastd.py).

With the compiled extension, an acquire of resident experts pins them in the pin file without
a message and its release is a store; anything else goes over the socket. With
``MOECACHE_CLIENT_PURE=1`` (test_client_pure.py re-runs this file so) the same calls go over
the socket and give the same leases and bytes.
"""
import ctypes
import os
import threading

import numpy as np
import pytest

import moecache_client
from moecache_client import Client, LeaseInvalid, ServerError
from fake_fastd import CLASSES, FakeDaemon, RING_N, expert_bytes

FAST = moecache_client.IMPLEMENTATION == "cython"


@pytest.fixture
def fake(tmp_path):
    d = FakeDaemon(tmp_path)
    yield d
    d.close()


@pytest.fixture
def client(fake):
    c = Client(fake.endpoint, name="fast-test", heartbeat_s=60)
    yield c
    c.close()


def check_bytes(lease, layer, experts):
    for e in experts:
        for p, view in lease.parts(e, layer).items():
            assert np.array_equal(view, expert_bytes(layer, e, p, view.size)), (layer, e, p)


def test_extension_is_built_unless_pure():
    """An install builds moecache_client._shm; only MOECACHE_CLIENT_PURE=1 turns it off."""
    pure = os.environ.get("MOECACHE_CLIENT_PURE", "") not in ("", "0")
    assert moecache_client.IMPLEMENTATION == ("python" if pure else "cython")


def test_hello_asks_for_the_fast_path_only_when_compiled(fake, client):
    assert fake.hellos[0].get("fast_path", False) is FAST
    assert client.fast_path is FAST
    assert client.arena.size == fake.size and client.arena.descriptor == fake.desc
    # the public address reads the same bytes as the file
    slot = fake.load(3, 1)
    off = fake.part_off[(0, "gate")] + slot * 96
    assert ctypes.string_at(client.arena.address + off, 96) == expert_bytes(3, 1, "gate", 96).tobytes()


def test_resident_experts_are_pinned_without_a_message(fake, client):
    slots = [fake.load(3, e) for e in (1, 4, 6)]
    lease = client.acquire(3, [6, 1, 4])
    assert fake.counts["acquire"] == (0 if FAST else 1)
    assert lease.items == [[3, 6, 0, slots[2]], [3, 1, 0, slots[0]], [3, 4, 0, slots[1]]]
    assert lease.slots == [slots[2], slots[0], slots[1]]
    check_bytes(lease, 3, [1, 4, 6])
    assert lease.valid()
    if FAST:
        assert lease.id < 0
        assert [fake.pinned(0, s) for s in slots] == [1, 1, 1]
        # one ring entry per expert, key + 1, in request order, with a time
        assert fake.ring_pending() == 3
        fake.drain()
        assert fake.drained == [fake.key(3, e) for e in (6, 1, 4)]
        assert all(fake.ring[:3, 1] > 0)
    lease.release()
    assert fake.pin_counts.sum() == 0
    client.ping()   # a barrier: a release message, had there been one, is counted by now
    assert fake.counts["release"] == (0 if FAST else 1)
    lease.release()    # idempotent: no count goes below zero
    assert fake.pin_counts.sum() == 0


def test_a_pinned_slot_is_not_evicted_and_stays_valid(fake, client):
    """The daemon's eviction rule reads the pin: a held fast lease is never invalidated."""
    fake.load(3, 2)
    with client.acquire(3, [2]) as lease:
        if FAST:
            assert not fake.evict(3, 2)
        assert lease.valid()
        check_bytes(lease, 3, [2])
    assert fake.evict(3, 2)


def test_generation_move_invalidates_fast_and_socket_leases(fake, client):
    """valid() is mcshm_valid for both kinds: a bumped generation (a pin the daemon did not
    honour, or a socket lease revoked) is seen, and part() refuses the lease."""
    s = fake.load(4, 3)
    fast = client.acquire(4, [3])
    sock = client.acquire(4, [5])          # not resident: over the socket
    assert fake.counts["acquire"] == (1 if FAST else 2)
    assert fast.valid() and sock.valid()
    fake.gens(1)[s] += 1
    assert not fast.valid() and sock.valid()
    with pytest.raises(LeaseInvalid, match="revoked"):
        fast.part(3, "gate")
    fake.gens(1)[sock.slots[0]] += 1
    assert not sock.valid()
    fast.release()
    sock.release()


def test_one_missing_expert_sends_the_whole_set_and_leaves_no_pin(fake, client):
    for e in (0, 1, 2):
        fake.load(5, e)
    lease = client.acquire(5, [0, 1, 2, 7])
    assert fake.counts["acquire"] == 1
    assert lease.id > 0
    assert fake.pin_counts.sum() == 0 and fake.ring_pending() == 0
    check_bytes(lease, 5, [0, 1, 2, 7])
    lease.release()


def test_acquire_many_across_classes(fake, client):
    """Two size classes: pins land at each class's global slot (slot base + slot)."""
    a = [fake.load(3, e) for e in (0, 1)]
    b = [fake.load(4, e) for e in (2, 3)]
    lease = client.acquire_many([(3, [0, 1]), (4, [2, 3])])
    assert fake.counts["acquire"] == (0 if FAST else 1)
    assert lease.items == [[3, 0, 0, a[0]], [3, 1, 0, a[1]], [4, 2, 1, b[0]], [4, 3, 1, b[1]]]
    check_bytes(lease, 3, [0, 1])
    check_bytes(lease, 4, [2, 3])
    if FAST:
        want = np.zeros_like(fake.pin_counts)
        want[[a[0], a[1], CLASSES[0]["n_slots"] + b[0], CLASSES[0]["n_slots"] + b[1]]] = 1
        assert np.array_equal(fake.pin_counts, want)
    lease.release()
    assert fake.pin_counts.sum() == 0


def test_acquire_async_of_resident_experts_is_ready_at_once(fake, client):
    fake.load(3, 5)
    fut = client.acquire_async(3, [5])
    assert fut.done() is True or not FAST
    lease = fut.result(5)
    check_bytes(lease, 3, [5])
    lease.release()
    assert fake.pin_counts.sum() == 0


def test_bad_requests_are_judged_by_the_daemon(fake, client):
    """A repeated expert, a layer without experts: the socket path answers (one error)."""
    fake.load(3, 1)
    with pytest.raises(ServerError, match="bad_type"):
        client.acquire(3, [1, 1])
    with pytest.raises(ServerError, match="bad_type"):
        client.acquire(7, [1])
    assert fake.counts["acquire"] == 2
    assert fake.pin_counts.sum() == 0


def test_full_ring_uses_the_socket(fake, client):
    """The daemon drains the ring before it serves a request; until then a full ring means
    the socket."""
    fake.drain_on_request = False
    fake.load(3, 0)
    leases = [client.acquire(3, [0]) for _ in range(RING_N + 1)]
    assert fake.counts["acquire"] == (1 if FAST else RING_N + 1)
    if FAST:
        assert fake.ring_pending() == RING_N
        assert fake.pinned(0, leases[0].slots[0]) == RING_N
        assert leases[-1].id > 0
    for x in leases:
        x.release()
    assert fake.pin_counts.sum() == 0


def test_new_epoch_is_stale_and_the_client_says_hello_again(fake, client):
    fake.load(3, 1)
    old = client.acquire(3, [1])
    assert old.valid()
    fake.restart(0x7777)
    # fast: the epoch says so; socket only: valid() asks the daemon (check), whose reply shows
    # the new session: that call fails (the lease is not valid), the next says hello
    assert not old.valid()
    if not FAST:
        assert "restarted" in old._invalid_because() or "confirm" in old._invalid_because()
    lease = client.acquire(3, [1])
    # fast: the stale session is dropped, hello again, this acquire over the socket, the next fast
    assert len(fake.hellos) == 2 and client.session == 0x7777
    assert fake.counts["acquire"] == (1 if FAST else 2)
    assert lease.valid()
    check_bytes(lease, 3, [1])
    again = client.acquire(3, [1])
    assert fake.counts["acquire"] == (1 if FAST else 3)
    assert again.valid()
    for x in (old, lease, again):
        x.release()
    assert fake.pin_counts.sum() == 0


def test_model_changed_state_uses_the_socket_without_a_new_hello(fake, client):
    fake.load(3, 1)
    fake.ctl[2] = 2
    lease = client.acquire(3, [1])
    assert fake.counts["acquire"] == 1 and len(fake.hellos) == 1
    assert lease.valid()
    lease.release()


def test_no_pins_offered_means_the_socket(fake):
    fake.offer_pins = False
    fake.load(3, 1)
    with Client(fake.endpoint, heartbeat_s=60) as c:
        assert not c.fast_path
        with c.acquire(3, [1]) as lease:
            check_bytes(lease, 3, [1])
    assert fake.counts["acquire"] == 1


def test_fast_path_off_by_argument(fake):
    fake.load(3, 1)
    with Client(fake.endpoint, heartbeat_s=60, fast_path=False) as c:
        assert "fast_path" not in fake.hellos[0] and not c.fast_path
        c.acquire(3, [1]).release()
    assert fake.counts["acquire"] == 1


def test_threads_share_the_pin_file(fake, client):
    """Pins from several threads: the ring gets every hit once, every count returns to 0."""
    for e in range(4):
        fake.load(3, e)
    n, errors = 200, []

    def work(t):
        try:
            for i in range(n):
                with client.acquire(3, [(t + i) % 4, (t + i + 1) % 4]) as lease:
                    if not lease.valid():
                        errors.append("invalid")
        except Exception as e:   # pragma: no cover - reported below
            errors.append(repr(e))

    ths = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert errors == []
    assert fake.pin_counts.sum() == 0
    client.ping()
    fake.drain()
    socket_acquires = fake.counts["acquire"]
    if FAST:
        assert len(fake.drained) == 2 * (4 * n - socket_acquires)
    else:
        assert socket_acquires == 4 * n


def test_values_the_fast_path_cannot_judge_go_the_socket_way(fake):
    """numpy ids pin like ints (items are plain ints); a generator, a float, more experts than
    the daemon's limit: the same outcome as over the socket, and no pin is left behind."""
    fake.max_request_experts = 3
    for e in range(4):
        fake.load(3, e)
    with Client(fake.endpoint, heartbeat_s=60) as c:
        with c.acquire(np.int64(3), np.array([2, 0], dtype=np.int32)) as lease:
            assert lease.items == [[3, 2, 0, fake.resmap()[fake.key(3, 2)] - 1],
                                   [3, 0, 0, fake.resmap()[fake.key(3, 0)] - 1]]
            assert all(type(v) is int for row in lease.items for v in row)
        assert fake.counts["acquire"] == (0 if FAST else 1)
        with c.acquire(3, (e for e in (1, 3))) as lease:
            check_bytes(lease, 3, [1, 3])
        with pytest.raises(moecache_client.ClientError, match="float"):
            c.acquire(3, [1.0])
        with pytest.raises(moecache_client.ClientError, match="float"):
            c.acquire(3.0, [1])
        with pytest.raises(moecache_client.ClientError, match="at most 3"):
            c.acquire(3, [0, 1, 2, 3])
    assert fake.pin_counts.sum() == 0
