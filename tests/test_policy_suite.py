"""One test suite run over every policy of ``moecached.engine.policy.POLICIES`` (typed tests): each
contract every policy must keep, checked through the public door (``make_policy``,
``build_stream``, ``replay``, ``replay_subst``) on random streams; and substitution
(``moecache-ctl policy --subst``) against a plain Python reference that drives the daemon's
``LRU`` by the rule in docs/policies.md."""
import json

import numpy as np
import pytest

from moecached.tools import simulate as sim
from moecached.tools import simstream, simsubst
from moecached.tools.policycli import main as policy_main
from moecached.engine.policy import (EVICTIONS, LFUDecay, LRU, SLRU, NEEDS_FUTURE, make_eviction, POLICIES, build_stream, make_policy,
                              next_use, replay, replay_subst)
from moecached.engine.trace import Trace, save_trace

ALL = list(POLICIES)
ONLINE = [p for p in ALL if p not in NEEDS_FUTURE]
CREDITS = {"lfu-subst", "g-lfu-subst"}   # eviction values the candidates offered (credit)


def random_stream(seed, T=300, L=3, E=10, k=3, hot=0.5):
    rng = np.random.default_rng(seed)
    ex = np.empty((T, L, k), np.int16)
    for t in range(T):
        for l in range(L):
            ex[t, l] = ex[t - 1, l] if t and rng.random() < hot else rng.choice(E, k, False)
    step_start = np.arange(T + 1, dtype=np.int64)
    keys, ss, sl, st = build_stream(ex, step_start, E)
    return keys, ss, sl, st, L, E, ex


def groups(policy, L, E, per_layer_cap):
    if POLICIES[policy][0] == "layer":
        return np.repeat(np.arange(L, dtype=np.int64), E), np.full(L, per_layer_cap, np.int64)
    return np.zeros(L * E, np.int64), np.array([per_layer_cap * L], np.int64)


def run(policy, keys, ss, sl, st, L, E, cap, counted=None):
    g, c = groups(policy, L, E, cap)
    pol = make_policy(policy, g, c, next_use(keys, L * E) if policy in NEEDS_FUTURE else None)
    S = len(sl)
    cnt = np.ones(S, np.uint8) if counted is None else counted
    h, a = replay(pol, keys, ss, sl, cnt, st.astype(np.int64), L)
    return pol, g, c, h, a


@pytest.mark.parametrize("policy", ALL)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cap", [3, 5])
def test_budget_kept_and_last_set_resident(policy, seed, cap):
    keys, ss, sl, st, L, E, _ = random_stream(seed)
    pol, g, c, h, a = run(policy, keys, ss, sl, st, L, E, cap)
    res = np.zeros(len(g), bool)
    res[pol.resident()] = True
    for gi in range(len(c)):
        assert res[g == gi].sum() <= c[gi]
    assert res[keys[ss[-2]:ss[-1]]].all()
    assert (h <= a).all() and a.sum() == len(keys)


@pytest.mark.parametrize("policy", ALL)
def test_room_for_everything_means_compulsory_misses_only(policy):
    keys, ss, sl, st, L, E, _ = random_stream(3)
    pol, g, c, h, a = run(policy, keys, ss, sl, st, L, E, E)
    assert int(a.sum() - h.sum()) == len(np.unique(keys))


@pytest.mark.parametrize("policy", ALL)
def test_deterministic_and_bounded_by_belady(policy):
    keys, ss, sl, st, L, E, _ = random_stream(4)
    _, _, _, h1, a1 = run(policy, keys, ss, sl, st, L, E, 4)
    _, _, _, h2, a2 = run(policy, keys, ss, sl, st, L, E, 4)
    assert (h1 == h2).all() and (a1 == a2).all()
    bound = "opt" if POLICIES[policy][0] == "layer" else "g-opt"
    _, _, _, hb, _ = run(bound, keys, ss, sl, st, L, E, 4)
    assert h1.sum() <= hb.sum()


@pytest.mark.parametrize("policy", ALL)
def test_policy_carries_its_halving_period(policy):
    g, c = groups(policy, 1, 4, 2)
    pol = make_policy(policy, g, c, np.zeros(1, np.int64))
    assert pol.name == policy and pol.halve_every == POLICIES[policy][2]


