"""Replay against a live daemon: with prefetch off its hits are exactly the simulator's g-lru
(same tokens, warm-up, slots per size class; also through ``tokens=``, the CLI's ``--tokens``)
and the daemon-LRU reference's; plan() windows; prefetch counting."""
import os
from pathlib import Path

import numpy as np
import pytest

from moecached.replay import ReplayError, parse_predictor, plan, reference_lru, replay
from moecached.simulate import simulate
from moecached.trace import Trace, load_trace

from fixtures import make_model


def shared_dir():
    env = os.environ.get("MOECACHE_SHARED")
    d = Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared"
    return d if (d / "traces").is_dir() else None


def qwen_trace(name="qwen3_30b_a3b_sharegpt_prefill_2080.npz"):
    d = shared_dir()
    if d is None or not (d / "traces" / name).is_file():
        pytest.skip("real traces not found (set MOECACHE_SHARED or provide ../shared/traces)")
    return load_trace(d / "traces" / name)


def sliced(t, layers, tokens):
    return Trace(experts=np.ascontiguousarray(t.experts[:tokens, :layers]),
                 is_prompt=t.is_prompt[:tokens].copy(), meta={"n_experts": t.n_experts})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("replay"), "qwen3-30b-a3b-Q4_K_M", layers=2,
                      experts=128)


@pytest.fixture()
def daemon(model, tmp_path):
    from moecached.demo import Daemon
    made = []

    def start(slots):
        d = Daemon(model, str(tmp_path), slots=slots, lock=False, readers=8,
                   name=f"d{len(made)}")
        made.append(d)
        return d, d.connect(timeout=60)

    yield start
    for d in made:
        d.stop()


@pytest.mark.parametrize("frac", [0.25, 0.5])
def test_prefetch_off_matches_reference_and_simulator(daemon, frac):
    t = sliced(qwen_trace(), 2, 200)
    slots = int(frac * 128) * 2
    d, c = daemon(slots)
    try:
        r = replay(c, t, warm_tokens=40, tokens=160, lookahead=0, overhead_tokens=5)
    finally:
        c.close()
    s = r["sim"]
    assert r["counted_tokens"] == 160 and r["warm_tokens"] == 40
    assert r["accesses"] == 160 * 2 * 8
    assert r["hits"] + r["demand_misses"] == r["accesses"] and r["prefetch_hits"] == 0
    assert r["slots"] == slots and s["slots_match"], (r["class_slots"], s["glru_class_caps"])
    # the daemon's counters agree with the lease replies
    assert r["daemon"]["hits"] == r["hits"] and r["daemon"]["demand_misses"] == r["demand_misses"]
    # exact: the simulator (moecache-ctl policy's g-lru) on the same window, warm-up and slots
    assert s["daemon_equals_simulator"]
    assert (r["hits"], r["accesses"]) == (s["glru_hits"], s["glru_accesses"])
    # ... also as the CLI computes it: the whole trace, --warmup 40 --tokens 160
    g = simulate(t, "g-lru", slots, warmup=40, tokens=160)
    assert (g["hits"], g["accesses"], g["counted_tokens"]) == (r["hits"], r["accesses"], 160)
    assert g["hit_rate"] == r["hit_rate"]
    # and the daemon's LRU run offline over the same requests (second, independent model)
    assert s["daemon_equals_reference"]
    assert (r["hits"], r["accesses"]) == (s["reference_hits"], s["reference_accesses"])
    assert r["overhead_all_hits"] and r["overhead_ms_per_token"] > 0
    assert 0 < r["hit_rate"] < 1 and r["bytes_read"] >= r["demand_misses"] * 3_000_000


def test_reference_is_sensitive():
    """The exact check can fail: another capacity or another order gives other hits."""
    t = sliced(qwen_trace(), 2, 200)
    p = plan(t, 40, 160)
    from moecached.replay import _step_sets
    sets = _step_sets(p.trace.experts, p.steps)
    h64, a = reference_lru(sets, p.counted, [0, 0], [64], 128)
    h63, _ = reference_lru(sets, p.counted, [0, 0], [63], 128)
    assert a == 160 * 16 and h63 < h64


def test_prefetch_oracle_counts(daemon):
    t = sliced(qwen_trace(), 2, 120)
    d, c = daemon(64)
    try:
        r = replay(c, t, warm_tokens=20, tokens=100, lookahead=2, predictor="oracle",
                   compute_ms=4.0, attn_frac=0.5, overhead_tokens=3)
    finally:
        c.close()
    assert "sim" not in r
    assert r["hits"] + r["prefetch_hits"] + r["demand_misses"] == r["accesses"] == 1600
    assert r["prefetch_hits"] > 0 and r["prefetches"] >= r["prefetch_hits"]
    assert r["tok_s"] <= 1000 / 4.0 * 1.05  # compute time is waited


def test_plan_windows():
    t = qwen_trace()
    p = plan(t)
    assert p.sim_warmup == 256 and p.counted_tokens == t.n_tokens - 256 and "prefill" in p.note
    p = plan(t, 10, 5)
    assert (p.start, p.end, p.warm_tokens, p.counted_tokens) == (0, 15, 10, 5)
    assert simulate(t, "g-lru", 0.25, warmup=10, tokens=5)["counted_tokens"] == 5
    d = shared_dir() / "traces" / "mixtral8x7b_humaneval0_full.npz"
    m = load_trace(d)
    p = plan(m, 20, 7)
    first = int(np.argmax(~m.is_prompt))
    assert (p.start, p.warm_tokens, p.counted_tokens) == (first - 20, 20, 7)
    # the simulator's --tokens window is replay's: same end, same counted tokens
    g = simulate(m, "g-lru", 0.5, tokens=7)
    assert g["counted_tokens"] == 7
    assert g["hits"] == simulate(Trace(experts=m.experts[:p.end], is_prompt=m.is_prompt[:p.end],
                                       meta={"n_experts": m.n_experts}), "g-lru", 0.5)["hits"]
    with pytest.raises(ReplayError):
        plan(t, t.n_tokens, None)
    with pytest.raises(ReplayError):
        parse_predictor("noisy:2,1")
    assert parse_predictor("noisy:0.8,0.5") == ("noisy", 0.8, 0.5)


def test_layer_mismatch_refused(daemon):
    t = sliced(qwen_trace(), 3, 20)
    d, c = daemon(64)
    try:
        with pytest.raises(ReplayError, match="MoE layers"):
            replay(c, t, warm_tokens=5)
    finally:
        c.close()
