"""ExpertCache: bit-exact leases on real-layout fixtures, counters, eviction order, error paths.

Every check of slot contents compares ``arena.view(class, slot, part)`` with the bytes read
from the model file(s) with plain reads at ``index.parts(layer, expert)`` -- never with what the
cache itself read.
"""
from __future__ import annotations

import os
import random
import shutil
import threading
import time
import zlib

import numpy as np
import pytest

from fixtures import make_model
from moecached.engine.cache import (AcquireTimeout, CacheClosed, CacheError, CapacityError, ExpertCache,
                             Lease, LeaseError, LoadError, RequestError)
from moecached.engine.index import open_index


class FileTruth:
    """Expected bytes of (layer, expert, part), read from the model files with normal reads.

    Shared by the threads of a test: each part is read with ``os.pread`` at its own offset,
    never through a shared file position (a seek then a read of one file object, interleaved
    with another thread's, returns the other expert's bytes and the memo would keep them)."""

    def __init__(self, idx):
        self.idx = idx
        self._f = [open(f, "rb", buffering=0) for f in idx.files]
        self._memo = {}

    def get(self, layer, expert):
        key = (layer, expert)
        got = self._memo.get(key)
        if got is None:
            got = {}
            for sp in self.idx.parts(layer, expert):
                b = os.pread(self._f[sp.file].fileno(), sp.nbytes, sp.offset)
                assert len(b) == sp.nbytes
                got[sp.part] = np.frombuffer(b, dtype=np.uint8)
            self._memo[key] = got
        return got

    def check(self, cache, lease):
        """Assert every item of ``lease`` holds its expert's file bytes, part by part."""
        for layer, expert, cid, slot in lease.items:
            want = self.get(layer, expert)
            for part, w in want.items():
                v = cache.arena.view(cid, slot, part)
                if not np.array_equal(v, w):
                    bad = int(np.argmax(v != w))
                    raise AssertionError(f"layer {layer} expert {expert} part {part} class {cid} "
                                         f"slot {slot}: wrong byte at {bad} of {len(w)}")

    def close(self):
        for f in self._f:
            f.close()


class TCache(ExpertCache):
    """ExpertCache whose blocking acquires time out by default: a bug fails a test, never hangs it."""

    def acquire(self, layer, experts, timeout=60.0):
        return super().acquire(layer, experts, timeout)

    def acquire_many(self, requests, timeout=60.0):
        return super().acquire_many(requests, timeout)


def new_cache(idx, **kw):
    kw.setdefault("lock_memory", False)   # RLIMIT_MEMLOCK is small in CI
    kw.setdefault("readers", 4)
    return TCache(idx, **kw)


def wait_idle(cache, timeout=10.0):
    t = time.monotonic() + timeout
    while cache.stats()["reads_in_flight"]:
        assert time.monotonic() < t, "reads did not finish"
        time.sleep(0.002)


