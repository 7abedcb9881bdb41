"""ExpertCache under concurrency: threads acquiring, prefetching and releasing along real routing
traces (``../shared/traces/*.npz``), with budget shrink/grow in the background.

Duration: ``MOECACHE_SOAK_S`` seconds (default 10; the issue's full run is 60) with the default
``"global"`` policy, plus a quarter of that with ``"per-layer"``. Checks: every
lease's bytes equal the file's bytes (at acquire and again just before release), no acquire
times out (deadlock), no pin leaks (``pinned_count() == 0`` at the end), counters add up.

Trace mapping onto the small fixture: trace layer ``i`` -> ``index.expert_layers[i % n]``;
expert ``e`` -> ``e % n_experts`` (duplicates after the fold dropped, order kept); -1 skipped.
"""
from __future__ import annotations

import os
import random
import threading
import time

import numpy as np
import pytest

from fixtures import make_model, shared_traces
from moecached.engine.cache import ExpertCache, Lease
from moecached.engine.index import open_index
from test_cache import FileTruth, wait_idle

SOAK_S = float(os.environ.get("MOECACHE_SOAK_S", "10"))
TIMEOUT_S = 60.0  # an acquire this slow means a deadlock


def load_traces(idx):
    """[(name, steps)]: step = [(layer, [experts])] over trace layers i..i+n-1 (n = fixture
    expert layers), so each fixture layer appears at most once per step."""
    traces = shared_traces()
    if not traces:
        pytest.skip("../shared/traces not found (set MOECACHE_SHARED)")
    layers, ne = list(idx.expert_layers), idx.n_experts
    out = []
    for f in traces:
        ex = np.load(f)["experts"]
        toks = []
        for t in range(ex.shape[0]):
            row = []
            for i in range(ex.shape[1]):
                seen = []
                for e in ex[t, i]:
                    if e >= 0 and int(e) % ne not in seen:
                        seen.append(int(e) % ne)
                if seen:
                    row.append((layers[i % len(layers)], seen))
                if (i + 1) % len(layers) == 0 or i + 1 == ex.shape[1]:
                    if row:             # one "token" = one pass over the fixture's layers
                        toks.append(row)
                    row = []
        out.append((f.stem, toks))
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("conc-model"), "qwen3-30b-a3b-Q4_K_M",
                      layers=[0, 6, 8, 9], experts=16)
    idx = open_index(path)
    assert len(idx.size_classes) == 2
    truth = FileTruth(idx)
    for l in idx.expert_layers:          # read the truth once, up front
        for e in range(idx.n_experts):
            truth.get(l, e)
    yield idx, truth, load_traces(idx)
    truth.close()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["global", "per-layer"])
