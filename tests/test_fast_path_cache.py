"""ExpertCache and fast-path pins (no daemon): the resident map follows loads and evictions,
a victim held by a shared-memory pin is skipped and a request counting on it waits, and a
release through shared memory (a store, no message) lets it in at the next sweep."""
import os
import time

import pytest

from fixtures import make_model
from moecached.engine.cache import ExpertCache
from moecached.engine.index import open_index
from shm_shim import OK, Item, lib, map_file, shim_layout


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # 4 layers x 16 experts; layers 0 and 1 share size class 0 (4 of the 8 slots)
    return make_model(tmp_path_factory.mktemp("fp-cache"), "olmoe-1b-7b-0924-Q4_K_M", layers=4, experts=16)


@pytest.fixture
def cache(model, tmp_path):
    c = ExpertCache(open_index(model), slots=8, readers=2, lock_memory=False, arena_dir=str(tmp_path))
    c.arena.set_epoch(77, 1)
    yield c
    c.close()


def attach(cache, quota=8):
    """A pin file on ``cache`` and a shim layout over it: ``(pinfile, h, desc, ctl)``."""
    f = cache.open_pin_file("moecached-pins-test-1", 77, quota)
    shm = cache._shm
    pins = {"path": f.path, "size": f.size, "ring_n": 16384, "pins_off": shm.pins_off,
            "ring_off": shm.ring_off, "quota": quota}
    desc = cache.descriptor()
    ctl = map_file(desc["path"], desc["size"], False)
    h = shim_layout(desc, pins, 77, ctl, map_file(f.path, f.size, True))
    return f, h, desc


def shm_pin(h, keys):
    import ctypes
    arr = (ctypes.c_uint32 * len(keys))(*keys)
    out = (Item * len(keys))()
    r = lib().shim_pin(h, arr, len(keys), out)
    return list(out) if r == OK else r


def test_resident_map_follows_loads_and_evictions(cache):
    L = cache.index.expert_layers
    resmap = cache.arena.resident_map()
    cache.release(cache.acquire(L[0], [1, 2], timeout=30))
    assert resmap[1] and resmap[2] and resmap[1] != resmap[2]
    cache.release(cache.acquire(L[1], [0, 1, 2, 3], timeout=30))   # evicts both
    assert resmap[1] == 0 and resmap[2] == 0
    for e in range(4):
        assert resmap[16 + e] == cache.acquire_resident(L[1], [e]).items[0][3] + 1


def test_request_waits_for_a_slot_held_by_a_fast_pin_then_gets_it(cache):
    L = cache.index.expert_layers
    f, h, _ = attach(cache)
    cache.release(cache.acquire(L[0], [0, 1, 2, 3], timeout=30))
    items = shm_pin(h, [0, 1, 2, 3])            # every slot pinned through shared memory
    assert isinstance(items, list)
    got = []
    cache.acquire_async([(L[1], [5])], got.append)
    assert got == [] and cache.stats()["waiting"] == 1, "granted a slot under a fast pin"
    assert cache.stats()["fast_path"]["evictions_held"] >= 4
    lib().shim_unpin(h, (Item * 1)(items[2]), 1)   # release one, as a client does: a store
    cache.sweep_pins()
    import time
    t = time.monotonic() + 20
    while not got and time.monotonic() < t:
        time.sleep(0.01)
    assert got and not isinstance(got[0], Exception), got
    assert got[0].items[0][3] == items[2].slot      # the slot released, and only that one
    for it in items[:2] + items[3:]:
        assert cache.arena.generations(it.cls)[it.slot] == it.gen
    cache.release(got[0])
    cache.close_pin_file(f)
    assert cache.stats()["fast_path"]["held_keys"] == 0
    assert not os.path.exists(f.path)


def test_a_pin_within_the_quota_is_honoured_while_released_pins_are_not_swept_yet(cache):
    # quota 2: two slots pinned, found by evictions (honoured), released with a store; before
    # the next sweep the client pins two other slots (still 2, within its quota). An eviction
    # must see those pins: the released ones may not keep the quota full, or the daemon
    # would reuse a slot under a live pin (its lease would go invalid)
    L = cache.index.expert_layers
    f, h, _ = attach(cache, quota=2)
    cache.release(cache.acquire(L[0], [0, 1, 2, 3], timeout=30))
    old = shm_pin(h, [0, 1])
    assert isinstance(old, list)
    cache.drain_pins()                                        # the pins' hits reach the LRU
    cache.release(cache.acquire(L[0], [2, 3], timeout=30))   # then these: 0 and 1 the coldest
    cache.release(cache.acquire(L[1], [5, 6], timeout=30))   # skips the pinned, takes the others
    assert sorted(f.honoured) == sorted(cache._shm.global_slot(it.cls, it.slot) for it in old)
    lib().shim_unpin(h, (Item * 2)(*old), 2)                  # released: no message, no sweep yet
    new = shm_pin(h, [16 + 5, 16 + 6])
    assert isinstance(new, list), new
    got = []
    cache.acquire_async([(L[0], [7])], got.append)          # needs a victim
    for it in new:
        assert cache.arena.generations(it.cls)[it.slot] == it.gen, "a slot pinned within the quota was reused"
    assert cache.stats()["fast_path"]["pins_ignored"] == 0
    cache.sweep_pins()                                       # the old pins' slots are free again
    import time
    t = time.monotonic() + 20
    while not got and time.monotonic() < t:
        time.sleep(0.01)
    assert got and not isinstance(got[0], Exception), got
    assert got[0].items[0][3] in {it.slot for it in old}
    for it in new:
        assert cache.arena.generations(it.cls)[it.slot] == it.gen
    cache.release(got[0])
    lib().shim_unpin(h, (Item * 2)(*new), 2)
    cache.close_pin_file(f)


