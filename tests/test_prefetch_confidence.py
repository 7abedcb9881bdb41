"""Prefetch confidence: prefetch_min_confidence, confidence order under the prefetch caps
(lower-confidence queued reads withdrawn for higher ones), and prefetches never evicting a
demand-hot expert (docs/policies.md, "Prefetch confidence")."""
from __future__ import annotations

import contextlib

import pytest

from moecached.engine.cache import PrefetchQuota, RequestError
from moecached.engine.index import open_index
from moecached.facts.protocol import ProtocolError, RequestChecker

from test_cache import FileTruth, new_cache, wait_idle


@contextlib.contextmanager
def prefetch_reads_held(cache):
    """No prefetch chunk is handed to a reader while inside: prefetch reads stay queued (not
    started), as behind a busy drive. Demand reads go on."""
    rp = cache.readers.queue
    with rp._cond:
        saved = rp._pf_max, rp._pf_with_demand
        rp._pf_max = rp._pf_with_demand = 0
    try:
        yield
    finally:
        with rp._cond:
            rp._pf_max, rp._pf_with_demand = saved
            rp._cond.notify_all()


def reads(cache, layer):
    return cache.stats()["layers"][str(layer)]["reads"]


@pytest.fixture(scope="module")
def idx(tmp_path_factory):
    from fixtures import make_model
    return open_index(make_model(tmp_path_factory.mktemp("pfconf"), "qwen3-30b-a3b-Q4_K_M",
                                 layers=4, experts=16))


def test_min_confidence_drops_outright(idx):
    L = idx.expert_layers
    with new_cache(idx, slots=64, prefetch_min_confidence=0.5) as cache:
        assert cache.prefetch(L[0], [0, 1, 2], conf=[0.4, 0.5, 0.9]) == 2
        assert cache.prefetch(L[1], [0]) == 1            # no conf: confidence 1
        st = cache.stats()
        assert st["prefetches_dropped_low_confidence"] == 1 and st["prefetches"] == 3
        assert st["prefetches_dropped"] == 0
        cache.prefetch_min_confidence = 0.0              # what a reload sets
        assert cache.prefetch(L[0], [0], conf=[0.4]) == 1


def test_bad_confidence_is_refused_before_anything_is_queued(idx):
    L = idx.expert_layers
    with new_cache(idx, slots=64) as cache:
        for conf, text in [([0.5], "1 values for 2 experts"), ([0.5, 1.5], "expected 0..1"),
                           ([0.5, float("nan")], "expected 0..1")]:
            with pytest.raises(RequestError, match=text.replace(".", r"\.")):
                cache.prefetch(L[0], [0, 1], conf=conf)
        with pytest.raises(RequestError, match="one per layer"):
            cache.prefetch_many([(L[0], [0]), (L[1], [0])], conf=[[1.0]])
        assert cache.stats()["prefetches"] == 0


def test_checker_conf_field_errors_name_the_field():
    ck = RequestChecker([0, 1, 2], 8)
    reqs = ck.requests({"layers": [[0, [1, 2]], [1, [3]]]})
    assert ck.confidence({"layers": [[0, [1, 2]], [1, [3]]], "conf": [[0.5, 1], [0]]}, reqs) == [[0.5, 1.0], [0.0]]
    assert ck.confidence({"layers": [[0, [1, 2]], [1, [3]]]}, reqs) is None
    one = ck.requests({"layer": 0, "experts": [1, 2]})
    assert ck.confidence({"layer": 0, "experts": [1, 2], "conf": [0.25, 0.75]}, one) == [[0.25, 0.75]]
    for msg, reqs_, text in [({"conf": [[0.5]]}, reqs, "'conf' must be"),
                             ({"conf": [[0.5], [0.1]]}, reqs, "'conf[0]' has 1 values for 2"),
                             ({"conf": [[0.5, 2], [0.1]]}, reqs, "'conf[0]' holds 2"),
                             ({"conf": [[0.5, True], [0.1]]}, reqs, "holds True"),
                             ({"conf": 0.5}, reqs, "'conf' must be")]:
        msg = dict(msg, layers=[[0, [1, 2]], [1, [3]]])
        with pytest.raises(ProtocolError) as ei:
            ck.confidence(msg, reqs_)
        assert text in str(ei.value) and "\n" not in str(ei.value), str(ei.value)
    with pytest.raises(ProtocolError, match="'conf' has 1 values for 2"):
        ck.confidence({"layer": 0, "experts": [1, 2], "conf": [0.5]}, one)


