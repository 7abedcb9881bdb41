"""Simulator policies against plain Python reference implementations, plus analytic oracles.

The references below use Python lists (index 0 = coldest) and dicts, and rebuild the access
stream from the trace on their own; they share nothing with the Cython kernels except the
size -> slots mapping (``simsizes.capacities``, tested separately against the daemon's
``plan_slots``).
"""
import bisect
import json
import math
import types
from collections import defaultdict
from fractions import Fraction

import numpy as np
import pytest

from moecached.tools import simulate as sim
from moecached.tools import simsizes, simstream
from moecached.tools.policycli import main as policy_main
from moecached.engine.policy import (LFU_DECAY_HALVE_AFTER, LFU_SUBST_HALVE_AFTER, LFU_SUBST_USE, LRU,
                              POLICIES, expand_policies)
from moecached.tools.replayplan import reference_lru
from moecached.engine.trace import Trace, load_trace

from fixtures import make_model, shared_dir, shared_layouts_dir, shared_traces

SHARED = shared_dir()
TRACES = shared_traces()
need_traces = pytest.mark.skipif(not TRACES, reason=f"no traces under {SHARED}/traces")
ALL = list(POLICIES)
LAYER_POLICIES = [p for p in ALL if POLICIES[p][0] == "layer"]


# ============================================================================ references

def _rhu(num, den):
    """round half up of num/den (exact)."""
    return math.floor(Fraction(num, den) + Fraction(1, 2))


def cold_unpinned(lst, pinned):
    for k in lst:
        if k not in pinned:
            return k
    return None


class RefLRU:
    def __init__(self, c, **_):
        self.c, self.order = c, []

    def resident(self, k):
        return k in self.order

    def access(self, k, now, pinned):
        if k in self.order:
            self.order.remove(k)
            self.order.append(k)
            return True
        if len(self.order) >= self.c:
            self.order.remove(cold_unpinned(self.order, pinned))
        self.order.append(k)
        return False


class _Segments:
    """Probation / protected lists of an SLRU: a hit in protected moves to its MRU end, a hit
    in probation is promoted, the protected LRU going back to probation past ``prot_max()``."""

    def resident(self, k):
        return k in self.prob or k in self.prot

    def hit(self, k):
        if k in self.prot:
            self.prot.remove(k)
            self.prot.append(k)
            return True
        if k in self.prob:
            self.prob.remove(k)
            self.prot.append(k)
            if len(self.prot) > self.prot_max():
                self.prob.append(self.prot.pop(0))
            return True
        return False