FIXTURES = {
    # name: (layout, make_model kwargs)  -- every set has >= 2 size classes unless noted
    "qwen3": ("qwen3-30b-a3b-Q4_K_M", dict(layers=[0, 6, 8], experts=8)),
    "dsv2lite": ("deepseek-v2-lite-Q4_K_M", dict(layers=[1, 3, 5], experts=4)),  # Q8_0 / Q5_0 down
    "qwen3-split3": ("qwen3-30b-a3b-Q4_K_M", dict(layers=[0, 6], experts=6, split=3)),
    "mixtral-legacy": ("mixtral-8x7b-Q4_K_M", dict(layers=[4], experts=3, legacy=True)),  # 1 class
    "olmoe": ("olmoe-1b-7b-0924-Q4_K_M", dict(layers=4, experts=16)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("cache-models")
    memo = {}

    def get(name):
        if name not in memo:
            layout, kw = FIXTURES[name]
            memo[name] = make_model(base, layout, **kw)
        return memo[name]
    return get


def random_sequence(cache, idx, truth, rng, steps, *, prefetch=True):
    """Random acquire/prefetch/release steps; every lease checked at acquire and at release."""
    held: list[Lease] = []
    ne = idx.n_experts
    caps = {}
    for c in cache.arena.classes:
        caps[c.id] = c.n_slots if cache.policy == "global" else c.n_slots // len(c.layers)
    s0 = cache.stats()
    total = s0["hits"] + s0["prefetch_hits"] + s0["demand_misses"]
    for _ in range(steps):
        r = rng.random()
        if r < 0.15 and prefetch:
            layer = rng.choice(idx.expert_layers)
            cache.prefetch(layer, rng.sample(range(ne), rng.randint(1, min(3, ne))))
        elif r < 0.45 and held:
            lease = held.pop(rng.randrange(len(held)))
            truth.check(cache, lease)           # still right while pinned
            cache.release(lease)
        else:
            if len(held) >= 2:
                lease = held.pop(0)
                truth.check(cache, lease)
                cache.release(lease)
            if rng.random() < 0.3 and len(idx.expert_layers) > 1:
                layers = rng.sample(idx.expert_layers, 2)
                req = []
                used = {}
                for layer in layers:
                    cid = idx.layer_class[layer]
                    room = max(0, (caps[cid] // 3) - used.get(cid, 0))
                    k = min(idx.top_k, ne, room)
                    if k:
                        req.append((layer, rng.sample(range(ne), rng.randint(1, k))))
                        used[cid] = used.get(cid, 0) + len(req[-1][1])
                if not req:
                    continue
                lease = cache.acquire_many(req, timeout=30)
                assert [(l, e) for l, e, _, _ in lease.items] == [(l, e) for l, ex in req for e in ex]
            else:
                layer = rng.choice(idx.expert_layers)
                cid = idx.layer_class[layer]
                k = min(idx.top_k, ne, max(1, caps[cid] // 3))
                ex = rng.sample(range(ne), rng.randint(1, k))
                lease = cache.acquire(layer, ex, timeout=30)
                assert [e for _, e, _, _ in lease.items] == ex
                assert lease.hits + lease.prefetch_hits + lease.misses == len(ex)
            total += len(lease.items)
            truth.check(cache, lease)
            held.append(lease)
    for lease in held:
        truth.check(cache, lease)
        cache.release(lease)
    wait_idle(cache)
    assert cache.pinned_count() == 0
    s = cache.stats()
    assert s["hits"] + s["prefetch_hits"] + s["demand_misses"] == total
    assert s["leases_open"] == 0 and s["waiting"] == 0 and s["read_errors"] == s0["read_errors"]
    return s


@pytest.mark.parametrize("name,policy", [
    ("qwen3", "global"), ("qwen3", "per-layer"), ("dsv2lite", "global"),
    ("qwen3-split3", "global"), ("mixtral-legacy", "global"), ("olmoe", "per-layer"),
])
def test_bit_exact_random_sequences(models, name, policy):
    idx = open_index(models(name))
    if name != "mixtral-legacy":
        assert len(idx.size_classes) >= 2
    truth = FileTruth(idx)
    total_experts = len(idx.expert_layers) * idx.n_experts
    slots = max(len(idx.expert_layers) * 3, total_experts // 2)  # evictions guaranteed
    if name == "mixtral-legacy":
        slots = 2
    cache = new_cache(idx, slots=slots, policy=policy)
    try:
        steps = 30 if name == "mixtral-legacy" else 120   # ~100 MB experts: keep it short
        s = random_sequence(cache, idx, truth, random.Random(zlib.crc32(name.encode())), steps=steps)
        assert s["evictions"] > 0
        assert s["bytes_read"] > 0
    finally:
        cache.close()
        truth.close()
    assert not os.path.exists(cache.arena.path)


def test_bit_exact_buffered_fallback_on_tmpfs(models, tmp_path):
    """Model on /dev/shm (tmpfs refuses O_DIRECT): readers fall back, bytes still exact."""
    src = models("qwen3-split3")
    d = f"/dev/shm/moecache-test-{os.getpid()}"
    os.makedirs(d, exist_ok=True)
    try:
        for f in os.listdir(os.path.dirname(src)):
            shutil.copy(os.path.join(os.path.dirname(src), f), d)
        idx = open_index(os.path.join(d, os.path.basename(src)))
        truth = FileTruth(idx)
        cache = new_cache(idx, slots=6)
        try:
            random_sequence(cache, idx, truth, random.Random(7), steps=40)
        finally:
            cache.close()
            truth.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- requests and leases
def test_request_errors_raised_at_once(models):
    idx = open_index(models("qwen3"))
    cache = new_cache(idx, slots=6)  # 3+3 or so
    try:
        caps = {c.id: c.n_slots for c in cache.arena.classes}
        layer = idx.expert_layers[0]
        cap = caps[idx.layer_class[layer]]
        with pytest.raises(RequestError, match="holds at most"):
            cache.acquire(layer, list(range(cap + 1)))
        with pytest.raises(RequestError, match="holds at most"):
            cache.acquire_async([(layer, list(range(cap + 1)))], lambda r: None)
        with pytest.raises(RequestError, match="out of range"):
            cache.acquire(layer, [idx.n_experts])
        with pytest.raises(RequestError, match="out of range"):
            cache.acquire(layer, [-1])
        with pytest.raises(RequestError, match="not a layer"):
            cache.acquire(999, [0])
        with pytest.raises(RequestError, match="duplicate"):
            cache.acquire(layer, [1, 1])
        with pytest.raises(RequestError, match="empty"):
            cache.acquire(layer, [])
        with pytest.raises(RequestError):
            cache.prefetch(layer, [idx.n_experts])
        # global policy: two layers of one class together larger than the class
        same = idx.size_classes[0].layers
        if len(same) >= 2:
            n = cap // 2 + 1
            with pytest.raises(RequestError, match="holds at most"):
                cache.acquire_many([(same[0], list(range(n))), (same[1], list(range(n)))])
        assert cache.pinned_count() == 0
        assert cache.stats()["reads"] == 0  # nothing was started
    finally:
        cache.close()


def test_double_and_unknown_release(models):
    idx = open_index(models("qwen3"))
    cache = new_cache(idx, slots=12)
    try:
        lease = cache.acquire(idx.expert_layers[0], [0, 1])
        cache.release(lease)
        with pytest.raises(LeaseError, match="already released"):
            cache.release(lease)
        with pytest.raises(LeaseError, match="already released"):
            cache.release(lease.id)
        with pytest.raises(LeaseError, match="not from this cache"):
            cache.release(12345)
        other = new_cache(idx, slots=12)
        try:
            l2 = other.acquire(idx.expert_layers[0], [0])
            with pytest.raises(LeaseError, match="not from this cache"):
                cache.release(l2.id)
            assert abs(l2.id - lease.id) > 2**20  # random bases differ
            other.release(l2)
        finally:
            other.close()
        l3 = cache.acquire(idx.expert_layers[0], [0, 1])
        assert l3.id > lease.id and l3.hits == 2
        cache.release(l3.id)
        assert cache.pinned_count() == 0
    finally:
        cache.close()


# ---------------------------------------------------------------- counters and policy
def test_counters_exact_on_scripted_sequence(models):
    """Scripted hits / misses / prefetch hits / wasted prefetches; one class, known slot count."""
    idx = open_index(models("mixtral-legacy"))   # one layer, one class, 3 experts
    truth = FileTruth(idx)
    cache = new_cache(idx, slots=2)
    L = idx.expert_layers[0]
    try:
        a = cache.acquire(L, [0])                       # miss
        assert (a.hits, a.prefetch_hits, a.misses) == (0, 0, 1) and a.stall_s > 0
        cache.release(a)
        a = cache.acquire(L, [0])                       # hit
        assert (a.hits, a.prefetch_hits, a.misses, a.stall_s) == (1, 0, 0, 0.0)
        cache.release(a)
        assert cache.prefetch(L, [0, 1]) == 1           # 0 resident: only 1 queued
        wait_idle(cache)
        assert cache.prefetch(L, [1]) == 0              # resident now: no-op
        a = cache.acquire(L, [1, 0])                    # prefetch hit + hit
        assert (a.hits, a.prefetch_hits, a.misses) == (1, 1, 0)
        truth.check(cache, a)
        cache.release(a)
        a = cache.acquire(L, [1])                       # second use of prefetched: plain hit
        assert (a.hits, a.prefetch_hits, a.misses) == (1, 0, 0)
        cache.release(a)
        assert cache.prefetch(L, [2]) == 1              # evicts the coldest (0)
        wait_idle(cache)
        a = cache.acquire(L, [0])                       # miss: evicts unused prefetch 2 (cold end)
        assert (a.hits, a.prefetch_hits, a.misses) == (0, 0, 1)
        truth.check(cache, a)
        cache.release(a)
        s = cache.stats()
        assert (s["hits"], s["demand_misses"], s["prefetch_hits"]) == (3, 2, 1)
        assert (s["prefetches"], s["wasted_prefetches"]) == (2, 1)
        assert s["reads"] == 4 and s["evictions"] == 2
        assert s["bytes_read"] == 4 * idx.size_classes[0].slot_bytes
        assert s["layers"][str(L)] == {"hits": 3, "demand_misses": 2, "prefetch_hits": 1, "reads": 4,
                                       "substitutions": 0}
        assert s["classes"][0]["hits"] == 3 and s["classes"][0]["slots"] == 2
        assert s["read_latency"]["count"] == 4 and s["read_latency"]["p50_us"] > 0
        # one measurement (the reader pool's), two views: the cache's summary, the pool's histogram
        rd = s["readers"]
        assert s["read_latency"]["count"] == rd["jobs"] == sum(rd["latency_hist"]) == 4
        assert rd["p50_s"] * 1e6 == pytest.approx(s["read_latency"]["p50_us"])
        assert rd["p99_s"] * 1e6 == pytest.approx(s["read_latency"]["p99_us"])
        assert s["pinned"] == 0 and s["reads_in_flight"] == 0
    finally:
        cache.close()
        truth.close()


def test_prefetched_unused_enters_cold_end(models):
    """A wrong prediction evicts neither of two hot demanded experts; it is the first victim."""
    idx = open_index(models("olmoe"))
    layer = idx.expert_layers[0]
    cache = new_cache(idx, slots=8 * len(idx.expert_layers), policy="per-layer")  # 8 per layer
    try:
        per = cache.arena.classes[idx.layer_class[layer]].n_slots // len(
            cache.arena.classes[idx.layer_class[layer]].layers)
        assert per >= 3
        hot = list(range(per - 1))
        cache.release(cache.acquire(layer, hot))                  # fill all but one slot
        cache.release(cache.acquire(layer, [per - 1]))            # now full, all demanded
        assert cache.prefetch(layer, [per]) == 1                  # evicts LRU demanded (expert 0)
        wait_idle(cache)
        a = cache.acquire(layer, [per + 1])                       # must evict the unused prefetch
        cache.release(a)
        assert cache.stats()["wasted_prefetches"] == 1
        a = cache.acquire(layer, hot[1:] + [per - 1])             # all still resident
        assert a.misses == 0
        cache.release(a)
        a = cache.acquire(layer, [per])                           # the prefetch was evicted
        assert a.misses == 1
        cache.release(a)
    finally:
        cache.close()


def test_in_flight_prefetch_is_promoted_and_shared(models):
    idx = open_index(models("mixtral-legacy"))   # ~100 MB experts: reads take a while
    truth = FileTruth(idx)
    cache = new_cache(idx, slots=2, readers=1, chunk_bytes=64 * 1024)
    L = idx.expert_layers[0]
    try:
        assert cache.prefetch(L, [0, 1]) == 2
        res = []
        t = [threading.Thread(target=lambda: res.append(cache.acquire(L, [1], timeout=30)))
             for _ in range(3)]
        for th in t:
            th.start()
        for th in t:
            th.join()
        wait_idle(cache)
        s = cache.stats()
        assert s["reads"] == 2                      # one read per expert for all requesters
        assert sorted((l.prefetch_hits, l.misses) for l in res) == [(0, 1), (0, 1), (1, 0)]
        for lease in res:
            truth.check(cache, lease)
            cache.release(lease)
        assert cache.pinned_count() == 0
    finally:
        cache.close()
        truth.close()


# ---------------------------------------------------------------- waiting, async, cancel
def test_wait_for_slots_then_granted_fifo(models):
    idx = open_index(models("mixtral-legacy"))
    truth = FileTruth(idx)
    cache = new_cache(idx, slots=2)
    L = idx.expert_layers[0]
    try:
        held = cache.acquire(L, [0, 1])            # every slot pinned
        order = []
        ev = threading.Event()
        t1 = cache.acquire_async([(L, [2])], lambda r: (order.append(("a", r)), ev.set()))
        t2 = cache.acquire_async([(L, [0, 2])], lambda r: order.append(("b", r)))
        assert cache.stats()["waiting"] == 2 and t2 > t1
        assert cache.pinned_count() == 2           # waiters hold no pins
        cache.release(held)
        assert ev.wait(30)
        lease_a = order[0][1]
        assert order[0][0] == "a" and isinstance(lease_a, Lease) and lease_a.id == t1
        truth.check(cache, lease_a)
        time.sleep(0.05)
        cache.release(lease_a)
        t0 = time.monotonic()
        while len(order) < 2:
            assert time.monotonic() - t0 < 30
            time.sleep(0.005)
        lease_b = order[1][1]
        assert isinstance(lease_b, Lease)
        truth.check(cache, lease_b)
        cache.release(lease_b)
        assert cache.pinned_count() == 0 and cache.stats()["waiting"] == 0
    finally:
        cache.close()
        truth.close()


def test_async_inline_when_resident_and_cancel(models):
    idx = open_index(models("mixtral-legacy"))
    cache = new_cache(idx, slots=2)
    L = idx.expert_layers[0]
    try:
        cache.release(cache.acquire(L, [0, 1]))
        got = []
        tid = cache.acquire_async([(L, [1, 0])], got.append)
        assert len(got) == 1 and got[0].id == tid and got[0].hits == 2   # called inline
        assert not cache.cancel(tid)                                      # already completed
        cache.release(got[0])
        # queued acquire cancelled: callback never called, no pins
        held = cache.acquire(L, [0, 1])
        calls = []
        tid = cache.acquire_async([(L, [2])], calls.append)
        assert cache.cancel(tid) and not cache.cancel(tid)
        cache.release(held)
        time.sleep(0.05)
        assert calls == [] and cache.pinned_count() == 0
        # cancel while its read is in flight: read goes on as an unused prefetch
        tid = cache.acquire_async([(L, [2])], calls.append)
        assert cache.cancel(tid)
        wait_idle(cache)
        assert calls == [] and cache.pinned_count() == 0
        a = cache.acquire(L, [2])
        assert a.prefetch_hits == 1 and a.misses == 0
        cache.release(a)
    finally:
        cache.close()


def test_acquire_timeout_holds_nothing(models):
    idx = open_index(models("mixtral-legacy"))
    cache = new_cache(idx, slots=2)
    L = idx.expert_layers[0]
    try:
        held = cache.acquire(L, [0, 1])
        t = time.monotonic()
        with pytest.raises(AcquireTimeout):
            cache.acquire(L, [2], timeout=0.2)
        assert 0.15 < time.monotonic() - t < 5
        assert cache.stats()["waiting"] == 0 and cache.pinned_count() == 2
        cache.release(held)
        assert cache.pinned_count() == 0
    finally:
        cache.close()


def test_close_fails_waiters(models):
    idx = open_index(models("mixtral-legacy"))
    cache = new_cache(idx, slots=2)
    L = idx.expert_layers[0]
    cache.acquire(L, [0, 1])
    res = []
    th = threading.Thread(target=lambda: res.append(pytest.raises(CacheError, cache.acquire, L, [2])))
    th.start()
    t = time.monotonic()
    while cache.stats()["waiting"] == 0:
        assert time.monotonic() - t < 10
        time.sleep(0.005)
    cache.close()
    th.join(10)
    assert not th.is_alive()
    assert "cache closed" in str(res[0].value) and isinstance(res[0].value, CacheClosed)
    with pytest.raises(CacheClosed, match="closed"):
        cache.acquire(L, [0])


# ---------------------------------------------------------------- load failures
def test_truncated_file_mid_run(models, tmp_path):
    """Truncate the model under a running cache: acquires of lost experts fail with LoadError
    naming file and expert; the slot is freed; resident experts keep serving. Loads from the
    changed file's intact region fail too: a file whose size/mtime differ from what was indexed
    may have been rewritten, and bytes served must equal the indexed model's bytes."""
    src = models("qwen3")
    path = str(tmp_path / "model.gguf")
    shutil.copy(src, path)
    idx = open_index(path)
    truth = FileTruth(idx)
    cache = new_cache(idx, slots=len(idx.expert_layers) * 4)
    try:
        first, last = idx.expert_layers[0], idx.expert_layers[-1]
        a = cache.acquire(first, [0, 1])
        truth.check(cache, a)
        truth.get(first, 2)
        # cut the file inside the last layer's last expert
        spans = sorted((sp.offset, sp.nbytes) for e in range(idx.n_experts) for sp in idx.parts(last, e))
        cut = max(o + n for o, n in spans) - 4096 * 3
        os.truncate(path, cut)
        lost = [e for e in range(idx.n_experts)
                if any(sp.offset + sp.nbytes > cut for sp in idx.parts(last, e))]
        assert lost
        with pytest.raises(LoadError, match=rf"layer {last} expert {lost[0]} from .*model.gguf"):
            cache.acquire(last, [lost[0]], timeout=30)
        # the failed slot is free again, nothing pinned by the failure
        assert cache.pinned_count() == 2
        s = cache.stats()
        # a changed model is not a failing disk: no read error counted
        assert s["read_errors"] == 0 and s["reads_in_flight"] == 0
        assert "size changed" in s["model_changed"]
        # resident lease intact; a new load from the (intact-looking) region of the changed
        # file is refused rather than trusted
        truth.check(cache, a)
        with pytest.raises(LoadError, match=r"since it was indexed"):
            cache.acquire(first, [2], timeout=30)
        # a mixed request fails as a whole and leaves no pin behind
        with pytest.raises(LoadError):
            cache.acquire_many([(first, [3]), (last, [lost[0]])], timeout=30)
        wait_idle(cache)
        assert cache.pinned_count() == 2
        truth.check(cache, a)   # still the right bytes
        b = cache.acquire(first, [0], timeout=30)  # a hit on a resident expert still works
        truth.check(cache, b)
        cache.release(a)
        cache.release(b)
        assert cache.pinned_count() == 0
    finally:
        cache.close()
        truth.close()


# ---------------------------------------------------------------- budget
def test_set_budget_shrink_with_pinned_then_grow(models):
    idx = open_index(models("qwen3"))
    truth = FileTruth(idx)
    n_total = len(idx.expert_layers) * idx.n_experts
    cache = new_cache(idx, slots=n_total)           # everything fits
    try:
        layer = idx.expert_layers[0]
        cid = idx.layer_class[layer]
        pinned = cache.acquire(layer, [0, 1, 2, 3])
        for l in idx.expert_layers:                 # fill the cache
            cache.release(cache.acquire(l, list(range(idx.n_experts // 2))))
            cache.prefetch(l, list(range(idx.n_experts // 2, idx.n_experts)))
        wait_idle(cache)
        max_bytes = cache.stats()["budget"]["configured_bytes"]
        with pytest.raises(CacheError, match="no slot"):
            cache.set_budget(1)                     # every class needs >= 1 slot
        assert cache.stats()["shrink_events"] == 0
        smallest = sum(c.slot_bytes * 2 for c in idx.size_classes) + 64 * 4096
        r = cache.set_budget(smallest)
        assert r["slots_before"] == n_total
        assert r["slots_after"] < r["slots_before"] and r["bytes_released"] > 0
        # pinned class keeps >= its 4 pinned slots, and their bytes are untouched
        s = cache.stats()
        ccls = [c for c in s["classes"] if c["id"] == cid][0]
        assert ccls["slots"] >= 4 and ccls["pinned"] == 4
        assert r["slots_after"] > r["slots_target"]          # stopped short at the pins
        truth.check(cache, pinned)
        assert s["shrink_events"] == 1 and s["budget"]["current_bytes"] < max_bytes
        # cache still works at the small size, bit-exact (the pinned class is full of pins:
        # an acquire there would wait; use the other class)
        other = [l for l in idx.expert_layers if idx.layer_class[l] != cid][0]
        a = cache.acquire(other, [5], timeout=30)
        truth.check(cache, a)
        cache.release(a)
        cache.release(pinned)
        r3 = cache.set_budget(smallest)             # unpinned now: shrinks all the way
        assert r3["slots_after"] == r3["slots_target"] < r["slots_after"]
        r2 = cache.set_budget(max_bytes * 2)        # clamp to configured max
        assert r2["slots_after"] == n_total and r2["bytes_restored"] > 0
        assert cache.stats()["grow_events"] == 1
        random_sequence(cache, idx, truth, random.Random(3), steps=40)
    finally:
        cache.close()
        truth.close()


def test_a_shrink_pins_stopped_short_finishes_once_they_go(models):
    """A budget shrink that meets pinned experts stops short; once they are released the
    periodic ``settle_memory`` finishes it (to the target, memory given back), without counting
    another shrink."""
    idx = open_index(models("qwen3"))
    n_total = len(idx.expert_layers) * idx.n_experts
    cache = new_cache(idx, slots=n_total)
    try:
        for l in idx.expert_layers:
            cache.release(cache.acquire(l, list(range(idx.n_experts))))
        held = [cache.acquire(l, list(range(idx.n_experts))) for l in idx.expert_layers]
        smallest = sum(c.slot_bytes * 2 for c in idx.size_classes) + 64 * 4096
        r = cache.set_budget(smallest)
        assert r["slots_after"] == r["slots_before"] > r["slots_target"]   # every slot pinned
        assert cache.settle_memory()["bytes_released"] == 0   # still pinned: nothing to do
        for lease in held:
            cache.release(lease)
        got = cache.settle_memory()
        s = cache.stats()
        assert sum(c["slots"] for c in s["classes"]) == r["slots_target"]
        assert got["bytes_released"] > 0 and s["shrink_events"] == 1
        assert cache.settle_memory()["bytes_released"] == 0   # done: nothing more
        cache.release(cache.acquire(idx.expert_layers[0], [0]))   # still serving
    finally:
        cache.close()


def test_pages_a_reader_faults_back_into_given_back_slots_are_punched_again(models):
    """A client's read-only mapping that reads a given-back slot's hole makes tmpfs allocate a
    page there: the shrink's memory comes back. ``settle_memory`` finds the file holding more
    than its resident slots need (st_blocks), punches the given-back slots again and counts
    the bytes in ``repunched_bytes``."""
    import mmap
    idx = open_index(models("qwen3"))
    n_total = len(idx.expert_layers) * idx.n_experts
    cache = new_cache(idx, slots=n_total)
    try:
        smallest = sum(c.slot_bytes * 2 for c in idx.size_classes) + 64 * 4096
        assert cache.set_budget(smallest)["bytes_released"] > 0
        path = cache.arena.path
        shrunk = os.stat(path).st_blocks * 512
        assert cache.settle_memory()["bytes_repunched"] == 0   # nothing faulted in yet
        fd = os.open(path, os.O_RDONLY)
        try:
            m = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)   # as a client maps it
            total = sum(m[off] for off in range(0, len(m), mmap.PAGESIZE))   # reads every page
            assert total == 0 or total > 0
            faulted = os.stat(path).st_blocks * 512
            assert faulted > shrunk, "reading the holes allocated nothing (not a tmpfs?)"
            got = cache.settle_memory()
            assert os.stat(path).st_blocks * 512 <= shrunk
            assert got["bytes_repunched"] == faulted - os.stat(path).st_blocks * 512
            assert cache.stats()["repunched_bytes"] == got["bytes_repunched"]
            m.close()
        finally:
            os.close(fd)
        truth = FileTruth(idx)
        for l in idx.expert_layers:   # the shrunk cache serves right bytes as before
            lease = cache.acquire(l, [1])
            truth.check(cache, lease)
            cache.release(lease)
        truth.close()
    finally:
        cache.close()


def test_a_shrink_counts_its_own_punch_in_repunched_bytes_never(models):
    """A shrink punches every given-back slot (its own and earlier ones, pages they share
    too): that is the shrink's memory, not counted in ``repunched_bytes``, even where a reader
    had faulted earlier holes in. The periodic punch after it counts what a reader brings back."""
    import mmap
    idx = open_index(models("qwen3"))
    n_total = len(idx.expert_layers) * idx.n_experts
    cache = new_cache(idx, slots=n_total)
    try:
        budget = cache.stats()["budget"]["current_bytes"]
        smallest = sum(c.slot_bytes * 2 for c in idx.size_classes) + 64 * 4096
        assert cache.set_budget((budget + smallest) // 2)["bytes_released"] > 0
        path = cache.arena.path
        fd = os.open(path, os.O_RDONLY)
        try:
            m = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
            read_all = lambda: sum(m[off] for off in range(0, len(m), mmap.PAGESIZE))
            before = os.stat(path).st_blocks
            read_all()
            assert os.stat(path).st_blocks > before, "reading the holes allocated nothing (not a tmpfs?)"
            assert cache.set_budget(smallest)["bytes_released"] > 0
            shrunk = os.stat(path).st_blocks
            assert cache.stats()["repunched_bytes"] == 0, "the shrink's punch counted as punched again"
            read_all()
            assert cache.settle_memory()["bytes_repunched"] > 0
            assert os.stat(path).st_blocks <= shrunk
            assert cache.stats()["repunched_bytes"] > 0
            m.close()
        finally:
            os.close(fd)
    finally:
        cache.close()


def test_the_punched_again_warning_is_one_line_a_minute_per_model_with_the_total():
    """A reader that keeps reading holes makes the daemon punch again every tick; the warning
    says so once a minute per model, with the bytes punched again since the last line."""
    import logging
    from types import SimpleNamespace

    from moecached.daemon import settle as S
    caches = [SimpleNamespace(c_repunched=0, arena=SimpleNamespace(path=f"/dev/shm/arena-{i}"),
                              settle_memory=lambda: {"bytes_released": 0, "bytes_repunched": 0})
              for i in range(2)]
    ms = [SimpleNamespace(name=f"m{i}", cache=c) for i, c in enumerate(caches)]
    reported, got = {}, []
    h = logging.Handler()
    h.emit = lambda r: got.append(r.getMessage()) if r.levelno == logging.WARNING else None
    S.log.addHandler(h)
    try:
        for tick in range(180):              # three minutes, a tick a second, 1 MiB a tick
            for c in caches:
                c.c_repunched += 1 << 20
            for m in ms:
                S.settle(m, reported, now=1000.0 + tick)
    finally:
        S.log.removeHandler(h)
    assert len(got) == 6, got                # per model: ticks 0, 60, 120
    assert sum("model m0:" in g for g in got) == 3
    assert "1.0 MiB punched again" in got[0] and "60.0 MiB punched again" in got[2], got
    assert all("since the last warning" in g for g in got)


def test_shrunk_policy_error_and_wait(models):
    idx = open_index(models("mixtral-legacy"))
    L = idx.expert_layers[0]
    slot_bytes = idx.size_classes[0].slot_bytes
    for policy in ("error", "wait"):
        cache = new_cache(idx, slots=2, shrunk_policy=policy)
        try:
            r = cache.set_budget(slot_bytes + 8192)
            assert r["slots_after"] == 1
            if policy == "error":
                with pytest.raises(CapacityError, match="holds 1 now"):
                    cache.acquire(L, [0, 1])
            else:
                got = []
                cache.acquire_async([(L, [0, 1])], got.append)
                time.sleep(0.05)
                assert got == [] and cache.stats()["waiting"] == 1
                cache.set_budget(10 * slot_bytes)
                t = time.monotonic()
                while not got:
                    assert time.monotonic() - t < 30
                    time.sleep(0.005)
                assert isinstance(got[0], Lease)
                cache.release(got[0])
        finally:
            cache.close()


def test_descriptor_and_stats_shape(models):
    idx = open_index(models("dsv2lite"))
    cache = new_cache(idx, slots=6)
    try:
        d = cache.descriptor()
        assert d["fingerprint"] == idx.fingerprint()
        assert d["path"] == cache.arena.path and d["n_experts"] == idx.n_experts
        assert len(d["size_classes"]) == len(idx.size_classes) >= 2
        s = cache.stats()
        assert set(s["layers"]) == {str(x) for x in idx.expert_layers}  # string keys: protocol maps
        for k in ("hits", "demand_misses", "prefetch_hits", "prefetches", "wasted_prefetches",
                  "bytes_read", "reads", "reads_in_flight", "read_latency", "classes", "budget",
                  "shrink_events", "grow_events", "readers"):
            assert k in s
    finally:
        cache.close()


def test_arena_errors_propagate_and_leave_nothing(models):
    """A budget too small for one slot per class: ArenaError from the constructor, no arena file
    left behind (RLIMIT_MEMLOCK and /dev/shm-size refusals are the arena's tests)."""
    from moecached.engine.arena import ArenaError
    idx = open_index(models("qwen3"))
    name = f"moecache-test-{os.getpid()}-tiny"
    with pytest.raises(ArenaError, match="no slot"):
        ExpertCache(idx, budget_bytes=4096, readers=1, lock_memory=False, arena_name=name)
    assert not os.path.exists(os.path.join("/dev/shm", name))
    with pytest.raises(CacheError, match="policy"):
        ExpertCache(idx, slots=8, policy="lfu", readers=1, lock_memory=False, arena_name=name)
    assert not os.path.exists(os.path.join("/dev/shm", name))


def test_prefetch_admission_drops_beyond_limit(model_factory):
    """Prefetches beyond max_prefetch_loads in flight are dropped and counted; demand is not."""
    from moecached.engine.cache import ExpertCache
    from moecached.engine.index import open_index
    idx = open_index(model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=16))
    cache = ExpertCache(idx, slots=64, lock_memory=False, readers=1, chunk_bytes=4096,
                        max_prefetch_loads=3)
    try:
        L = idx.expert_layers
        queued = cache.prefetch_many([(L[0], list(range(8))), (L[1], list(range(8)))])
        st = cache.stats()
        assert queued == 3 and st["prefetches"] == 3
        assert st["prefetches_dropped"] == 13
        assert st["prefetch_loads_in_flight"] <= 3
        lease = cache.acquire(L[2], list(range(8)), timeout=60)  # demand is never refused
        cache.release(lease)
        deadline = time.time() + 60
        while cache.stats()["prefetch_loads_in_flight"] and time.time() < deadline:
            time.sleep(0.05)
        assert cache.stats()["prefetch_loads_in_flight"] == 0
        assert cache.prefetch(L[3], [0, 1]) == 2  # room again
    finally:
        cache.close()


def test_acquire_resident_hit_path_counts_like_the_general_path(models):
    """The Cython hit path (acquire_resident) grants exactly what acquire_async would, with the
    same counters, and declines (changing nothing) whatever the general path must handle."""
    idx = open_index(models("qwen3"))
    L0, L1 = idx.expert_layers[:2]
    truth = FileTruth(idx)
    with new_cache(idx, slots=12) as a, new_cache(idx, slots=12) as b:
        for c in (a, b):
            c.release(c.acquire(L0, [0, 1, 2]))
            c.prefetch(L1, [5])
            wait_idle(c)
        s_before = a.stats()
        assert a.acquire_resident(L0, [0, 7]) is None          # 7 absent
        assert a.acquire_resident(L0, [0, 0]) is None          # repeat
        assert a.acquire_resident(L0, [0, 99]) is None         # out of range
        assert a.acquire_resident(999, [0]) is None            # not a MoE layer
        assert a.acquire_resident(L0, []) is None
        assert a.stats() == s_before and a.pinned_count() == 0
        la = a.acquire_resident(L1, [5])
        lb = []
        b.acquire_async([(L1, [5])], lb.append)
        lb = lb[0]
        assert (la.hits, la.prefetch_hits, la.misses) == (lb.hits, lb.prefetch_hits, lb.misses) == (0, 1, 0)
        la2 = a.acquire_resident(L0, [2, 0])
        lb2 = []
        b.acquire_async([(L0, [2, 0])], lb2.append)
        lb2 = lb2[0]
        assert [it[:3] for it in la2.items] == [it[:3] for it in lb2.items]
        assert (la2.hits, la2.stall_s) == (lb2.hits, 0.0) == (2, 0.0)
        truth.check(a, la2)
        sa, sb = a.stats(), b.stats()
        for key in ("hits", "prefetch_hits", "demand_misses", "leases_open"):
            assert sa[key] == sb[key], key
        assert a.pinned_count() == 3
        for lease in (la, la2):
            a.release(lease)
        with pytest.raises(LeaseError):
            a.release(la2)
        assert a.pinned_count() == 0
    truth.close()


@pytest.mark.parametrize("admit,tag,width,cold", [("off", "prompt", 2, False),
                                                  ("prompt", "prompt", 2, True),
                                                  ("prompt", "decode", 2, False),
                                                  ("prompt", None, 2, False),
                                                  (1, None, 2, True), (2, None, 2, False)])
def test_admit_cold_loads_misses_at_the_cold_end(models, admit, tag, width, cold):
    """admit_cold: the misses of a prompt-tagged acquire (or one naming more than N experts of
    a layer) enter the LRU at the cold end; a resident expert used later stays hotter."""
    idx = open_index(models("mixtral-legacy"))
    L = idx.expert_layers[0]
    cache = new_cache(idx, slots=8, admit_cold=admit)
    try:
        cache.release(cache.acquire(L, [2]))                  # resident, hot end, plain admission
        done = []
        cache.acquire_async([(L, list(range(width)))], done.append, tag=tag)
        t = time.monotonic()
        while not done:
            assert time.monotonic() - t < 30
            time.sleep(0.002)
        cache.release(done[0])
        wait_idle(cache)
        base = cache._layers[L].base
        order = [k - base for k in cache._layers[L].pool.lru.keys()]   # hot -> cold
        assert set(order) == {2} | set(range(width))
        if cold:
            assert order[0] == 2
        else:
            assert order[-1] == 2
    finally:
        cache.close()