def subst_inputs(keys, ss, rng, n_cand=2, E=10):
    """Random scores and candidates (keys of the set's layer, not routed in the set)."""
    S = len(ss) - 1
    score = rng.random(len(keys))
    cs, ck, csc = [0], [], []
    for s in range(S):
        routed = set(keys[ss[s]:ss[s + 1]].tolist())
        base = keys[ss[s]] // E * E
        pool = [base + e for e in range(E) if base + e not in routed]
        for k in rng.choice(pool, min(n_cand, len(pool)), replace=False):
            ck.append(int(k))
            csc.append(float(rng.random()))
        cs.append(len(ck))
    return score, np.array(cs, np.int64), np.array(ck, np.int64), np.array(csc, np.float64)


@pytest.mark.parametrize("policy", ONLINE)
@pytest.mark.parametrize("max_swaps", [0, 1, -1])
def test_substitution_contract(policy, max_swaps):
    keys, ss, sl, st, L, E, _ = random_stream(5)
    rng = np.random.default_rng(7)
    score, cs, ck, csc = subst_inputs(keys, ss, rng)
    _, _, _, h0, a0 = run(policy, keys, ss, sl, st, L, E, 4)
    g, c = groups(policy, L, E, 4)
    pol = make_policy(policy, g, c)
    cnt = np.ones(len(sl), np.uint8)
    h, a, u = replay_subst(pol, keys, score, ss, sl, cnt, st.astype(np.int64), L, cs, ck, csc,
                           0.5, max_swaps)
    assert (a == a0).all() and (h + u <= a).all()
    if max_swaps == 0:                       # no swap allowed: the plain replay, unless
        assert u.sum() == 0                  # the eviction order counts candidates offered
        assert (h == h0).all() or policy in CREDITS
    else:
        assert u.sum() > 0
        if max_swaps > 0:
            assert u.sum() <= max_swaps * len(sl)
    pol = make_policy(policy, g, c)          # no candidates at all: the plain replay
    h, a, u = replay_subst(pol, keys, score, ss, sl, cnt, st.astype(np.int64), L,
                           np.zeros(len(sl) + 1, np.int64), np.zeros(0, np.int64),
                           np.zeros(0), 0.5, -1)
    assert (h == h0).all() and u.sum() == 0
    res = np.zeros(len(g), bool)
    res[pol.resident()] = True
    for gi in range(len(c)):
        assert res[g == gi].sum() <= c[gi]


def test_substitution_refuses_future_policies_and_bad_r():
    g, c = np.zeros(4, np.int64), np.array([2], np.int64)
    z = np.zeros(1, np.int64)
    with pytest.raises(ValueError, match="online policies"):
        replay_subst(make_policy("g-opt", g, c, z), z, z, z, z, z, z, 1, z, z, z, 0.5)
    with pytest.raises(ValueError, match="0 <= r <= 1"):
        replay_subst(make_policy("g-lru", g, c), z, z, z, z, z, z, 1, z, z, z, 1.5)


# ------------------------------------------------------------------ reference (g-lru)

def ref_subst_glru(t: Trace, cap_slots, r, max_swaps, refresh=False, evict="lru",
                   per_layer=False):
    """The rule of docs/policies.md ("Substitution") over the daemon's eviction order
    ``evict`` (one budget of ``cap_slots``, or with ``per_layer`` one of ``cap_slots`` per
    layer), every token counted, one token per step. Returns (hits, substituted, accesses)."""
    T, L, K = t.experts.shape
    E = t.n_experts
    h = K // 2
    orders = [make_eviction(evict, L * E) for _ in range(L if per_layer else 1)]
    hits = subs = acc = 0
    for tok in range(T):
        for l in range(L):
            lru = orders[l if per_layer else 0]
            routed, cand = {}, {}
            for rk in range(K):
                e = int(t.experts[tok, l, rk])
                if e >= 0:
                    d = routed if rk < h else cand
                    d.setdefault(l * E + e, float(t.weights[tok, l, rk]))
            cand = {k: v for k, v in cand.items() if k not in routed}
            if not routed:
                continue
            given, subst_of = [], set()
            for k, sc in routed.items():
                if lru.contains(k) or (max_swaps >= 0 and len(given) >= max_swaps):
                    continue
                ok = [(v, -i, c) for i, (c, v) in enumerate(cand.items())
                      if lru.contains(c) and c not in given and v >= r * sc]
                if ok:
                    given.append(max(ok)[2])
                    subst_of.add(k)
            hit_keys = [k for k in routed if lru.contains(k)]
            miss_keys = [k for k in routed if not lru.contains(k) and k not in subst_of]
            if len(hit_keys) < len(routed):     # the request reaches the cache: credits
                for c in cand:
                    if c not in given:
                        lru.credit(c)
            sub = iter(given)                   # hits and substitutes in set order
            served = [k if lru.contains(k) else next(sub) for k in routed
                      if lru.contains(k) or k in subst_of]
            for k in served:                    # the misses take their slots first
                lru.pin(k)
            for i in range(len(miss_keys)):
                if len(lru) + i >= cap_slots:
                    lru.remove(lru.victim())
            for k in served:
                lru.touch(k)
            if refresh:
                for c in cand:
                    if lru.contains(c) and c not in given:
                        lru.touch(c)
            for k in miss_keys:
                lru.insert(k)
                lru.pin(k)
            for k in hit_keys + given + miss_keys:
                lru.unpin(k)
            hits += len(hit_keys)
            subs += len(given)
            acc += len(routed)
    return hits, subs, acc