class RefDaemonSLRU(_Segments):
    """The daemon's ``SLRU`` (eviction = "slru"): probation / protected segments, protected at
    most ``n - max(1, round_half_up(n / 5))`` of the ``n`` keys present; as the daemon, a set's
    misses take their slots (victims) before its hits are used (``reserve``)."""
    def __init__(self, c, **_):
        self.c, self.prob, self.prot, self.pend = c, [], [], 0

    def prot_max(self):
        n = len(self.prob) + len(self.prot)
        return n - max(1, (2 * n + 5) // 10)

    def reserve(self, misses, pinned):
        for _ in misses:
            if len(self.prob) + len(self.prot) + self.pend >= self.c:
                v = next((x for x in self.prob if x not in pinned), None)
                if v is None:
                    v = next(x for x in self.prot if x not in pinned)
                (self.prob if v in self.prob else self.prot).remove(v)
            self.pend += 1

    def access(self, k, now, pinned):
        if self.hit(k):
            return True
        self.pend -= 1
        self.prob.append(k)
        return False


class RefLFU:
    def __init__(self, c, shared, **_):
        self.c, self.res = c, set()
        self.count, self.last = shared.setdefault("count", defaultdict(int)), shared.setdefault(
            "last", {})

    def resident(self, k):
        return k in self.res

    def access(self, k, now, pinned):
        self.count[k] += 1
        self.last[k] = now
        if k in self.res:
            return True
        if len(self.res) >= self.c:
            v = min((x for x in self.res if x not in pinned),
                    key=lambda x: (self.count[x], self.last[x]))
            self.res.remove(v)
        self.res.add(k)
        return False


class RefLRU2:
    def __init__(self, c, shared, **_):
        self.c, self.res = c, set()
        self.hist = shared.setdefault("hist", defaultdict(lambda: (-1, -1)))

    def resident(self, k):
        return k in self.res

    def access(self, k, now, pinned):
        t2, t1 = self.hist[k]
        self.hist[k] = (t1, now)
        if k in self.res:
            return True
        if len(self.res) >= self.c:
            v = min((x for x in self.res if x not in pinned), key=lambda x: self.hist[x])
            self.res.remove(v)
        self.res.add(k)
        return False


class RefOPT:
    def __init__(self, c, shared, **_):
        self.c, self.res, self.pos = c, set(), shared["positions"]

    def resident(self, k):
        return k in self.res

    def next_use(self, k, now):
        p = self.pos[k]
        j = bisect.bisect_right(p, now)
        return p[j] if j < len(p) else math.inf

    def access(self, k, now, pinned):
        if k in self.res:
            return True
        if len(self.res) >= self.c:
            v = max((x for x in self.res if x not in pinned),
                    key=lambda x: (self.next_use(x, now), x))
            self.res.remove(v)
        self.res.add(k)
        return False


class RefSLRU(_Segments):
    def __init__(self, c, **_):
        self.c, self.prob, self.prot = c, [], []
        self.pmax = max(0, c - max(1, _rhu(20 * c, 100)))

    def prot_max(self):
        return self.pmax

    def access(self, k, now, pinned):
        if self.hit(k):
            return True
        if len(self.prob) + len(self.prot) >= self.c:
            v = cold_unpinned(self.prob, pinned)
            if v is None:
                v = cold_unpinned(self.prot, pinned)
                self.prot.remove(v)
            else:
                self.prob.remove(v)
        self.prob.append(k)
        return False


class RefARC:
    """ARC as in Megiddo & Modha (FAST'03), Fig. 4; REPLACE skips pinned keys."""

    def __init__(self, c, **_):
        self.c, self.p = c, 0.0
        self.T1, self.T2, self.B1, self.B2 = [], [], [], []

    def resident(self, k):
        return k in self.T1 or k in self.T2

    def replace(self, in_b2, pinned):
        t1 = len(self.T1)
        if t1 >= 1 and ((in_b2 and t1 == self.p) or t1 > self.p):
            order = [(self.T1, self.B1), (self.T2, self.B2)]
        else:
            order = [(self.T2, self.B2), (self.T1, self.B1)]
        for src, ghost in order:
            v = cold_unpinned(src, pinned)
            if v is not None:
                src.remove(v)
                ghost.append(v)
                return
        raise AssertionError("all pinned")

    def access(self, k, now, pinned):
        c = self.c
        if k in self.T1 or k in self.T2:
            (self.T1 if k in self.T1 else self.T2).remove(k)
            self.T2.append(k)
            return True
        if k in self.B1:
            self.p = min(c, self.p + max(len(self.B2) / len(self.B1), 1))
            self.replace(False, pinned)
            self.B1.remove(k)
            self.T2.append(k)
            return False
        if k in self.B2:
            self.p = max(0, self.p - max(len(self.B1) / len(self.B2), 1))
            self.replace(True, pinned)
            self.B2.remove(k)
            self.T2.append(k)
            return False
        total = len(self.T1) + len(self.T2) + len(self.B1) + len(self.B2)
        if len(self.T1) + len(self.B1) == c:
            if len(self.T1) < c:
                self.B1.pop(0)
                self.replace(False, pinned)
            else:
                self.T1.remove(cold_unpinned(self.T1, pinned))
        elif total >= c:
            if total == 2 * c:
                self.B2.pop(0)
            self.replace(False, pinned)
        self.T1.append(k)
        return False


M64 = (1 << 64) - 1


def mix64(z):
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


class RefSketch:
    def __init__(self, c):
        self.w = 16
        while self.w < c:
            self.w *= 2
        self.rows = [[0] * self.w for _ in range(4)]
        self.adds, self.sample = 0, 10 * c

    def _idx(self, k, r):
        return mix64((k << 2) | r) % self.w

    def incr(self, k):
        for r in range(4):
            j = self._idx(k, r)
            self.rows[r][j] = min(15, self.rows[r][j] + 1)
        self.adds += 1
        if self.adds >= self.sample:
            self.rows = [[x // 2 for x in row] for row in self.rows]
            self.adds //= 2

    def freq(self, k):
        return min(self.rows[r][self._idx(k, r)] for r in range(4))


class RefWTinyLFU:
    def __init__(self, c, window_pct, **_):
        self.c = c
        self.wmax = max(1, _rhu(window_pct * c, 100))
        self.pmax = _rhu(80 * max(0, c - self.wmax), 100)
        self.W, self.prob, self.prot = [], [], []
        self.sk = RefSketch(c)

    def size(self):
        return len(self.W) + len(self.prob) + len(self.prot)

    def resident(self, k):
        return k in self.W or k in self.prob or k in self.prot

    def main_victim(self, pinned):
        v = cold_unpinned(self.prob, pinned)
        return v if v is not None else cold_unpinned(self.prot, pinned)

    def drop(self, v):
        for lst in (self.W, self.prob, self.prot):
            if v in lst:
                lst.remove(v)

    def access(self, k, now, pinned):
        self.sk.incr(k)
        if k in self.W or k in self.prot:
            lst = self.W if k in self.W else self.prot
            lst.remove(k)
            lst.append(k)
            return True
        if k in self.prob:
            self.prob.remove(k)
            self.prot.append(k)
            if len(self.prot) > self.pmax:
                self.prob.append(self.prot.pop(0))
            return True
        self.W.append(k)
        while len(self.W) > self.wmax:
            cand = cold_unpinned(self.W, pinned)
            if cand is None:
                break
            self.W.remove(cand)
            if self.size() + 1 <= self.c:
                self.prob.append(cand)
                continue
            v = self.main_victim(pinned)
            if v is not None and self.sk.freq(cand) > self.sk.freq(v):
                self.drop(v)
                self.prob.append(cand)
        if self.size() > self.c:
            v = self.main_victim(pinned)
            if v is None:
                v = cold_unpinned(self.W, pinned)
            self.drop(v)
        return False


class RefLFUDecay:
    """The daemon's ``LFUDecay``: demanded uses counted per budget (kept after eviction), all
    counts halved after every LFU_DECAY_HALVE_AFTER uses; victim: fewest, ties least recent."""
    def __init__(self, c, halve_after=LFU_DECAY_HALVE_AFTER, use=1, **_):
        self.c, self.order, self.count, self.n = c, [], defaultdict(int), 0
        self.halve_after, self.use = halve_after, use
        self.pend = 0

    def _victim(self, pinned):
        return min((x for x in self.order if x not in pinned), key=lambda x: self.count[x])

    def reserve(self, misses, pinned):
        """As the daemon: the set's misses take their slots before its hits are used."""
        for _ in misses:
            if len(self.order) + self.pend >= self.c:
                self.order.remove(self._victim(pinned))
            self.pend += 1

    def resident(self, k):
        return k in self.order

    def _use(self, k):
        self.count[k] += self.use
        self.n += self.use
        if self.n >= self.halve_after:
            for x in self.count:
                self.count[x] //= 2
            self.n = 0

    def access(self, k, now, pinned):
        if k in self.order:
            self._use(k)
            self.order.remove(k)
            self.order.append(k)
            return True
        if self.pend:
            self.pend -= 1
        elif len(self.order) >= self.c:
            self.order.remove(self._victim(pinned))
        self.order.append(k)
        self._use(k)
        return False


REF = {
    "lru": RefLRU, "g-lru": RefLRU, "g-lfu-decay": RefLFUDecay, "g-slru": RefDaemonSLRU,
    "lfu-subst": lambda c, **kw: RefLFUDecay(c, LFU_SUBST_HALVE_AFTER, LFU_SUBST_USE, **kw),
    "g-lfu-subst": lambda c, **kw: RefLFUDecay(c, LFU_SUBST_HALVE_AFTER, LFU_SUBST_USE, **kw), "lfu": RefLFU, "g-lfu": RefLFU, "slru": RefSLRU,
    "opt": RefOPT, "g-opt": RefOPT, "arc": RefARC, "lru-2": RefLRU2,
    "w-tinylfu-1": lambda c, **kw: RefWTinyLFU(c, 1, **kw),
    "w-tinylfu-10": lambda c, **kw: RefWTinyLFU(c, 10, **kw),
}


def ref_simulate(trace, policy, size, per_class_layers=None, warmup=None):
    """(hits, accesses) by the rules of docs/policies.md, written plainly."""
    ex, isp = trace.experts, trace.is_prompt
    T, L, K = ex.shape
    E = trace.n_experts
    steps = []
    for t in range(T):
        if trace.step is not None and steps and trace.step[t] == trace.step[t - 1]:
            steps[-1].append(t)
        else:
            steps.append([t])
    has_decode = not all(isp)
    if warmup is None:
        warmup = 0 if has_decode else min(256, T // 4)
    classes = per_class_layers or [list(range(L))]
    class_caps, layer_caps, _ = simsizes.capacities(size, L, E, classes)
    per_layer = POLICIES[policy][0] == "layer"
    class_of = {l: ci for ci, c in enumerate(classes) for l in c}
    # the access stream: (step index, layer, key list, counted)
    sets = []
    for si, toks in enumerate(steps):
        counted = toks[0] >= warmup and (not has_decode or any(not isp[t] for t in toks))
        for l in range(L):
            keys = []
            for t in toks:
                for e in ex[t, l]:
                    if e >= 0 and l * E + int(e) not in keys:
                        keys.append(l * E + int(e))
            if keys:
                sets.append((si, l, keys, counted))
    shared = {"positions": defaultdict(list)}
    flat = [k for s in sets for k in s[2]]
    for i, k in enumerate(flat):
        shared["positions"][k].append(i)
    pols = {}
    hits = acc = now = tokens = 0
    next_halve = 64
    last_step = 0
    for si, l, keys, counted in sets:
        for s in range(last_step, si):     # steps finished since the last set
            tokens += len(steps[s])
            while policy == "g-lfu" and tokens >= next_halve:
                cnt = shared["count"]
                for k in cnt:
                    cnt[k] //= 2
                next_halve += 64
        last_step = si
        g = l if per_layer else class_of[l]
        if g not in pols:
            cap = int(layer_caps[l]) if per_layer else class_caps[g]
            pols[g] = REF[policy](cap, shared=shared)
        # as the daemon grants a request: the set's resident keys (hits) first, in set order,
        # then the others (misses) in set order; each stays pinned until the set is done
        pol = pols[g]
        hit_keys = [k for k in keys if pol.resident(k)]
        order = hit_keys + [k for k in keys if k not in hit_keys]
        if hasattr(pol, "reserve"):       # a daemon order: the misses' victims first
            pol.reserve([k for k in keys if k not in hit_keys], set(hit_keys))
        pinned = set()
        for k in order:
            pinned.add(k)
            h = pol.access(k, now, pinned)
            assert bool(h) == (k in hit_keys)
            now += 1
            if counted:
                acc += 1
                hits += bool(h)
    return hits, acc


def fast(trace, policy, size, per_class_layers=None, warmup=None):
    r = sim.simulate(trace, policy, size, per_class_layers=per_class_layers, warmup=warmup)
    return r["hits"], r["accesses"]


def truncate(t: Trace, n) -> Trace:
    return t.window(0, n)


# ============================================================================ exact matches

@pytest.mark.slow
@need_traces
@pytest.mark.parametrize("policy", ALL)
def test_matches_reference_on_shared_traces(policy):
    for p in TRACES:
        t = load_trace(p)
        if t.n_experts > 16:            # Qwen3: 128 experts x 48 layers; truncated for speed
            t = truncate(t, 40 if POLICIES[policy][0] == "class" else 60)
            w = 10
        else:                           # Mixtral traces: full length
            w = None
        for size in (0.25, 0.5, 0.75):
            assert fast(t, policy, size, warmup=w) == ref_simulate(t, policy, size, warmup=w), \
                (p.name, policy, size)


@need_traces
def test_matches_reference_with_classes_and_int_slots():
    t = load_trace(next(p for p in TRACES if "humaneval0" in p.name))
    classes = [list(range(0, 32, 2)), list(range(1, 32, 2))]
    for policy in ALL:
        for size in (70, 0.5):
            assert fast(t, policy, size, classes) == ref_simulate(t, policy, size, classes), \
                (policy, size)


hyp = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings, strategies as st  # noqa: E402


@st.composite
def traces(draw):
    T = draw(st.integers(1, 140))
    L = draw(st.integers(1, 3))
    E = draw(st.integers(2, 9))
    k = draw(st.integers(1, min(3, E)))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    hot = draw(st.floats(0.0, 0.9))
    ex = np.empty((T, L, k), np.int16)
    for t in range(T):
        for l in range(L):
            if t and rng.random() < hot:
                ex[t, l] = ex[t - 1, l]           # temporal locality
            else:
                ex[t, l] = rng.choice(E, k, replace=False)
    ex[rng.random((T, L, k)) < draw(st.floats(0, 0.3))] = -1
    if draw(st.booleans()):                       # duplicates within a row are dropped
        ex[rng.random((T, L, k)) < 0.1] = 0
    isp = rng.random(T) < draw(st.floats(0, 1))
    step = None
    if draw(st.booleans()):
        step = np.cumsum(rng.random(T) < 0.6).astype(np.int32)
    classes = None
    if L > 1 and draw(st.booleans()):
        classes = [[0], list(range(1, L))]
    return Trace(experts=ex, is_prompt=isp, step=step, meta={"n_experts": E}), classes


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(traces(), st.sampled_from(ALL), st.one_of(st.sampled_from([0.25, 0.5, 0.75, 1.0]),
                                                   st.integers(1, 30)),
       st.one_of(st.none(), st.integers(0, 20)))
def test_matches_reference_random(tc, policy, size, warmup):
    t, classes = tc
    try:
        got = fast(t, policy, size, classes, warmup)
    except simstream.SimulationError:
        assume(False)
    assert got == ref_simulate(t, policy, size, classes, warmup)


# ============================================================================ oracles

def uniform_trace(T=2500, L=2, E=32, k=2, seed=1):
    rng = np.random.default_rng(seed)
    ex = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(L)])
                   for _ in range(T)]).astype(np.int16)
    return Trace(experts=ex, is_prompt=np.r_[np.ones(200, bool), np.zeros(T - 200, bool)],
                 meta={"n_experts": E})