def test_three_future_layers_fill_in_confidence_order_under_the_cap(idx):
    """A prefetch naming three future layers with confidences queues, under
    max_prefetch_loads = 3, the three most confident experts, whatever their layer order."""
    L = idx.expert_layers
    with new_cache(idx, slots=64, max_prefetch_loads=3) as cache:
        with prefetch_reads_held(cache):
            n = cache.prefetch_many([(L[1], [0, 1]), (L[2], [0, 1]), (L[3], [0, 1])],
                                    conf=[[0.3, 0.2], [0.9, 0.5], [0.8, 0.1]])
            assert n == 3
            assert [reads(cache, l) for l in L[1:]] == [0, 2, 1]
            assert cache.stats()["prefetches_dropped"] == 3
        wait_idle(cache)
        # the queued ones arrived: their first demand is a prefetch hit, the others miss
        a = cache.acquire_many([(L[2], [0, 1]), (L[3], [0])])
        assert (a.prefetch_hits, a.misses) == (3, 0)
        cache.release(a)
        a = cache.acquire(L[1], [0])
        assert a.misses == 1
        cache.release(a)


def test_lower_confidence_queued_reads_give_way(idx):
    """At the cap, a queued (not started) read of lower confidence is withdrawn for a new one;
    a new one of lower or equal confidence is dropped; the withdrawn read's slot is given back
    (the bytes of every expert stay exact)."""
    L = idx.expert_layers
    truth = FileTruth(idx)
    with new_cache(idx, slots=64, max_prefetch_loads=2) as cache:
        with prefetch_reads_held(cache):
            assert cache.prefetch(L[0], [0, 1], conf=[0.2, 0.3]) == 2
            free0 = sum(len(p.free) for p in cache._pools)
            assert cache.prefetch(L[1], [5], conf=[0.9]) == 1     # withdraws L0/0 (0.2)
            assert cache.prefetch(L[1], [6], conf=[0.3]) == 0     # equal to the lowest: dropped
            assert cache.prefetch(L[1], [7], conf=[0.1]) == 0     # lower: dropped
            st = cache.stats()
            assert st["prefetches_displaced"] == 1 and st["prefetches_dropped"] == 2
            assert st["prefetch_loads_in_flight"] == 2
            assert sum(len(p.free) for p in cache._pools) == free0   # one given back, one taken
            assert cache.readers.stats()["queued_prefetch"] == 2
        wait_idle(cache)
        a = cache.acquire_many([(L[0], [1]), (L[1], [5])])
        assert (a.prefetch_hits, a.misses) == (2, 0)
        truth.check(cache, a)
        cache.release(a)
        a = cache.acquire_many([(L[0], [0]), (L[1], [6, 7])])
        assert (a.prefetch_hits, a.misses) == (0, 3)
        truth.check(cache, a)
        cache.release(a)
        st = cache.stats()
        assert st["prefetch_loads_in_flight"] == 0 and st["pinned"] == 0
    truth.close()


def test_per_client_cap_withdraws_only_the_senders_own(idx):
    L = idx.expert_layers
    with new_cache(idx, slots=64, max_prefetch_loads=10) as cache:
        a, b = PrefetchQuota(1), PrefetchQuota(1)
        with prefetch_reads_held(cache):
            assert cache.prefetch_many([(L[0], [0])], a, conf=[[0.1]]) == 1
            assert cache.prefetch_many([(L[0], [1])], b, conf=[[0.5]]) == 1
            assert cache.prefetch_many([(L[0], [2])], b, conf=[[0.9]]) == 1   # b's own 0.5 goes
            assert (a.in_flight, b.in_flight) == (1, 1)
            assert cache.stats()["prefetches_displaced"] == 1
        wait_idle(cache)
        assert cache.acquire(L[0], [0, 2]).prefetch_hits == 2


def test_displaced_read_that_evicted_gives_the_expert_back(idx):
    """A withdrawn prefetch read had evicted a resident expert for its slot: that expert is
    resident again (a hit, bytes exact), not lost."""
    L = idx.expert_layers
    truth = FileTruth(idx)
    with new_cache(idx, slots=4 * len(idx.expert_layers), policy="per-layer",
                   max_prefetch_loads=1) as cache:
        per = cache._layers[L[0]].pool.cap
        cache.release(cache.acquire(L[0], list(range(per))))         # full, all demanded
        with prefetch_reads_held(cache):
            assert cache.prefetch(L[0], [per], conf=[0.2]) == 1       # evicts expert 0 (coldest)
            assert cache.stats()["evictions"] == 1
            assert cache.prefetch(L[1], [0], conf=[0.7]) == 1         # withdraws it: 0 is back
            assert cache.stats()["evictions"] == 0
        wait_idle(cache)
        a = cache.acquire(L[0], list(range(per)))
        assert (a.hits, a.misses) == (per, 0)
        truth.check(cache, a)
        cache.release(a)
    truth.close()


