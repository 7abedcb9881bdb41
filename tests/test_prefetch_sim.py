"""The simulator's prefetch replay (``moecache-ctl policy --predictor``): the daemon's LRU with
prefetches at the cold end, predictors oracle / noisy / cooc; counts that must hold whatever the
trace."""
import json

import numpy as np
import pytest

from moecached.tools import simulate as sim
from moecached.tools import simprefetch, simstream
from moecached.tools.policycli import main as policy_main
from moecached.engine.trace import Trace, save_trace

L, E, K = 3, 16, 2


def random_trace(seed, T=300, hot=0.4, mapped=False):
    """Decode tokens; with ``mapped`` every layer's experts are a fixed function of layer 0's
    (what a co-occurrence predictor can learn exactly)."""
    rng = np.random.default_rng(seed)
    ex = np.empty((T, L, K), np.int16)
    for t in range(T):
        for l in range(L):
            if mapped and l:
                ex[t, l] = (ex[t, 0] * 5 + 3 * l) % E
            else:
                ex[t, l] = ex[t - 1, l] if t and rng.random() < hot else rng.choice(E, K, False)
    return Trace(experts=ex, is_prompt=np.zeros(T, bool), meta={"n_experts": E})


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("pred", ["oracle", "noisy:0.7,0.5", "cooc"])
@pytest.mark.parametrize("lookahead", [1, 2, 3])
def test_counts_add_up(seed, pred, lookahead):
    t = random_trace(seed)
    r = simprefetch.simulate_prefetch(t, 0.25, pred, lookahead)
    assert r["demand_hits"] + r["prefetch_hits"] + r["misses"] == r["accesses"] > 0
    assert r["prefetch_hits"] + r["wasted"] <= r["prefetches"]   # a prefetch is used or wasted at most once
    assert r["reads_per_token"] == pytest.approx((r["misses"] + r["prefetches"]) / r["counted_tokens"])


def test_no_prediction_is_plain_glru():
    t = random_trace(2)
    r = simprefetch.simulate_prefetch(t, 0.25, "noisy:0,0", 2)
    g = sim.simulate(t, "g-lru", 0.25)
    assert (r["demand_hits"], r["misses"], r["prefetches"], r["prefetch_hits"]) == \
        (g["hits"], g["misses"], 0, 0)
    assert r["hit_rate_no_prefetch"] == g["hit_rate"]


@pytest.mark.parametrize("lookahead", [1, 2, 4])
def test_oracle_wastes_nothing_and_saves_reads(lookahead):
    """The true next sets, pinned until their set: every prefetch is used, and fewer demand
    reads are left than without prefetch (a resident expert the prefetch skips may still be
    evicted before its set, as in the daemon)."""
    t = random_trace(3)
    r = simprefetch.simulate_prefetch(t, 0.5, "oracle", lookahead)
    g = sim.simulate(t, "g-lru", 0.5)
    assert r["wasted"] == 0 and r["prefetch_hits"] > 0
    assert r["misses"] < g["misses"] / 2
    assert r["served_rate"] > r["hit_rate_no_prefetch"]


def test_cooc_learns_a_fixed_mapping():
    t = random_trace(4, mapped=True)
    cooc = simprefetch.simulate_prefetch(t, 0.25, "cooc", 1)
    wrong = simprefetch.simulate_prefetch(t, 0.25, "noisy:0,1", 1)     # as many guesses, all wrong
    assert cooc["prefetch_hits"] > 10 * max(wrong["prefetch_hits"], 1)
    assert cooc["wasted"] < wrong["wasted"] and cooc["misses"] < wrong["misses"]


def test_bad_predictor_and_lookahead():
    t = random_trace(0, T=20)
    for bad in ("oracel", "noisy:2,0", "noisy:x"):
        with pytest.raises(simstream.SimulationError, match="--predictor"):
            simprefetch.simulate_prefetch(t, 0.25, bad)
    with pytest.raises(simstream.SimulationError, match="lookahead"):
        simprefetch.simulate_prefetch(t, 0.25, "oracle", 0)


def test_cli_table_and_json(tmp_path, capsys):
    p = tmp_path / "t.npz"
    save_trace(p, random_trace(5))
    assert policy_main([str(p), "--predictor", "cooc", "--lookahead", "2", "--sizes", "0.25,0.5"]) == 0
    out = capsys.readouterr().out
    assert "prefetch hits" in out and "reads/token" in out and "wasted" in out
    assert policy_main([str(p), "--predictor", "oracle", "--sizes", "0.25", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    r = js[0]["results"][0]
    assert {"demand_hits", "prefetch_hits", "misses", "wasted", "reads_per_token"} <= set(r)