@pytest.mark.parametrize("size", [0.25, 0.5])
def test_iid_uniform_hit_rate_is_capacity_over_experts(size):
    t = uniform_trace()
    for policy in ALL:
        if policy in ("opt", "g-opt"):
            continue
        r = sim.simulate(t, policy, size)
        assert abs(r["hit_rate"] - size) < 0.025, (policy, r["hit_rate"])


def cyclic_trace(n=10, T=1000, L=1):
    ex = np.array([[[t % n]] * L for t in range(T)], np.int16)
    return Trace(experts=ex, is_prompt=np.r_[np.ones(100, bool), np.zeros(T - 100, bool)],
                 meta={"n_experts": n})


@pytest.mark.parametrize("n,c", [(10, 5), (12, 3), (7, 6)])
def test_cyclic_scan_lru_zero_belady_known(n, c):
    t = cyclic_trace(n, T=100 + 90 * (n - 1), L=2)
    for policy in ("lru", "g-lru"):
        assert sim.simulate(t, policy, c * (2 if policy == "g-lru" else 2))["hits"] == 0
    # MIN on a cyclic scan of n keys with c slots: c - 1 hits per n - 1 accesses (steady state)
    r = sim.simulate(t, "opt", c * 2)
    assert abs(r["hit_rate"] - (c - 1) / (n - 1)) < 0.01, r["hit_rate"]
    # one layer per class: g-opt equals opt
    assert sim.simulate(t, "g-opt", c * 2, per_class_layers=[[0], [1]])["hits"] == r["hits"]


