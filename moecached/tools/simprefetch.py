"""Prefetch in the simulator: the daemon's LRU with a predictor's prefetch before every set.

``moecache-ctl policy TRACE --predictor P [--lookahead N] [--seed S]``. Owns the predictors
(:func:`parse_predictor`: ``oracle``, ``noisy:RECALL,EXTRA``, ``cooc`` learned online) and the
prefetch replay (:func:`simulate_prefetch`): demand hits, prefetch hits, wasted prefetches and
reads per token against no prefetch (``docs/policies.md``, "Prefetch replay").
"""
from __future__ import annotations

import shlex
from typing import Optional

import numpy as np

from moecached.engine.policy import LRU
from moecached.tools.simsizes import class_of_layer, layer_classes
from moecached.tools.simstream import SimulationError, Stream, prepare
from moecached.tools.simulate import simulate

__all__ = ["parse_predictor", "simulate_prefetch", "PREDICTORS_EXPECTED"]

PREDICTORS_EXPECTED = "expected oracle, noisy:RECALL,EXTRA (e.g. noisy:0.8,0.5) or cooc"


def parse_predictor(text: str) -> tuple:
    """``--predictor``: ``oracle`` | ``noisy:RECALL,EXTRA`` | ``cooc`` -> (name, recall, extra).
    SimulationError (one line) otherwise."""
    t = (text or "").strip()
    if t in ("oracle", "cooc"):
        return (t, 1.0, 0.0)
    if t.startswith("noisy:"):
        try:
            r, x = (float(v) for v in t[6:].split(","))
        except ValueError:
            raise SimulationError(f"--predictor {shlex.quote(t)}: {PREDICTORS_EXPECTED}") from None
        if not (0.0 <= r <= 1.0 and 0.0 <= x <= 64.0):
            raise SimulationError(f"--predictor {shlex.quote(t)}: expected 0 <= RECALL <= 1 and "
                                  f"0 <= EXTRA <= 64 (wrong experts per true one)")
        return ("noisy", r, x)
    raise SimulationError(f"--predictor {shlex.quote(t)}: {PREDICTORS_EXPECTED}")


def _predict(pred, st: Stream, sets: list, lookahead: int, seed: int):
    """Per set s, the keys prefetched at its start: a prediction of set ``s + lookahead - 1``
    (the next sets in stream order: this layer's with lookahead 1, the next layer's with 2...).
    ``oracle``: that set; ``noisy``: each of its keys kept with probability RECALL, plus
    EXTRA x its size wrong keys of its layer (seeded); ``cooc``: experts of the target's layer
    most often routed in the same step as the previous set's experts were (learned online from
    the sets already replayed: a (set, set + lookahead) pair counts once it is complete), as
    many as the previous set holds, ties lower id first. A generator: ``cooc`` learns as the
    replay goes, so the caller must consume set s before asking for s + 1."""
    name, recall, extra = pred
    S, E = len(sets), st.n_experts
    rng = np.random.default_rng(seed)
    counts: dict = {}
    for s in range(S):
        tgt = s + lookahead - 1
        if tgt >= S:
            yield []
            continue
        lt = int(st.set_layer[tgt])
        if name == "oracle":
            yield sets[tgt]
        elif name == "noisy":
            true = sets[tgt]
            keep = [k for k in true if rng.random() < recall]
            want = extra * len(true)
            nw = int(want) + (1 if rng.random() < want - int(want) else 0)
            others = np.setdiff1d(np.arange(lt * E, (lt + 1) * E), true)
            wrong = rng.choice(others, size=min(nw, len(others)), replace=False).tolist() \
                if nw and len(others) else []
            yield keep + [int(k) for k in wrong]
        else:   # cooc
            src = s - 1
            out = []
            if src >= 0:
                ls = int(st.set_layer[src])
                c = counts.get((ls, lt))
                if c is not None:
                    score = c[[k - ls * E for k in sets[src]]].sum(axis=0)
                    order = np.argsort(-score, kind="stable")[:len(sets[src])]
                    out = [lt * E + int(e) for e in order if score[e] > 0]
            yield out
        # learn the pair (s + 1 - lookahead, s + 1) once set s + 1 ... is known: here set s is
        # done (the caller replayed it before asking again), so pair (s - lookahead, s) is
        a = s - lookahead
        if name == "cooc" and a >= 0:
            la, lb = int(st.set_layer[a]), int(st.set_layer[s])
            c = counts.setdefault((la, lb), np.zeros((E, E), np.int64))
            ea = np.array([k - la * E for k in sets[a]])
            eb = np.array([k - lb * E for k in sets[s]])
            c[np.ix_(ea, eb)] += 1