def weighted_trace(seed, T=200, L=3, E=8, K=4, hot=0.4):
    rng = np.random.default_rng(seed)
    ex = np.empty((T, L, K), np.int16)
    for t in range(T):
        for l in range(L):
            ex[t, l] = ex[t - 1, l] if t and rng.random() < hot else rng.choice(E, K, False)
    w = rng.random((T, L, K)).astype(np.float32)
    w = -np.sort(-w, axis=2)
    ex[rng.random((T, L, K)) < 0.05] = -1
    w[ex < 0] = 0
    return Trace(experts=ex, is_prompt=np.zeros(T, bool), weights=w, meta={"n_experts": E})


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("r,max_swaps", [(0.0, -1), (0.5, 1), (0.8, -1), (0.5, 2), (1.0, 1)])
@pytest.mark.parametrize("refresh", [False, True])
def test_glru_substitution_matches_reference(seed, r, max_swaps, refresh):
    t = weighted_trace(seed)
    v = simsubst.subst_view(t, warmup=0)
    got = simsubst.simulate_subst(v, "g-lru", 0.25, r, max_swaps, refresh=refresh)
    slots = round(0.25 * 8) * 3
    h, u, a = ref_subst_glru(t, slots, r, max_swaps, refresh)
    assert (got["hits"], got["substituted"], got["accesses"]) == (h, u, a)
    assert got["served_rate"] == (h + u) / a
    plain = sim.simulate(v.trace, "g-lru", 0.25, warmup=0)
    assert got["g_lru"] == plain["hit_rate"]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("policy,per_layer", [("lfu-subst", True), ("g-lfu-subst", False)])
@pytest.mark.parametrize("r,max_swaps", [(0.5, 1), (0.3, -1)])
def test_lfu_subst_substitution_matches_reference(seed, policy, per_layer, r, max_swaps):
    """lfu-subst (the daemon's eviction = "lfu-subst") replays as the daemon's LFUDecay with
    candidate credits, driven by the documented rule; the credits change the outcome."""
    t = weighted_trace(seed, T=300)
    v = simsubst.subst_view(t, warmup=0)
    got = simsubst.simulate_subst(v, policy, 0.25, r, max_swaps)
    cap = round(0.25 * 8) * (1 if per_layer else 3)
    ref = ref_subst_glru(t, cap, r, max_swaps, evict="lfu-subst", per_layer=per_layer)
    assert (got["hits"], got["substituted"], got["accesses"]) == ref


def test_lfu_subst_reference_is_sensitive_to_the_credits(monkeypatch):
    import moecached.engine.policy as mp
    t = weighted_trace(0, T=300)
    with_credit = ref_subst_glru(t, 6, 0.3, -1, evict="lfu-subst")
    monkeypatch.setitem(mp.EVICTIONS, "lfu-subst",
                        lambda n: LFUDecay(n, mp.LFU_SUBST_HALVE_AFTER, mp.LFU_SUBST_USE, 0))
    assert ref_subst_glru(t, 6, 0.3, -1, evict="lfu-subst") != with_credit


def test_lfu_decay_weights_and_credit():
    d = LFUDecay(8, 10, 2, 1)
    d.insert(0)                              # +2
    d.insert(1)                              # +2
    d.credit(5)                              # +1, also for a key not resident
    d.credit(1)                              # +1
    assert [d.count(k) for k in (0, 1, 5)] == [2, 3, 1]
    assert d.victim() == 0
    d.touch(0)                               # +2 -> 4
    d.touch(0)                               # +2 -> 10 added: every count halved
    assert [d.count(k) for k in (0, 1, 5)] == [3, 1, 0]
    assert d.victim() == 1
    plain = LFUDecay(8, 10)                  # no candidate weight: a credit counts nothing
    plain.credit(3)
    assert plain.count(3) == 0
    LRU(4).credit(2)                         # the LRU order ignores credits
    with pytest.raises(ValueError, match="weights"):
        LFUDecay(4, 8, 0, 1)
    with pytest.raises(IndexError):
        d.credit(8)