@pytest.mark.slow
@need_traces
@pytest.mark.parametrize("size", [0.25, 0.5, 0.75])
def test_belady_never_beaten_on_shared_traces(size):
    for p in TRACES:
        t = load_trace(p)
        st_ = simstream.prepare(t)
        res = {pol: sim.simulate(t, pol, size, stream=st_)["hits"] for pol in ALL}
        for pol, h in res.items():
            assert h <= res["g-opt"], (p.name, pol, size)
            if pol in LAYER_POLICIES:
                assert h <= res["opt"], (p.name, pol, size)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(traces(), st.sampled_from([0.25, 0.5, 0.75]))
def test_belady_never_beaten_random(tc, size):
    """MIN minimises misses over the whole replayed stream, so every access counts here
    (with prompt tokens interleaved among decode tokens, uncounted accesses could make a
    different schedule better on the counted ones; real traces have a prompt prefix)."""
    t, classes = tc
    t.is_prompt[:] = False
    try:
        res = {pol: fast(t, pol, size, classes, 0)[0] for pol in ALL}
    except simstream.SimulationError:
        assume(False)
    for pol, h in res.items():
        assert h <= res["g-opt"], pol
        if pol in LAYER_POLICIES:
            assert h <= res["opt"], pol


# ============================================================================ API details