def simulate_prefetch(trace, size, predictor="oracle", lookahead: int = 1, per_class_layers=None,
                      warmup: Optional[int] = None, tokens: Optional[int] = None,
                      bytes_per_expert=None, seed: int = 0, stream: Optional[Stream] = None) -> dict:
    """Replay ``trace`` through the daemon's LRU (``g-lru``, one budget per size class) with a
    prefetch before every set, as ``ExpertCache.prefetch`` does it: at the start of set s the
    predictor's keys for set ``s + lookahead - 1`` (:func:`_predict`) that are not resident are
    loaded at the cold end and marked unused (a full budget evicts its coldest unpinned key);
    then the set is granted (hits touched; an unused one is a *prefetch hit*; misses loaded hot).
    An unused key evicted is a *wasted* prefetch. A prefetch's read is taken to land just
    before its target set, after the next prefetch was issued: until then it stays pinned, as
    the daemon's load pins its slot (so the sets in between cannot evict it); a prefetch that
    would leave fewer unpinned slots than the largest set of the trace is dropped (the
    daemon's demand reads go first).

    Returns:
        dict: predictor, lookahead, size, demand_hits, prefetch_hits, misses, accesses,
        served_rate ((demand + prefetch hits) / accesses), hit_rate_no_prefetch (g-lru),
        prefetches (reads), wasted (prefetches evicted unused), reads_per_token ((misses +
        prefetches) / counted tokens), reads_per_token_no_prefetch, wasted_per_token; with
        ``bytes_per_expert`` also wasted_bytes_per_token and bytes_per_token. Counted sets only
        (as :func:`simulate`): a wasted prefetch counts in the set whose load evicted it.
    Raises:
        SimulationError: bad predictor or lookahead, size too small (as :func:`simulate`).
    """
    pred = parse_predictor(predictor) if isinstance(predictor, str) else predictor
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or not 1 <= lookahead <= 64:
        raise SimulationError(f"lookahead: found {lookahead!r}, expected 1..64 (1: the layer about "
                              f"to run, 2: the next one)")
    st = stream if stream is not None else prepare(trace, warmup, tokens)
    L, E = st.n_layers, st.n_experts
    base = simulate(trace, "g-lru", size, per_class_layers, stream=st,
                    bytes_per_expert=bytes_per_expert)
    cls = layer_classes(per_class_layers, L)
    class_of = class_of_layer(cls, L)
    caps = base["class_caps"]
    lrus = [LRU(L * E) for _ in cls]
    unused = bytearray(L * E)
    bpe = None if bytes_per_expert is None else np.asarray(bytes_per_expert, np.float64)
    S = len(st.set_layer)
    sets = [st.keys[st.set_start[s]:st.set_start[s + 1]].tolist() for s in range(S)]
    dh = ph = miss = acc = pf = wasted = 0
    reserve = int(st.max_set.max()) if len(st.max_set) else 1
    inflight: dict = {}
    wasted_b = read_b = 0.0

    def make_room(lru, cap, counted):
        nonlocal wasted, wasted_b
        if len(lru) < cap:
            return True
        v = lru.victim()
        if v < 0:
            return False
        lru.remove(v)
        if unused[v]:
            unused[v] = 0
            if counted:
                wasted += 1
                if bpe is not None:
                    wasted_b += bpe[v // E]
        return True

    preds = _predict(pred, st, sets, lookahead, seed)
    for s in range(S):
        counted = bool(st.set_counted[s])
        tgt = s + lookahead - 1
        for k in next(preds):                      # the prefetch, before the set
            g = int(class_of[k // E])
            lru = lrus[g]
            if lru.contains(k) or lru.pinned + reserve >= caps[g] or \
                    not make_room(lru, caps[g], counted):
                continue
            lru.insert(k, True)
            lru.pin(k)
            inflight.setdefault(tgt, []).append(k)
            unused[k] = 1
            if counted:
                pf += 1
                if bpe is not None:
                    read_b += bpe[k // E]
        for k in inflight.pop(s, ()):              # reads for this set landed
            lrus[int(class_of[k // E])].unpin(k)
        keys = sets[s]
        g = int(class_of[int(st.set_layer[s])])
        lru = lrus[g]
        hits = [k for k in keys if lru.contains(k)]
        for k in hits:
            lru.touch(k)
            lru.pin(k)
            if unused[k]:
                unused[k] = 0
                ph += counted
            else:
                dh += counted
        for k in keys:
            if k in hits:
                continue
            make_room(lru, caps[g], counted)
            lru.insert(k)
            lru.pin(k)
            if counted:
                miss += 1
                if bpe is not None:
                    read_b += bpe[k // E]
        for k in keys:
            lru.unpin(k)
        acc += len(keys) if counted else 0
    T = st.counted_tokens
    nan = float("nan")
    out = dict(predictor=predictor if isinstance(predictor, str) else pred[0],
               lookahead=lookahead, size=size, demand_hits=dh, prefetch_hits=ph, misses=miss,
               accesses=acc, served_rate=(dh + ph) / acc if acc else nan,
               hit_rate_no_prefetch=base["hit_rate"], prefetches=pf, wasted=wasted,
               reads_per_token=(miss + pf) / T if T else nan,
               reads_per_token_no_prefetch=base["misses"] / T if T else nan,
               wasted_per_token=wasted / T if T else nan, counted_tokens=T, note=st.note)
    if bpe is not None:
        out["wasted_bytes_per_token"] = wasted_b / T if T else nan
        out["bytes_per_token"] = read_b / T if T else nan
    return out