def pin_file_words(f):
    """The pin file ``f`` mapped shared, as a writable u64 array (what its client, or a hostile
    one, writes), without the compiled shim."""
    import mmap

    import numpy as np
    with open(f.path, "r+b") as fh:
        m = mmap.mmap(fh.fileno(), f.size)
    return np.frombuffer(m, dtype="<u8")


def test_a_client_flooding_its_hit_ring_gets_only_its_rate_of_drain_work(cache):
    # A client that refills its ring as fast as it can (head = tail + ring_n, every entry a
    # valid hit on a resident expert) must not make the daemon apply a ring per request: its
    # ring is drained at fast_path_hit_rate entries per second with bursts of one ring, the
    # rest is skipped (the tail moves past it, so the ring is free again) and counted.
    import numpy as np
    L = cache.index.expert_layers
    f = cache.open_pin_file("moecached-pins-test-1", 77, 8)
    cache.release(cache.acquire(L[0], [0, 1, 2, 3], timeout=30))
    w = pin_file_words(f)
    ring, n = cache._shm.ring_off // 8, 16384
    w[ring:ring + 2 * n:2] = 1 + np.arange(n) % 4            # keys 0..3 of layer 0 (resident)
    w[ring + 1:ring + 2 * n:2] = 1000 + np.arange(n)         # their times
    rate = 2000.0
    cache._shm.hit_rate = rate
    fp0 = cache.stats()["fast_path"]
    t0 = time.monotonic()
    w[8] = w[16] + 5000                   # within the burst: every entry counts
    cache.drain_pins()
    assert cache.stats()["fast_path"]["fast_hits"] - fp0["fast_hits"] == 5000
    written = 0
    for _ in range(40):                   # the flood: a full ring before every request
        w[8] = w[16] + n
        written += n
        cache.drain_pins()
        assert w[16] == w[8], "the ring was not consumed: the client would fall back to the socket"
    elapsed = time.monotonic() - t0
    fp = cache.stats()["fast_path"]
    applied = fp["fast_hits"] - fp0["fast_hits"] - 5000
    # what was left of the burst (n - 5000) plus the rate over the time since
    assert applied <= n - 5000 + rate * elapsed + 1, (applied, elapsed)
    assert fp["ring_skipped"] == written - applied > 0
    assert f.info()["ring_skipped"] == fp["ring_skipped"]
    assert fp["ring_drops"] == 0 and fp["ring_resets"] == 0
    # rate 0: no limit, the whole ring counts again
    cache._shm.hit_rate = 0
    w[8] = w[16] + n
    cache.drain_pins()
    assert cache.stats()["fast_path"]["fast_hits"] == fp["fast_hits"] + n
    del w
    cache.close_pin_file(f)
    fp = cache.stats()["fast_path"]
    assert fp["ring_skipped"] == written - applied, "a closed pin file's skips are kept"


def test_a_light_client_beside_a_flooding_one_of_its_uid_is_drained(cache):
    # Two pin files of one uid: one refills its whole ring before every drain, the other writes
    # a few entries (an engine's hits). With a limit or without, the light one's entries are
    # applied within a few drains and its ring never backs up (a full ring would push its pins
    # to the socket for good).
    import numpy as np

    L = cache.index.expert_layers
    n, uid = 16384, os.getuid()
    flood, light = (cache.open_pin_file(f"moecached-pins-mix-{i}", 77, 8, uid) for i in range(2))
    cache.release(cache.acquire(L[0], [0, 1, 2, 3], timeout=30))
    ring = cache._shm.ring_off // 8
    wf, wl = pin_file_words(flood), pin_file_words(light)
    wf[ring:ring + 2 * n:2] = 1 + np.arange(n) % 4
    wf[ring + 1:ring + 2 * n:2] = 1000 + np.arange(n)
    for rate in (0.0, 2_000_000.0):
        cache._shm.hit_rate = rate
        h0 = light.hits + light.prefetch_hits
        for step in range(30):
            wf[8] = wf[16] + n
            head = int(wl[8])
            for j in range(10):
                e = (head + j) % n
                wl[ring + 2 * e], wl[ring + 2 * e + 1] = 1 + j % 4, 10 ** 6 + step
            wl[8] = head + 10
            cache.drain_pins()
            assert wl[8] - wl[16] <= 20, (rate, step, int(wl[8] - wl[16]))
        assert light.hits + light.prefetch_hits - h0 >= 10, rate
    del wf, wl
    cache.close_pin_file(flood)
    cache.close_pin_file(light)