def test_reference_catches_a_wrong_policy(monkeypatch):
    """The exact-match tests can fail: an LFU that may evict a pinned key (the token's own
    just-loaded expert) disagrees with the kernel, and so does an off-by-one capacity."""
    t = uniform_trace(T=400, L=2, E=8, k=3)
    assert fast(t, "lfu", 0.5) == ref_simulate(t, "lfu", 0.5)

    class NoPinLFU(RefLFU):
        def access(self, k, now, pinned):
            return super().access(k, now, {k})

    monkeypatch.setitem(REF, "lfu", NoPinLFU)
    assert fast(t, "lfu", 0.5) != ref_simulate(t, "lfu", 0.5)
    assert fast(t, "lru", 0.5) != fast(t, "lru", 0.625)


def test_capacities_match_daemon_plan_slots():
    arena = pytest.importorskip("moecached.engine.arena")
    E = 16
    classes = [list(range(0, 5)), list(range(5, 12)), [12]]
    idx = types.SimpleNamespace(n_experts=E, size_classes=[
        types.SimpleNamespace(id=i, layers=c) for i, c in enumerate(classes)])
    for S in (13, 50, 97, 100, 150, 13 * 16):
        caps, layer_caps, _ = simsizes.capacities(S, 13, E, classes)
        plan = arena.plan_slots(idx, slots=S)
        assert caps == [plan[i] for i in range(3)], S
        for ci, c in enumerate(classes):
            assert all(layer_caps[l] == caps[ci] // len(c) for l in c)


def test_fraction_sizes_round_half_up():
    caps, layer_caps, _ = simsizes.capacities(0.25, 4, 10, [[0, 1], [2, 3]])
    assert list(layer_caps) == [3, 3, 3, 3] and caps == [6, 6]   # 2.5 -> 3
    with pytest.raises(simstream.SimulationError, match="fraction in"):
        simsizes.capacities(1.5, 4, 10)


def test_too_small_size_is_refused():
    t = cyclic_trace(8, T=150)
    t.experts = np.concatenate([t.experts, (t.experts + 1) % 8], axis=2)
    with pytest.raises(simstream.SimulationError, match="expected >= 2"):
        sim.simulate(t, "lru", 1)


def test_no_decode_note_and_warmup():
    t = uniform_trace(T=400)
    t.is_prompt[:] = True
    r = sim.simulate(t, "g-lru", 0.5)
    assert r["warmup"] == 100 and r["counted_tokens"] == 300
    assert "no decode tokens" in r["note"] and "100" in r["note"]
    r = sim.simulate(t, "g-lru", 0.5, warmup=10)
    assert r["counted_tokens"] == 390


def test_only_decode_counts():
    t = uniform_trace(T=300)
    r = sim.simulate(t, "lru", 0.5)
    assert r["counted_tokens"] == 100 and r["accesses"] == 100 * 2 * 2
    assert r["note"] == ""


def test_step_union_counts_once():
    ex = np.array([[[0, 1]], [[1, 2]], [[3, 0]]], np.int16)
    t = Trace(experts=ex, is_prompt=np.zeros(3, bool), step=np.array([5, 5, 6], np.int32),
              meta={"n_experts": 4})
    r = sim.simulate(t, "lru", 4)
    assert r["accesses"] == 3 + 2 and r["hits"] == 1  # {0,1,2} then {3,0}


def test_lru_class_api_unchanged():
    lru = LRU(8)
    for k in (1, 2, 3):
        lru.insert(k)
    lru.insert(4, cold=True)
    assert lru.keys() == [3, 2, 1, 4] and lru.victim() == 4
    lru.pin(4)
    assert lru.victim() == 1 and lru.pinned == 1 and lru.pin_count(4) == 1
    lru.unpin(4)
    assert lru.touch(4) and lru.victim() == 1 and len(lru) == 4
    assert lru.contains(2) and lru.remove(2) and not lru.contains(2)


def _lru_state(lru, n):
    return lru.keys(), [lru.pin_count(k) for k in range(n)], lru.pinned


def test_lru_grant_resident_hit_path():
    n = 16
    lru = LRU(n)
    res = [-1] * n
    unused = bytearray(n)
    for k, slot in ((8 + 1, 5), (8 + 2, 6), (8 + 3, 7), (0 + 1, 9)):
        lru.insert(k)
        res[k] = slot
    res[8 + 4] = -1  # layer at base 8, expert 4: absent
    unused[8 + 3] = 1  # brought in by a prefetch, never demanded
    before = _lru_state(lru, n)
    # everything the general path must handle (or refuse) changes nothing here
    for bad in ([], [1, 4], [1, 1], [1, 8], [-1], [1, True], [1.0], [1, "2"],
                list(range(257))):
        assert lru.grant_resident(bad, 8, 8, res, unused, 3, 0) is None, bad
        assert _lru_state(lru, n) == before and unused[8 + 3] == 1
    assert lru.grant_resident([1], 8, 8, res[:4], unused, 3, 0) is None  # short res list
    keys, items, pf = lru.grant_resident([3, 1], 8, 8, res, unused, 3, 0)
    assert keys == [11, 9] and items == [(3, 3, 0, 7), (3, 1, 0, 5)] and pf == 1 and unused[11] == 0
    assert lru.keys()[:2] == [9, 11]               # touched in request order: last is hottest
    assert lru.pin_count(11) == 1 and lru.pin_count(9) == 1 and lru.pinned == 2
    keys2, _, pf2 = lru.grant_resident([1], 8, 8, res, unused, 3, 0)
    assert pf2 == 0 and lru.pin_count(9) == 2 and lru.pinned == 2
    # unpin_keys is all-or-nothing
    with pytest.raises(ValueError, match="holds no pin"):
        lru.unpin_keys([9, 10])
    with pytest.raises(ValueError, match="holds no pin"):
        lru.unpin_keys([11, 11])
    with pytest.raises(IndexError):
        lru.unpin_keys([99])
    assert lru.pin_count(9) == 2 and lru.pin_count(11) == 1
    lru.unpin_keys(keys)
    lru.unpin_keys(keys2)
    assert lru.pinned == 0 and [lru.pin_count(k) for k in range(n)] == [0] * n


def test_unknown_policy():
    with pytest.raises(ValueError, match="expected one of"):
        expand_policies("lru,nope")
    assert expand_policies("w-tinylfu,lru") == ["w-tinylfu-1", "w-tinylfu-10", "lru"]


@need_traces
def test_cli_json_layout_and_plot(tmp_path, capsys):
    trace = next(p for p in TRACES if "humaneval0" in p.name)
    layouts = shared_layouts_dir()
    layout = layouts / "mixtral-8x7b-Q4_K_M.json" if layouts is not None else None
    if layout is not None and not layout.exists():
        layout = None
    args = [str(trace), "--policies", "lru,g-lru,g-opt", "--sizes", "0.25,50%,0.125"]
    if layout is not None:
        args += ["--layout", str(layout), "--compute-ms", "20"]
    assert policy_main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    res = {(r["policy"], r["size"]): r for r in out[0]["results"]}
    assert "error" in res[("lru", 0.125)]              # 1 slot < top-2
    r = res[("g-lru", 0.5)]
    classes = simsizes.layout_bytes(layout)[1] if layout is not None else None
    assert r["hits"] == sim.simulate(trace, "g-lru", 0.5, per_class_layers=classes)["hits"]
    if layout is not None:
        assert r["bytes_per_token"] > 0 and r["tok_s_with_compute"] < r["drive_tok_s"]
    assert policy_main(args) == 0
    txt = capsys.readouterr().out
    assert "hit rate" in txt and "n/a" in txt
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    assert policy_main(args + ["--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_model_bytes_from_gguf(tmp_path, capsys):
    """--model: bytes per expert and size classes from the GGUF index."""
    model = make_model(tmp_path, "qwen3-30b-a3b-Q4_K_M", layers=8, experts=8)
    per, cls = simsizes.model_bytes(model)
    # Qwen3-30B Q4_K_M: Q6_K down experts in blocks 0-5, Q4_K in 6-7 -> two size classes
    assert sorted(map(sorted, cls)) == [[0, 1, 2, 3, 4, 5], [6, 7]]
    assert per[0] == 1290240 + 2 * 884736 and per[7] == 3 * 884736
    t = uniform_trace(T=300, L=8, E=8, k=2)
    save_path = tmp_path / "t.npz"
    from moecached.engine.trace import save_trace
    save_trace(save_path, t)
    assert policy_main([str(save_path), "--model", model, "--policies", "g-lru", "--sizes", "0.5",
                     "--json"]) == 0
    r = json.loads(capsys.readouterr().out)[0]["results"][0]
    assert r["class_caps"] == [24, 8]
    assert r["hits"] == sim.simulate(t, "g-lru", 0.5, per_class_layers=cls)["hits"]


# ============================================================================ the daemon's order

def test_set_hits_first_then_misses():
    """A set's resident experts are taken (touched, pinned) before its misses load, as the
    daemon's cache grants a request: a miss never evicts a hit of its own set."""
    # 3 slots, cold -> hot 0, 1, 2; then the set [3, 0]: 0 is a hit and pinned first, so the
    # miss 3 evicts 1 (taken one at a time, 3 would evict 0 and 0 would then miss too)
    ex = np.array([[[0, -1]], [[1, -1]], [[2, -1]], [[3, 0]], [[1, -1]]], np.int16)
    t = Trace(experts=ex, is_prompt=np.zeros(5, bool), meta={"n_experts": 4})
    for policy in ALL:                                  # every policy: 0 hits, 3 misses
        r = sim.simulate(truncate(t, 4), policy, 3, warmup=3)
        assert (r["hits"], r["accesses"]) == (1, 2), policy
        assert (r["hits"], r["accesses"]) == ref_simulate(truncate(t, 4), policy, 3, warmup=3)
    for policy in ("lru", "g-lru"):                     # and 3 evicted 1 (the coldest unpinned)
        assert fast(t, policy, 3, warmup=3) == (1, 3) == ref_simulate(t, policy, 3, warmup=3)


@pytest.mark.slow
@need_traces
@pytest.mark.parametrize("size", [0.25, 0.5])
def test_glru_equals_daemon_lru_model(size):
    """g-lru is the daemon bit for bit: replayplan.reference_lru (the daemon's LRU driven as
    ExpertCache._grant does, written independently of the kernels) gives the same hits."""
    from moecached.tools.replayplan import plan, step_sets
    for p in TRACES:
        t = load_trace(p)
        L, E = t.n_layers, t.n_experts
        classes = [list(range(0, L, 2)), list(range(1, L, 2))]
        for cls in (None, classes):
            pl = plan(t)
            sets = step_sets(pl.trace.experts, pl.steps)
            r = sim.simulate(pl.trace, "g-lru", size, per_class_layers=cls,
                             warmup=pl.sim_warmup)
            cl = cls or [list(range(L))]
            class_of = [next(ci for ci, c in enumerate(cl) if l in c) for l in range(L)]
            got = reference_lru(sets, pl.counted, class_of, r["class_caps"], E)
            assert got == (r["hits"], r["accesses"]), (p.name, size, cls)


def test_tokens_window(tmp_path, capsys):
    """tokens=N / --tokens N: the trace is cut right after its N-th counted token."""
    t = uniform_trace(T=400)                      # 200 prompt tokens, then decode
    r = sim.simulate(t, "g-lru", 0.5, tokens=30)
    assert r["counted_tokens"] == 30 and r["accesses"] == 30 * 2 * 2
    assert (r["hits"], r["accesses"]) == fast(truncate(t, 230), "g-lru", 0.5)
    assert simstream.window_end(t, 250, 30) == 280 and simstream.window_end(t, 0, 10 ** 6) == 400
    t.is_prompt[:] = True                         # prefill only: warmup + N
    assert sim.simulate(t, "lru", 0.5, warmup=10, tokens=7)["counted_tokens"] == 7
    assert simstream.window_end(t, 10, 7) == 17
    from moecached.engine.trace import save_trace
    save_trace(tmp_path / "t.npz", t)
    assert policy_main([str(tmp_path / "t.npz"), "--policies", "g-lru", "--sizes", "0.5",
                     "--warmup", "10", "--tokens", "7", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)[0]
    assert out["counted_tokens"] == 7
    assert out["results"][0]["hits"] == fast(truncate(t, 17), "g-lru", 0.5, warmup=10)[0]
    with pytest.raises(simstream.SimulationError, match="tokens"):
        policy_main([str(tmp_path / "t.npz"), "--tokens", "0"])


# -- CLI input validation (one-line errors, non-zero exit) -------------------------------------

def _ctl(argv, capsys):
    from moecached.tools import ctl
    rc = ctl.main(["policy"] + argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.fixture
def small_trace_file(tmp_path):
    from moecached.engine.trace import save_trace
    p = tmp_path / "u.npz"
    save_trace(p, uniform_trace(T=300, E=32))
    return str(p)


@pytest.mark.parametrize("sizes", ["1.5", "-1", "0", "0.0", "150%", "2.0", "nan", "inf", "1e3",
                                   "abc", "-0.25", "0.25,1.5"])
def test_cli_refuses_invalid_sizes(small_trace_file, capsys, sizes):
    rc, out, err = _ctl([small_trace_file, "--policies", "g-lru", f"--sizes={sizes}"], capsys)
    bad = [s for s in sizes.split(",") if s != "0.25"][0]
    assert rc == 1 and out == ""
    assert err == (f"moecache-ctl policy: error: --sizes {bad}: expected a fraction in (0, 1] "
                   f"(0.25 or 25%) or an integer slot count >= 1\n")


@pytest.mark.parametrize("sizes", ["", " , ", ","])
def test_cli_refuses_empty_size_list(small_trace_file, capsys, sizes):
    rc, out, err = _ctl([small_trace_file, "--policies", "g-lru", f"--sizes={sizes}"], capsys)
    assert rc == 1 and out == "" and err.count("\n") == 1
    assert "--sizes" in err and "found no sizes" in err and "Traceback" not in err


def test_cli_refuses_fraction_of_zero_slots(small_trace_file, capsys):
    rc, out, err = _ctl([small_trace_file, "--policies", "g-lru", "--sizes", "0.0001"], capsys)
    assert rc == 1 and out == "" and err.count("\n") == 1
    assert "--sizes 0.0001: 0.0001 x 32 experts = 0 slots per layer" in err
    assert "expected a fraction >= 0.015625" in err
    # 0.015625 x 32 = 0.5 -> rounds half up to 1 slot per layer: valid (lru: n/a for top-2)
    rc, out, err = _ctl([small_trace_file, "--policies", "lru", "--sizes", "0.015625"], capsys)
    assert rc == 0 and err == "" and "n/a: size 0.015625 " in out


@pytest.mark.parametrize("policies", ["", ",", " , "])
def test_cli_refuses_empty_policy_list(small_trace_file, capsys, policies):
    rc, out, err = _ctl([small_trace_file, f"--policies={policies}"], capsys)
    assert rc == 1 and out == "" and err.count("\n") == 1
    assert "--policies" in err and "found no policies" in err


def test_cli_valid_but_too_small_size_is_na_and_explained(small_trace_file, capsys):
    rc, out, err = _ctl([small_trace_file, "--policies", "g-lru", "--sizes", "1,0.5"], capsys)
    assert rc == 0 and err == ""
    row = next(l for l in out.splitlines() if l.startswith("g-lru"))
    assert row.split()[1] == "n/a" and row.split()[2].endswith("%")
    foot = [l for l in out.splitlines() if l.startswith("n/a: ")]
    assert len(foot) == 1 and "size 1 " in foot[0] and "expected >= 2" in foot[0]
    assert "too small" in foot[0]


def test_cli_sizes_deduplicated(small_trace_file, capsys):
    rc, out, _ = _ctl([small_trace_file, "--policies", "g-lru", "--sizes", "0.5,50%,0.5"], capsys)
    assert rc == 0
    assert out.splitlines()[1].split() == ["hit", "rate", "50%"]


def test_cli_empty_trace_says_no_counted_accesses(tmp_path, capsys):
    from moecached.engine.trace import save_trace
    p = tmp_path / "empty.npz"
    save_trace(p, Trace(experts=np.zeros((0, 4, 2), np.int16), is_prompt=np.zeros(0, bool),
                        meta={"n_experts": 8}))
    rc, out, err = _ctl([str(p), "--policies", "g-lru,lru", "--sizes", "0.5"], capsys)
    assert rc == 0 and err == ""
    assert "nan" not in out.lower()
    assert "no counted accesses: the trace has no tokens" in out
    rc, out, _ = _ctl([str(p), "--policies", "g-lru", "--sizes", "0.5", "--json"], capsys)
    assert rc == 0 and "NaN" not in out
    assert json.loads(out)[0]["results"][0]["hit_rate"] is None
    # a prefill-only trace whose tokens are all warm-up: nothing counted either
    ex = np.tile(np.array([0, 1], np.int16), (3, 2, 1))
    save_trace(p, Trace(experts=ex, is_prompt=np.ones(3, bool), meta={"n_experts": 8}))
    rc, out, _ = _ctl([str(p), "--policies", "g-lru", "--sizes", "0.5", "--warmup", "3"],
                      capsys)
    assert rc == 0 and "nan" not in out.lower() and "no counted accesses: none of its 3" in out


def test_cli_not_a_trace(tmp_path, capsys):
    p = tmp_path / "passwd"
    p.write_text("root:x:0:0:root:/root:/bin/bash\n")
    rc, out, err = _ctl([str(p)], capsys)
    assert rc == 1 and out == ""
    assert err == (f"moecache-ctl policy: error: {p}: not a trace: expected a .npz archive "
                   f"(docs/trace-format.md)\n")