def test_trace_soak(setup, policy):
    idx, truth, traces = setup
    n_total = len(idx.expert_layers) * idx.n_experts
    cache = ExpertCache(idx, slots=n_total * 5 // 8, policy=policy, readers=4, lock_memory=False)
    max_bytes = cache.stats()["budget"]["configured_bytes"]
    # the default policy soaks for the whole SOAK_S, per-layer for a quarter of it
    dur = SOAK_S if policy == "global" else max(2.0, SOAK_S / 4)
    stop = time.monotonic() + dur
    errors = []
    acquired = [0] * 8
    ops = {"acquire": 0, "many": 0, "async": 0, "prefetch": 0, "budget": 0}

    def fail(e):
        errors.append(e)

    def check_release(lease):
        truth.check(cache, lease)
        cache.release(lease)

    def decoder(wid, trace, rng):
        """Layer by layer: prefetch the next layer's experts, acquire this one, verify, release."""
        toks = trace[1]
        t = rng.randrange(len(toks))
        while time.monotonic() < stop and not errors:
            row = toks[t % len(toks)]
            t += 1
            for j, (layer, ex) in enumerate(row):
                if j + 1 < len(row):
                    cache.prefetch(*row[j + 1])
                    ops["prefetch"] += 1
                lease = cache.acquire(layer, ex, timeout=TIMEOUT_S)
                assert [e for _, e, _, _ in lease.items] == ex
                truth.check(cache, lease)
                acquired[wid] += len(ex)
                ops["acquire"] += 1
                check_release(lease)

    def pipeliner(wid, trace, rng):
        """Engine-style: queue a whole token (all layers) at once, async; verify, release."""
        toks = trace[1]
        t = rng.randrange(len(toks))
        while time.monotonic() < stop and not errors:
            row = toks[t % len(toks)]
            t += 1
            ev, box = threading.Event(), []
            tid = cache.acquire_async(row, lambda r: (box.append(r), ev.set()))
            assert ev.wait(TIMEOUT_S), "async acquire never completed"
            lease = box[0]
            assert isinstance(lease, Lease) and lease.id == tid, lease
            truth.check(cache, lease)
            acquired[wid] += len(lease.items)
            ops["async"] += 1
            if rng.random() < 0.2:          # hold it across the next prefetch burst
                cache.prefetch_many(toks[t % len(toks)])
                ops["prefetch"] += 1
            check_release(lease)

    def many(wid, trace, rng):
        """Two layers at a time via acquire_many; sometimes a doomed cancelled async."""
        toks = trace[1]
        t = rng.randrange(len(toks))
        while time.monotonic() < stop and not errors:
            row = toks[t % len(toks)]
            t += 1
            for j in range(0, len(row), 2):
                part = row[j:j + 2]
                lease = cache.acquire_many(part, timeout=TIMEOUT_S)
                truth.check(cache, lease)
                acquired[wid] += len(lease.items)
                ops["many"] += 1
                if rng.random() < 0.1:  # a client that vanishes
                    calls = []
                    tid = cache.acquire_async([part[0]], calls.append)
                    if not cache.cancel(tid):
                        assert len(calls) == 1 and isinstance(calls[0], Lease)
                        check_release(calls[0])
                check_release(lease)

    def budget(rng):
        while time.monotonic() < stop and not errors:
            time.sleep(rng.uniform(0.1, 0.4))
            try:
                cache.set_budget(int(max_bytes * rng.uniform(0.55, 0.8)))
            except Exception as e:  # a shrink that plan_slots refuses is fine, nothing else
                if "no slot" not in str(e):
                    raise
            ops["budget"] += 1
            time.sleep(rng.uniform(0.05, 0.2))
            cache.set_budget(max_bytes)
            ops["budget"] += 1

    def wrap(fn, *a):
        try:
            fn(*a)
        except BaseException as e:  # noqa: BLE001 -- reported below
            fail(e)

    rng = random.Random(1234 + len(policy))
    kinds = [decoder, decoder, pipeliner, many, decoder]
    threads = []
    for wid, fn in enumerate(kinds):
        trace = traces[wid % len(traces)]
        threads.append(threading.Thread(target=wrap, args=(fn, wid, trace, random.Random(rng.random())),
                                        name=f"w{wid}-{fn.__name__}"))
    threads.append(threading.Thread(target=wrap, args=(budget, random.Random(5)), name="budget"))
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(SOAK_S + 3 * TIMEOUT_S)
            assert not th.is_alive(), f"{th.name} hung (deadlock?)"
        if errors:
            raise errors[0]
        cache.set_budget(max_bytes)
        wait_idle(cache, 30)
        assert cache.pinned_count() == 0, "leaked pins"
        s = cache.stats()
        assert s["leases_open"] == 0 and s["waiting"] == 0
        assert s["hits"] + s["prefetch_hits"] + s["demand_misses"] >= sum(acquired)
        assert s["read_errors"] == 0 and s["evictions"] > 0
        assert min(ops["acquire"], ops["many"], ops["async"]) > 0, ops
        print(f"\n[{policy}] {dur:.0f}s ops={ops} experts={sum(acquired)} hits={s['hits']} "
              f"pf_hits={s['prefetch_hits']} misses={s['demand_misses']} reads={s['reads']} "
              f"wasted={s['wasted_prefetches']} queued={s['acquires_queued']} "
              f"shrinks={s['shrink_events']} read_p50_us={s['read_latency']['p50_us']:.0f}")
    finally:
        cache.close()