# ------------------------------------------------------------------ CLI

def test_cli_subst_json_and_skips_traces_without_weights(tmp_path, capsys):
    p = tmp_path / "w.npz"
    save_trace(p, weighted_trace(2))
    q = tmp_path / "now.npz"
    t = weighted_trace(3)
    save_trace(q, Trace(experts=t.experts, is_prompt=t.is_prompt, meta=t.meta))
    assert policy_main([str(p), str(q), "--subst", "0.5", "--subst-cap", "1", "--sizes", "0.25",
                     "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    r = js[0]["results"][0]
    assert {"g_lru", "g_opt", "served_rate", "gap_closed"} <= set(r)
    assert r["gap_closed"] == pytest.approx((r["served_rate"] - r["g_lru"])
                                            / (r["g_opt"] - r["g_lru"]))
    assert "view" in js[0] and "routed" in js[0]["view"]
    assert "weights" in js[1]["skipped"] and js[1]["results"] == []
    assert policy_main([str(p), "--subst", "0.5,0.8", "--subst-cap", "1,none",
                     "--sizes", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "g-lru subst r=0.8 cap=none" in out and "candidates" in out


@pytest.mark.parametrize("argv,msg", [(["--subst", "1.5"], "--subst 1.5"),
                                      (["--subst", "x"], "--subst x"),
                                      (["--subst", "0.5", "--subst-cap", "0"], "--subst-cap 0"),
                                      (["--subst", "0.5", "--policies", "g-opt"], "g-opt")])
def test_cli_subst_bad_input(tmp_path, argv, msg):
    p = tmp_path / "w.npz"
    save_trace(p, weighted_trace(2))
    with pytest.raises(simstream.SimulationError, match=msg):
        policy_main([str(p)] + argv)


# ------------------------------------------------------------------ scan-resistant admission

def ref_glru_cold(t: Trace, cap_slots, cold_of):
    """The daemon's LRU, one budget, one token per step, every token counted; the misses of
    token-layer sets with ``cold_of(token, n_experts_in_set)`` inserted at the cold end."""
    T, L, K = t.experts.shape
    E = t.n_experts
    lru = LRU(L * E)
    hits = acc = 0
    for tok in range(T):
        for l in range(L):
            keys = list(dict.fromkeys(l * E + int(e) for e in t.experts[tok, l] if e >= 0))
            if not keys:
                continue
            hit = [k for k in keys if lru.contains(k)]
            miss = [k for k in keys if not lru.contains(k)]
            for k in hit:
                lru.touch(k)
                lru.pin(k)
            for k in miss:
                if len(lru) >= cap_slots:
                    lru.remove(lru.victim())
                lru.insert(k, cold_of(tok, len(keys)))
                lru.pin(k)
            for k in keys:
                lru.unpin(k)
            hits += len(hit)
            acc += len(keys)
    return hits, acc


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("admit", [None, "prompt", 1, 2])
def test_cold_admission_matches_reference(seed, admit):
    t = weighted_trace(seed, K=3)
    rng = np.random.default_rng(seed)
    t = Trace(experts=t.experts, is_prompt=rng.random(t.n_tokens) < 0.5, meta=t.meta)
    cold_of = {None: lambda tok, n: False, "prompt": lambda tok, n: bool(t.is_prompt[tok]),
               1: lambda tok, n: n > 1, 2: lambda tok, n: n > 2}[admit]
    h, a = ref_glru_cold(t, 6, cold_of)
    st = simstream.prepare(t, warmup=0)
    st.set_counted[:] = 1                      # count every set, as the reference does
    got = sim.simulate(t, "g-lru", 0.25, stream=st, admit_cold=admit)
    assert (got["hits"], got["accesses"]) == (h, a)
    if admit is not None:                      # the reference is sensitive to the rule
        assert ref_glru_cold(t, 6, lambda tok, n: False)[0] != h


@pytest.mark.parametrize("policy", [p for p in ALL if p not in sim.ADMITS_COLD])
def test_cold_admission_refused_by_other_policies(policy):
    t = weighted_trace(0)
    with pytest.raises(simstream.SimulationError, match="no cold admission"):
        sim.simulate(t, policy, 0.5, admit_cold="prompt")


@pytest.mark.parametrize("bad", ["scan", "0", "-3"])
def test_cli_admit_cold_bad_value(tmp_path, bad):
    p = tmp_path / "w.npz"
    save_trace(p, weighted_trace(2))
    with pytest.raises(simstream.SimulationError, match="--admit-cold"):
        policy_main([str(p), "--admit-cold", bad])


# ------------------------------------------------------------------ daemon eviction orders

def test_lfu_decay_victim_counts_halving_and_ties():
    d = LFUDecay(8, 4)
    for k in (0, 1, 2):
        d.insert(k)                      # 3 uses
    d.touch(0)                           # 4th use: every count halved -> 0:1, 1:0, 2:0
    assert [d.count(k) for k in (0, 1, 2)] == [1, 0, 0]
    assert d.victim() == 1               # fewest, ties -> least recent (1 is colder than 2)
    d.pin(1)
    assert d.victim() == 2
    d.insert(3, cold=True)               # an unused prefetch: not a use
    assert d.count(3) == 0 and d.victim() == 3
    d.touch(2)
    d.touch(2)
    assert d.victim() == 3 and d.keys()[0] == 2
    d.unpin(1)
    d.remove(3)
    assert d.victim() == 1 and d.count(3) == 0
    with pytest.raises(ValueError, match="halve_after"):
        LFUDecay(4, 0)


@pytest.mark.parametrize("name", list(EVICTIONS))
def test_every_eviction_order_keeps_the_lru_interface(name):
    """What the cache calls (insert, touch, pin, unpin, victim, remove, grant_resident,
    all_present, unpin_keys, contains, keys, len, pinned) works on every eviction order."""
    d = make_eviction(name, 16)
    for k in range(4):
        d.insert(k)
    res, unused = list(range(16)), bytearray(16)
    unused[2] = 1
    keys, items, pf = d.grant_resident([1, 2], 0, 16, res, unused, 5, 0)
    assert keys == [1, 2] and pf == 1 and items == [(5, 1, 0, 1), (5, 2, 0, 2)]
    assert d.all_present([0, 3], 0, 16) and not d.all_present([9], 0, 16)
    assert d.pinned == 2 and d.victim() in (0, 3)
    d.unpin_keys(keys)
    d.pin(0)
    assert d.victim() != 0
    d.unpin(0)
    assert d.remove(d.victim()) and len(d) == 3 and d.contains(1)
    assert d.touch(1) and d.keys()[0] == 1
    with pytest.raises(ValueError, match="eviction"):
        make_eviction("slru-x", 4)


def test_lru_insert_probation_point():
    d = LRU(32)
    for k in range(10):
        d.insert(k)                       # hot -> cold: 9 .. 0
    d.insert_probation(20)                # 10 present: 10 // 5 = 2 stay colder
    assert d.keys()[-3:] == [20, 1, 0]
    d.remove(20)
    for k in range(10, 14):
        d.insert(k)
    d.insert_probation(21)                # 14 present: 2 stay colder
    assert d.keys()[-3:] == [21, 1, 0]
    e = LRU(4)
    e.insert_probation(3)                 # empty: the cold end (= the only key)
    assert e.keys() == [3]
    with pytest.raises(ValueError, match="already present"):
        e.insert_probation(3)
    f = LFUDecay(8, 100)
    f.insert_probation(2)                 # not a use
    assert f.count(2) == 0


def test_slru_segments_promotion_demotion_and_victim():
    d = SLRU(32)
    for k in range(5):
        d.insert(k)                       # probation, hot -> cold: 4 3 2 1 0
    assert d.victim() == 0 and not any(d.protected(k) for k in range(5))
    d.touch(0)                            # 0 -> protected (at most 5 - 1 = 4 protected)
    assert d.protected(0) and d.victim() == 1
    for k in (1, 2, 3):
        d.touch(k)
    assert [d.protected(k) for k in range(5)] == [True] * 4 + [False]
    d.touch(4)                            # a fifth protected: over 4, 0 (least recent) demoted
    assert not d.protected(0) and d.protected(4) and d.victim() == 0
    d.pin(0)
    assert d.victim() == 1                # no unpinned probation key: least recent protected
    d.unpin(0)
    d.remove(1)
    assert not d.protected(1) and len(d) == 4
    d.insert(1, cold=True)                # cold end of probation
    assert d.victim() == 1
    d.insert_probation(9)                 # = a plain insert: probation
    assert not d.protected(9)