def test_prefetch_never_evicts_a_demand_hot_expert(idx):
    """With the colder half of a full pool pinned by leases, the next victim is demand-hot: a
    prefetch is dropped (counted) instead of evicting it; once the pins go it evicts the
    coldest, and demand misses still evict as before."""
    L = idx.expert_layers
    with new_cache(idx, slots=8 * len(idx.expert_layers), policy="per-layer") as cache:
        per = cache._layers[L[0]].pool.cap
        assert per >= 4
        cache.release(cache.acquire(L[0], list(range(per))))         # 0 coldest .. per-1 hottest
        held = cache.acquire(L[0], list(range(per // 2)))            # pins the colder half
        # (the acquire touched them: they are the hottest now; touch the rest back on top)
        cache.release(cache.acquire(L[0], list(range(per // 2, per))))
        assert cache.prefetch(L[0], [per, per + 1]) == 0
        st = cache.stats()
        assert st["prefetches_dropped_hot"] == 2 and st["evictions"] == 0
        a = cache.acquire(L[0], [per])                               # demand still evicts
        assert a.misses == 1 and cache.stats()["evictions"] == 1
        cache.release(a)
        cache.release(held)
        assert cache.prefetch(L[0], [per + 1]) == 1                  # the coldest goes now
        wait_idle(cache)


def test_unused_prefetched_expert_is_evictable_even_when_recent(idx):
    """Only demand use makes an expert hot: a prefetched expert nobody used yet is a victim a
    prefetch may take even in the hotter half of the recency order (here: prompt misses
    admitted at the cold end below it)."""
    import threading
    L = idx.expert_layers
    with new_cache(idx, slots=4 * len(idx.expert_layers), policy="per-layer",
                   admit_cold="prompt") as cache:
        per = cache._layers[L[0]].pool.cap
        assert per >= 3
        assert cache.prefetch(L[0], [per]) == 1
        wait_idle(cache)
        box, ev = [], threading.Event()
        cache.acquire_async([(L[0], list(range(per - 1)))], lambda r: (box.append(r), ev.set()),
                            tag="prompt")                           # enter below the prefetched one
        assert ev.wait(60) and not isinstance(box[0], Exception)
        held = box[0]                                               # every demanded one pinned
        assert cache._layers[L[0]].pool.lru.cold_rank(cache._layers[L[0]].base + per, per) == per - 1
        assert cache.prefetch(L[0], [per + 1]) == 1                  # evicts the unused one
        wait_idle(cache)
        st = cache.stats()
        assert st["wasted_prefetches"] == 1 and st["prefetches_dropped_hot"] == 0
        cache.release(held)


def test_displacement_under_concurrent_demand_keeps_bytes_and_counts(idx):
    """Threads acquiring (bytes checked) while others prefetch with random confidences under a
    cap of 2 loads: withdrawals race reads landing and demand taking reads over; afterwards
    nothing is left in flight or pinned and every expert still reads exact."""
    import random
    import threading
    L = idx.expert_layers
    truth = FileTruth(idx)
    errors = []
    with new_cache(idx, slots=24, max_prefetch_loads=2, readers=2, chunk_bytes=16384) as cache:
        def demand(seed):
            rng = random.Random(seed)
            try:
                for _ in range(40):
                    lease = cache.acquire(rng.choice(L), rng.sample(range(idx.n_experts), 2))
                    truth.check(cache, lease)
                    cache.release(lease)
            except Exception as e:   # reported below
                errors.append(e)

        def predict(seed):
            rng = random.Random(seed)
            try:
                for _ in range(150):
                    ls = rng.sample(L, 3)
                    req = [(l, rng.sample(range(idx.n_experts), 2)) for l in ls]
                    cache.prefetch_many(req, conf=[[rng.random() for _ in ex] for _, ex in req])
            except Exception as e:
                errors.append(e)
        def run(seed):
            ts = [threading.Thread(target=demand, args=(seed + i,)) for i in range(2)] + \
                 [threading.Thread(target=predict, args=(seed + 10 + i,)) for i in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(120)
            assert not errors, errors[0]
        with prefetch_reads_held(cache):   # withdrawals race demand taking queued reads over
            run(0)
        assert cache.stats()["prefetches_displaced"] > 0
        run(100)                           # ... and prefetch reads landing
        wait_idle(cache)
        st = cache.stats()
        assert st["prefetch_loads_in_flight"] == 0 and st["pinned"] == 0
        assert cache.readers.stats()["in_flight"] == 0
        for layer in L:
            for e in range(0, idx.n_experts, 4):
                lease = cache.acquire(layer, [e, e + 1, e + 2, e + 3])
                truth.check(cache, lease)
                cache.release(lease)
    truth.close()


def test_checker_says_how_many_ids_a_layer_was_given_against_its_experts():
    """More ids than the layer has experts (an engine of another model's shape): the count and
    the layer's experts, not "repeats an expert id" (they may all differ)."""
    ck = RequestChecker([0, 1], 8)
    with pytest.raises(ProtocolError) as ei:
        ck.requests({"layer": 0, "experts": list(range(14))})
    assert str(ei.value).endswith("field 'experts' of layer 0 names 14 experts: the layer has 8 (expected each "
                                  "at most once)"), str(ei.value)
    with pytest.raises(ProtocolError, match="repeats an expert id"):
        ck.requests({"layer": 0, "experts": [1, 1]})