def test_many_pin_files_of_one_uid_share_one_budget_and_a_drain_is_bounded(cache):
    # One uid opening many fast-path connections and flooding every ring gets one budget
    # between them (fast_path_hit_rate, bursts of one ring), and no drain applies more than
    # DRAIN_MAX entries over all files, a limit or none (the rest waits in the rings).
    import numpy as np

    from moecached.engine._shm import DRAIN_MAX
    L = cache.index.expert_layers
    k, n, uid = 16, 16384, os.getuid()
    files = [cache.open_pin_file(f"moecached-pins-test-{i}", 77, 8, uid) for i in range(k)]
    cache.release(cache.acquire(L[0], [0, 1, 2, 3], timeout=30))
    ring = cache._shm.ring_off // 8
    ws = [pin_file_words(f) for f in files]
    for w in ws:
        w[ring:ring + 2 * n:2] = 1 + np.arange(n) % 4
        w[ring + 1:ring + 2 * n:2] = 1000 + np.arange(n)
    hits = lambda: cache.stats()["fast_path"]["fast_hits"]
    rate = 2000.0
    cache._shm.hit_rate = rate
    h0, t0 = hits(), time.monotonic()
    written = 0
    for _ in range(20):
        for w in ws:
            w[8] = w[16] + n
            written += n
        before = hits()
        cache.drain_pins()
        assert hits() - before <= DRAIN_MAX
    elapsed = time.monotonic() - t0
    applied = hits() - h0
    assert applied <= n + rate * elapsed + 1, (applied, elapsed)   # one burst, one rate
    fp = cache.stats()["fast_path"]
    assert fp["ring_skipped"] + applied <= written
    # no limit: every ring full, each drain applies at most DRAIN_MAX and leaves the rest
    cache._shm.hit_rate = 0
    for w in ws:
        w[8] = w[16] + n
    pending = sum(int(w[8] - w[16]) for w in ws)
    assert pending > DRAIN_MAX
    done = 0
    while done < pending:
        before = hits()
        cache.drain_pins()
        got = hits() - before
        assert 0 < got <= DRAIN_MAX
        done += got
    assert done == pending and all(w[8] == w[16] for w in ws)
    assert cache.stats()["fast_path"]["ring_skipped"] == fp["ring_skipped"], "nothing skipped without a limit"
    del w, ws
    for f in files:
        cache.close_pin_file(f)


def test_the_ring_flood_warning_is_one_line_a_minute_per_uid_naming_the_rate_exceeded(cache, caplog):
    # The warning's state is the uid's budget: a client that reconnects (a new pin file) makes
    # no new line within the minute, and the line names the rate in force at the skips, not
    # the one a reload set since.
    import logging
    from types import SimpleNamespace

    import numpy as np

    from moecached.service.clients import ServerClients
    L = cache.index.expert_layers
    cache.release(cache.acquire(L[0], [0, 1, 2, 3], timeout=30))
    srv = SimpleNamespace(cache=cache, clients={}, RING_WARN_S=60.0)
    ring, n = cache._shm.ring_off // 8, 16384

    def flood(name):
        f = cache.open_pin_file(name, 77, 8, os.getuid())
        w = pin_file_words(f)
        w[ring:ring + 2 * n:2] = 1 + np.arange(n) % 4
        w[ring + 1:ring + 2 * n:2] = 1000 + np.arange(n)
        for _ in range(3):
            w[8] = w[16] + n
            cache.drain_pins()
        del w
        cache.close_pin_file(f)     # it goes, as a client that reconnects

    def lines(now):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            ServerClients._check_hit_rings(srv, now)
        return [r.getMessage() for r in caplog.records if "faster than fast_path_hit_rate" in r.getMessage()]

    cache._shm.hit_rate = 100.0
    flood("moecached-pins-test-1")
    cache._shm.hit_rate = 0          # a reload after the skips
    first = cache.stats()["fast_path"]["ring_skipped"]
    got = lines(1000.0)
    assert len(got) == 1 and "(100 entries/s" in got[0] and f"uid {os.getuid()} " in got[0], got
    assert f": {first} entries skipped since the last warning" in got[0], got
    cache._shm.hit_rate = 100.0
    for i in range(2, 6):            # reconnects within the minute: no new line
        flood(f"moecached-pins-test-{i}")
        assert lines(1000.0 + i) == []
    skipped = cache.stats()["fast_path"]["ring_skipped"]
    got = lines(1061.0)              # a minute on: one line, every skip since the last one
    assert len(got) == 1 and f": {skipped - first} entries skipped since" in got[0], got
    assert lines(1062.0) == []
