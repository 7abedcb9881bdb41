"""Cache-policy simulator: replay routing traces through eviction policies.

``moecache-ctl policy TRACE... [--policies LIST] [--sizes LIST] [--layout JSON | --model GGUF]
[--gbps X] [--compute-ms X] [--warmup N] [--tokens N] [--json] [--plot PNG]`` (its command line:
``moecached.tools.policycli``, above this module and ``mixsim``)

Access model (exact rules in ``docs/policies.md``): tokens are grouped into steps (one token
each unless the trace has ``step``); for each step and each MoE layer in order, the union of
the step's experts in that layer (first-appearance order, ``-1`` skipped) is accessed together,
as the daemon's cache grants one request: first the experts of the set that are resident (hits,
in set order), then the others (misses, in set order), each loaded, evicting the policy's victim
when the budget is full; every accessed expert stays pinned until the whole set is done, so a
miss never evicts an expert of its own set. ``g-lru`` (and ``lru`` for the daemon's per-layer
mode) is the daemon's hit count exactly. Prompt tokens warm the cache; only decode tokens
count. A trace without decode tokens counts every token after a warm-up prefix (default
``min(256, T // 4)``), and the result says so in ``note``. ``tokens=N`` (``--tokens N``) cuts
the trace right after its N-th counted token (:func:`window_end`; ``moecache-ctl replay``'s
window), so the simulator can reproduce a replay or demo run.

Sizes -> slots (capacity is in expert slots):
  * a float fraction ``f`` (CLI: has a ``.`` or ends in ``%``): ``s = round_half_up(f * E)``
    slots for every layer; a size class with ``n`` layers gets ``s * n`` slots.
  * an int ``S`` (CLI: plain integer): ``S`` slots in all, split over size classes exactly as
    the daemon does (``moecached.engine.arena.plan_slots``: the largest fraction ``f`` with
    ``sum_c floor(f * n_c * E) <= S``; class c gets ``floor(f * n_c * E)``); per-layer policies
    give each layer of a class ``class_slots // n_c`` (as the cache's ``per-layer`` mode).
Per-layer policies (``lru lfu slru opt``) have a budget per layer; the others one per class.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

import numpy as np

from moecached import MoecacheError
from moecached.engine.policy import (G_LFU_HALVE_EVERY, NEEDS_FUTURE, POLICIES, SCAN_ADMITS, build_stream,
                      expand_policies, make_policy, next_use, replay, replay_subst)
from moecached.engine.trace import Trace, load_trace

__all__ = ["SimulationError", "Stream", "prepare", "window_end", "capacities", "simulate",
           "SubstView", "subst_view", "simulate_subst", "SUBST_VIEW", "SUBST_VIEW_RECORDED", "simulate_prefetch",
           "parse_predictor",
           "layout_bytes", "model_bytes", "DEFAULT_GBPS", "HALVE_EVERY"]

DEFAULT_GBPS = 3.7
HALVE_EVERY = G_LFU_HALVE_EVERY   # re-exported; defined in moecached.engine.policy


class SimulationError(MoecacheError, ValueError):
    """Bad simulator input (size too small for a layer's experts, bad classes, ...)."""


@dataclass
class Stream:
    """A trace flattened into the access stream (see ``moecached.engine.policy.build_stream``).

    keys int64 [A] (key = layer * E + expert), set_start int64 [S+1], set_layer int64 [S],
    set_counted uint8 [S], set_tokens_before int64 [S] (tokens of earlier steps), set_prompt
    uint8 [S] (the set's step holds prompt tokens only),
    max_set int64 [L] (largest set per layer), counted_tokens, warmup (tokens), note.
    """
    keys: np.ndarray
    set_start: np.ndarray
    set_layer: np.ndarray
    set_counted: np.ndarray
    set_tokens_before: np.ndarray
    max_set: np.ndarray
    n_layers: int
    n_experts: int
    n_tokens: int
    counted_tokens: int
    warmup: int
    note: str
    set_prompt: Optional[np.ndarray] = None   # uint8 [S]: the set's step has only prompt tokens
    _next_use: Optional[np.ndarray] = None

    @property
    def next_use(self) -> np.ndarray:
        if self._next_use is None:
            self._next_use = next_use(self.keys, self.n_layers * self.n_experts)
        return self._next_use


def window_end(trace: Trace, warmup: int, tokens: int) -> int:
    """End (exclusive token index) of the window that holds the first ``tokens`` counted
    tokens: the index after the ``tokens``-th decode token at index >= ``warmup`` when the
    trace has decode tokens, else ``warmup + tokens``; capped at the trace's length. This is
    ``moecache-ctl replay``'s ``--tokens`` window (a step cut by it keeps its first tokens).
    Raises SimulationError when ``tokens < 1``."""
    if tokens < 1:
        raise SimulationError(f"tokens: found {tokens}, expected >= 1")
    T = trace.n_tokens
    if trace.n_decode > 0:
        dec = np.flatnonzero(~np.asarray(trace.is_prompt, bool))
        dec = dec[dec >= warmup]
        return T if tokens >= len(dec) else int(dec[tokens - 1]) + 1
    return min(T, warmup + tokens)


def prepare(trace, warmup: Optional[int] = None, tokens: Optional[int] = None) -> Stream:
    """Build the access stream of ``trace`` (a Trace or a path).

    Args:
        warmup: tokens at the start that never count. Default: 0 when the trace has decode
            tokens (prompt tokens never count anyway), else ``min(256, T // 4)`` (T of the
            whole trace, also with ``tokens``).
        tokens: when given, only the first :func:`window_end` ``(trace, warmup, tokens)``
            tokens are replayed: counting stops after ``tokens`` counted tokens (fewer when
            the trace ends first).
    Counted steps: first token index >= warmup and, when the trace has decode tokens, at least
    one decode token in the step.
    """
    t = load_trace(trace) if not isinstance(trace, Trace) else trace.validate()
    T = t.n_tokens
    has_decode = t.n_decode > 0
    if warmup is None:
        warmup = 0 if has_decode else min(256, T // 4)
    if warmup < 0:
        raise SimulationError(f"warmup: found {warmup}, expected >= 0 tokens")
    end = T if tokens is None else window_end(t, warmup, tokens)
    if end < T:
        t = t.window(0, end)
    T, L, E = t.n_tokens, t.n_layers, t.n_experts
    step_start = t.step_starts()
    starts = step_start[:-1]
    ex = np.ascontiguousarray(t.experts, dtype=np.int16)
    keys, ss, sl, st = build_stream(ex, step_start, E)
    decode = ~t.is_prompt
    step_has_decode = np.logical_or.reduceat(decode, starts) if T else np.zeros(0, bool)
    step_ok = step_start[:-1] >= warmup
    if has_decode:
        step_ok &= step_has_decode
    counted = step_ok[st].astype(np.uint8)
    tokens_before = step_start[:-1][st].astype(np.int64)
    sizes = np.diff(ss)
    max_set = np.zeros(L, np.int64)
    if len(sl):
        np.maximum.at(max_set, sl, sizes)
    ntok = np.diff(step_start)
    counted_tokens = int(ntok[step_ok].sum())
    if has_decode:
        note = "" if warmup == 0 else f"decode tokens after a warm-up prefix of {warmup} tokens"
    else:
        note = (f"no decode tokens: counting all {counted_tokens} tokens after a warm-up "
                f"prefix of {min(warmup, T)} tokens")
    set_prompt = (~step_has_decode[st]).astype(np.uint8)
    return Stream(keys=keys, set_start=ss, set_layer=sl, set_counted=counted,
                  set_tokens_before=tokens_before, max_set=max_set, n_layers=L, n_experts=E,
                  n_tokens=T, counted_tokens=counted_tokens, warmup=warmup, note=note,
                  set_prompt=set_prompt)


def _classes(per_class_layers, L):
    if per_class_layers is None:
        return [list(range(L))]
    cls = [list(map(int, c)) for c in per_class_layers]
    flat = sorted(x for c in cls for x in c)
    if flat != list(range(L)) or any(not c for c in cls):
        raise SimulationError(f"per_class_layers: found {cls}, expected non-empty lists that "
                              f"partition the trace layers 0..{L - 1}")
    return cls


def capacities(size, n_layers: int, n_experts: int, per_class_layers=None):
    """Slots for ``size`` (see module docstring).

    Returns:
        (class_caps list[int] per class, layer_caps int64 [n_layers], description str).
    Raises:
        SimulationError: size <= 0, a float above 1, a non-number.
    """
    cls = _classes(per_class_layers, n_layers)
    E = n_experts
    layer_caps = np.zeros(n_layers, np.int64)
    if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, float, np.integer,
                                                                   np.floating)):
        raise SimulationError(f"size: found {size!r}, expected a fraction (float) or slots (int)")
    if isinstance(size, (float, np.floating)):
        if not 0 < size <= 1:
            raise SimulationError(f"size: found {size}, expected a fraction in (0, 1]")
        s = int(math.floor(size * E + 0.5))
        layer_caps[:] = s
        class_caps = [s * len(c) for c in cls]
        desc = f"{size:g} x {E} = {s} slots/layer"
    else:
        S = int(size)
        if S < 1:
            raise SimulationError(f"size: found {S} slots, expected >= 1")
        weights = [len(c) * E for c in cls]
        cands = sorted({Fraction(k, w) for w in set(weights) for k in range(1, w + 1)})
        best = Fraction(0)
        lo, hi = 0, len(cands) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            if sum(int(cands[mid] * w) for w in weights) <= S:
                best = cands[mid]
                lo = mid + 1
            else:
                hi = mid - 1
        class_caps = [int(best * w) for w in weights]
        for c, cap in zip(cls, class_caps):
            layer_caps[c] = cap // len(c)
        desc = f"{S} slots -> {sum(class_caps)} used ({'/'.join(map(str, class_caps))} per class)"
    return class_caps, layer_caps, desc


def simulate(trace, policy: str, size, per_class_layers=None, warmup: Optional[int] = None,
             bytes_per_expert=None, stream: Optional[Stream] = None,
             tokens: Optional[int] = None, admit_cold=None, scan_admit: str = "cold") -> dict:
    """Replay ``trace`` through ``policy`` at cache ``size``.

    Args:
        trace: Trace or path (ignored when ``stream`` from :func:`prepare` is given).
        policy: a name of ``moecached.engine.policy.POLICIES`` (e.g. ``"g-lru"``, the daemon's).
        size: float fraction of each layer's experts, or int total slots (module docstring).
        per_class_layers: list of lists of trace-layer indices, one list per size class;
            ``class`` policies get one budget per class, exactly like the daemon. Default: one
            class holding every layer.
        warmup, tokens: see :func:`prepare`.
        bytes_per_expert: optional sequence [n_layers] of bytes read per expert miss.
        admit_cold: scan-resistant admission (``lru``/``g-lru`` only): ``"prompt"`` inserts
            the misses of steps holding only prompt tokens at the cold end, an int ``N`` those
            of sets (one layer of one step) wider than ``N`` experts; None: all hot.
        scan_admit: where ``admit_cold`` puts those misses: ``"cold"`` (the cold end) or
            ``"probation"`` (the probation point: ``LRU.insert_probation``), as the daemon's
            ``scan_admit``.
    Returns:
        dict: policy, scope, size, slots (total), class_caps, hits, accesses, misses, hit_rate
        (hits / accesses, nan when nothing counted), hits_per_layer, accesses_per_layer,
        counted_tokens, warmup, note, seconds (replay time); with ``bytes_per_expert`` also
        bytes_per_token.
    Raises:
        SimulationError: a budget smaller than the experts one step routes to one layer (they
        must all be resident together), bad size or classes. ValueError: unknown policy.
    """
    st = stream if stream is not None else prepare(trace, warmup, tokens)
    L, E = st.n_layers, st.n_experts
    scope = POLICIES[expand_policies([policy])[0]][0]
    cls = _classes(per_class_layers, L)
    class_caps, layer_caps, desc = capacities(size, L, E, cls)
    if scope == "layer":
        group = np.repeat(np.arange(L, dtype=np.int64), E)
        caps = layer_caps
        need = st.max_set
        for l in range(L):
            if caps[l] < max(need[l], 1):
                raise SimulationError(
                    f"size {size} ({desc}): layer {l} gets {caps[l]} slots, expected >= "
                    f"{max(need[l], 1)} (too small: one step routes that many experts to the "
                    f"layer, and they must be resident together)")
    else:
        class_of_layer = np.zeros(L, np.int64)
        for ci, c in enumerate(cls):
            class_of_layer[c] = ci
        group = np.repeat(class_of_layer, E)
        caps = np.array(class_caps, np.int64)
        for ci, c in enumerate(cls):
            need = max(int(st.max_set[c].max()), 1)
            if caps[ci] < need:
                raise SimulationError(f"size {size} ({desc}): size class {ci} gets {caps[ci]} "
                                      f"slots, expected >= {need} (too small: one step routes "
                                      f"that many experts to one of its layers, and they must "
                                      f"be resident together)")
    pol = make_policy(policy, group, caps, st.next_use if policy in NEEDS_FUTURE else None)
    t0 = time.perf_counter()
    cold = cold_sets(st, admit_cold)
    if cold is not None and policy not in ADMITS_COLD:
        raise SimulationError(f"admit_cold: policy {policy} has no cold admission, expected "
                              f"one of {', '.join(ADMITS_COLD)}")
    if scan_admit not in SCAN_ADMITS:
        raise SimulationError(f"scan_admit: found {scan_admit!r}, expected one of "
                              f"{', '.join(SCAN_ADMITS)}")
    hits, acc = replay(pol, st.keys, st.set_start, st.set_layer, st.set_counted,
                       st.set_tokens_before, L, cold, scan_admit)
    dt = time.perf_counter() - t0
    H, A = int(hits.sum()), int(acc.sum())
    out = dict(policy=policy, scope=scope, size=size, size_desc=desc,
               slots=int(caps.sum()), class_caps=[int(x) for x in class_caps],
               hits=H, accesses=A, misses=A - H, hit_rate=(H / A) if A else float("nan"),
               hits_per_layer=hits.tolist(), accesses_per_layer=acc.tolist(),
               counted_tokens=st.counted_tokens, warmup=st.warmup, note=st.note,
               seconds=dt, stream_accesses=int(len(st.keys)), admit_cold=admit_cold,
               scan_admit=scan_admit)
    if bytes_per_expert is not None:
        b = np.asarray(bytes_per_expert, dtype=np.float64)
        if b.shape != (L,):
            raise SimulationError(f"bytes_per_expert: found {b.shape[0] if b.ndim else b} "
                                  f"layers, expected {L} (the trace's MoE layers)")
        miss = (acc - hits).astype(np.float64)
        out["bytes_per_token"] = float(miss @ b / st.counted_tokens) if st.counted_tokens \
            else float("nan")
    return out


# ----------------------------------------------------------------------------- substitution

SUBST_VIEW = ("top k/2 routed, ranks k/2+1..k candidates (score = gate weight); the trace's "
              "other experts are ignored")
SUBST_VIEW_RECORDED = ("the trace's own: every expert routed (score = recorded router score), "
                       "the recorded candidates offered (score = their recorded scores)")


@dataclass
class SubstView:
    """A trace seen as routed experts + candidates (:func:`subst_view`): ``stream`` holds the
    routed experts (the first ``top_k // 2`` ranks) as an ordinary :class:`Stream`;
    ``key_score`` float64 [A] their scores; per set s the candidates
    ``cand_keys[cand_start[s]:cand_start[s+1]]`` (ranks ``top_k // 2 .. top_k - 1`` of the
    step's tokens, not routed in s, first-appearance order) with ``cand_score``. A key's score
    in a set is its largest gate weight over the step's tokens. A trace carrying ``candidates``
    is seen as recorded instead: every expert routed, scores from ``scores``, candidates from
    ``candidates`` / ``candidate_scores``; ``view`` says which."""
    trace: Trace
    stream: Stream
    key_score: np.ndarray
    cand_start: np.ndarray
    cand_keys: np.ndarray
    cand_score: np.ndarray
    routed: int
    view: str = SUBST_VIEW


def subst_view(trace, warmup: Optional[int] = None, tokens: Optional[int] = None) -> SubstView:
    """Build the substitution view of ``trace`` (a Trace or a path; needs ``weights`` and
    ``top_k >= 2``, or recorded ``candidates``); ``warmup``/``tokens`` as in :func:`prepare`.
    SimulationError otherwise."""
    t = load_trace(trace) if not isinstance(trace, Trace) else trace.validate()
    if t.candidates is not None:
        return _recorded_view(t, warmup, tokens)
    if t.weights is None:
        raise SimulationError("substitution needs gate weights: the trace has no 'weights' "
                              "array (only traces that recorded them can be substituted)")
    K = t.top_k
    if K < 2:
        raise SimulationError(f"substitution needs top_k >= 2 (routed = top k/2, candidates = "
                              f"the rest): found top_k {K}")
    h = K // 2
    tv = Trace(experts=np.ascontiguousarray(t.experts[:, :, :h]), is_prompt=t.is_prompt,
               weights=np.ascontiguousarray(t.weights[:, :, :h]), step=t.step,
               meta={k: v for k, v in t.meta.items() if k != "top_k"} | {"n_experts": t.n_experts})
    ex, w = t.experts, t.weights

    def scores(tok, l):
        best, cand = {}, {}
        for rk in range(K):
            e = int(ex[tok, l, rk])
            if e >= 0:
                d = best if rk < h else cand
                d[e] = max(d.get(e, 0.0), float(w[tok, l, rk]))
        return best, cand
    return _build_view(t, tv, warmup, tokens, scores, routed=h, view=SUBST_VIEW)


def _build_view(t: Trace, tv: Trace, warmup, tokens, scores, routed: int, view: str) -> SubstView:
    """The :class:`SubstView` of ``tv`` (the routed experts of ``t``): per set, the largest
    score over the step's tokens of each routed key and of each candidate not routed in it.
    ``scores(tok, layer) -> (routed, candidates)``, dicts expert -> score of one token; a
    token's dicts are merged in token order (candidates keep first-appearance order)."""
    st = prepare(tv, warmup, tokens)
    T, E = st.n_tokens, st.n_experts
    step_start = t.window(0, T).step_starts()
    S = len(st.set_layer)
    key_score = np.zeros(len(st.keys), np.float64)
    cand_start = np.zeros(S + 1, np.int64)
    ck, cs = [], []
    steps = np.searchsorted(step_start, st.set_tokens_before)
    for s in range(S):
        l = int(st.set_layer[s])
        j = int(steps[s])
        best, cand = {}, {}
        for tok in range(int(step_start[j]), int(step_start[j + 1])):
            tb, tc = scores(tok, l)
            for e, v in tb.items():
                best[e] = max(best.get(e, 0.0), v)
            for e, v in tc.items():
                cand[e] = max(cand.get(e, 0.0), v)
        for i in range(int(st.set_start[s]), int(st.set_start[s + 1])):
            key_score[i] = best[int(st.keys[i]) - l * E]
        for e, v in cand.items():
            if e not in best:
                ck.append(l * E + e)
                cs.append(v)
        cand_start[s + 1] = len(ck)
    return SubstView(trace=tv, stream=st, key_score=key_score, cand_start=cand_start,
                     cand_keys=np.array(ck, np.int64), cand_score=np.array(cs, np.float64),
                     routed=routed, view=view)


def _recorded_view(t: Trace, warmup, tokens) -> SubstView:
    """:func:`subst_view` of a trace with recorded ``scores``/``candidates``: the routed
    experts are ``experts`` (score: the largest recorded score over the step's tokens), the
    candidates of a set are the step's recorded candidates not routed in it (first-appearance
    order, largest recorded score)."""
    tv = Trace(experts=t.experts, is_prompt=t.is_prompt, weights=t.weights, step=t.step,
               meta=dict(t.meta, n_experts=t.n_experts))
    ex, sc, cx, cw = t.experts, t.scores, t.candidates, t.candidate_scores

    def scores(tok, l):
        best, cand = {}, {}
        for e, v in zip(ex[tok, l].tolist(), sc[tok, l].tolist()):
            if e >= 0:
                best[e] = max(best.get(e, 0.0), v)
        for e, v in zip(cx[tok, l].tolist(), cw[tok, l].tolist()):
            if e >= 0:
                cand[e] = max(cand.get(e, 0.0), v)
        return best, cand
    return _build_view(t, tv, warmup, tokens, scores, routed=t.top_k, view=SUBST_VIEW_RECORDED)


def simulate_subst(view: SubstView, policy: str, size, r: float, max_swaps: int = -1,
                   per_class_layers=None, refresh: bool = False) -> dict:
    """Replay ``view`` (:func:`subst_view`) through online ``policy`` at ``size`` with
    substitution at tolerance ``r`` and at most ``max_swaps`` swaps per set (< 0: no cap), and
    ``g-lru`` and ``g-opt`` without substitution on the same view. ``refresh``: every resident
    candidate of a set is accessed too, so eviction keeps experts likely to substitute.

    Returns:
        dict: policy, size, r, max_swaps, view, hits, substituted, accesses, hit_rate (hits /
        accesses), served_rate ((hits + substituted) / accesses: the routed experts served
        from the cache, as asked or by a substitute), g_lru and g_opt (hit rates on the view),
        gap_closed ((served_rate - g_lru) / (g_opt - g_lru); nan when g-opt = g-lru).
    Raises:
        SimulationError: policy needs the future (opt, g-opt), bad r, size too small.
    """
    if policy in NEEDS_FUTURE:
        raise SimulationError(f"--subst: policy {policy} needs the future; substitution "
                              f"replays online policies (e.g. g-lru)")
    if not (isinstance(r, (int, float)) and 0.0 <= r <= 1.0):
        raise SimulationError(f"--subst {r}: expected a tolerance 0 <= r <= 1")
    st = view.stream
    base = {p: simulate(view.trace, p, size, per_class_layers, stream=st)
            for p in ("g-lru", "g-opt")}
    ref = simulate(view.trace, policy, size, per_class_layers, stream=st)  # checks the size
    pol = make_policy(policy, *_groups(policy, ref, st, per_class_layers))
    hits, acc, sub = replay_subst(pol, st.keys, view.key_score, st.set_start, st.set_layer,
                                  st.set_counted, st.set_tokens_before, st.n_layers,
                                  view.cand_start, view.cand_keys, view.cand_score, r,
                                  max_swaps, refresh)
    H, A, U = int(hits.sum()), int(acc.sum()), int(sub.sum())
    gl, go = base["g-lru"]["hit_rate"], base["g-opt"]["hit_rate"]
    served = (H + U) / A if A else float("nan")
    gap = (served - gl) / (go - gl) if A and go != gl else float("nan")
    return dict(policy=policy, size=size, r=float(r), max_swaps=int(max_swaps),
                refresh=bool(refresh),
                view=view.view, routed_per_token=view.routed, hits=H, substituted=U,
                accesses=A, hit_rate=H / A if A else float("nan"), served_rate=served,
                g_lru=gl, g_opt=go, gap_closed=gap, policy_plain=ref["hit_rate"],
                counted_tokens=st.counted_tokens, note=st.note)


def _groups(policy, res, st, per_class_layers):
    """(group_of_key, capacity) of ``policy`` as :func:`simulate` built them (``res`` is its
    result on the same stream and size)."""
    L, E = st.n_layers, st.n_experts
    if POLICIES[policy][0] == "layer":
        cls = _classes(per_class_layers, L)
        layer_caps = capacities(res["size"], L, E, cls)[1]
        return np.repeat(np.arange(L, dtype=np.int64), E), layer_caps
    cls = _classes(per_class_layers, L)
    class_of_layer = np.zeros(L, np.int64)
    for ci, c in enumerate(cls):
        class_of_layer[c] = ci
    return np.repeat(class_of_layer, E), np.array(res["class_caps"], np.int64)


ADMITS_COLD = ("lru", "g-lru", "g-lfu-decay", "lfu-subst", "g-lfu-subst", "g-slru")


# ----------------------------------------------------------------------------- prefetch

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
    the daemon's load pins its slot (so the sets in between cannot evict it); a prefetch that would leave fewer unpinned slots
    than the largest set of the trace is dropped (the daemon's demand reads go first).

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
    from moecached.engine.policy import LRU
    pred = parse_predictor(predictor) if isinstance(predictor, str) else predictor
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or not 1 <= lookahead <= 64:
        raise SimulationError(f"lookahead: found {lookahead!r}, expected 1..64 (1: the layer about "
                              f"to run, 2: the next one)")
    st = stream if stream is not None else prepare(trace, warmup, tokens)
    L, E = st.n_layers, st.n_experts
    base = simulate(trace, "g-lru", size, per_class_layers, stream=st,
                    bytes_per_expert=bytes_per_expert)
    cls = _classes(per_class_layers, L)
    class_of_layer = np.zeros(L, np.int64)
    for ci, c in enumerate(cls):
        class_of_layer[c] = ci
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
            g = int(class_of_layer[k // E])
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
            lrus[int(class_of_layer[k // E])].unpin(k)
        keys = sets[s]
        g = int(class_of_layer[int(st.set_layer[s])])
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


def cold_sets(st: Stream, admit_cold):
    """uint8 [S] of the sets whose misses enter at the cold end under ``admit_cold`` (see
    :func:`simulate`), or None for plain admission. SimulationError on a bad value."""
    if admit_cold is None:
        return None
    if admit_cold == "prompt":
        return np.ascontiguousarray(st.set_prompt, np.uint8)
    if isinstance(admit_cold, int) and not isinstance(admit_cold, bool) and admit_cold >= 1:
        return (np.diff(st.set_start) > admit_cold).astype(np.uint8)
    raise SimulationError(f"admit_cold: found {admit_cold!r}, expected 'prompt' or a width "
                          f">= 1 (experts in one layer's set)")


def layout_bytes(path) -> tuple:
    """Bytes per expert per MoE layer from a layout JSON (``expert_bytes`` entries, parts
    summed), and the size classes (layers grouped by equal per-expert bytes).
    Returns (list[int] per trace layer, list of lists of trace layers)."""
    try:
        with open(path) as fh:
            d = json.load(fh)
    except (OSError, json.JSONDecodeError) as ex:
        raise SimulationError(f"{path}: unreadable layout ({ex}), expected a layout JSON")
    eb = d.get("expert_bytes")
    if not isinstance(eb, list) or not eb:
        raise SimulationError(f"{path}: expert_bytes: absent or empty, expected a list of "
                              "{layer, <part>: {bytes_per_expert}}")
    rows = sorted(eb, key=lambda r: r["layer"])
    per = [sum(v["bytes_per_expert"] for k, v in r.items()
               if isinstance(v, dict) and "bytes_per_expert" in v) for r in rows]
    return per, _group_equal(per)


def _group_equal(per):
    cls = {}
    for i, b in enumerate(per):
        cls.setdefault(b, []).append(i)
    return list(cls.values())


def model_bytes(path) -> tuple:
    """Bytes per expert per MoE layer and the daemon's size classes from a GGUF model
    (``moecached.engine.index.open_index``). Returns (list[int], list of lists of trace layers)."""
    from moecached.engine.index import open_index  # lazy: heavy, and optional for the simulator
    idx = open_index(path)
    pos = {b: i for i, b in enumerate(idx.expert_layers)}
    per = [0] * len(idx.expert_layers)
    cls = []
    for sc in idx.size_classes:
        layers = sorted(pos[b] for b in sc.layers)
        cls.append(layers)
        for i in layers:
            per[i] = int(sc.slot_bytes)
    return per, cls


SIZES_EXPECTED = "expected a fraction in (0, 1] (0.25 or 25%) or an integer slot count >= 1"


def _parse_size(s: str):
    """One ``--sizes`` item: a fraction (has a ``.``, an exponent or ends in ``%``) in (0, 1],
    or a plain integer slot count >= 1. SimulationError (one line) otherwise."""
    s = s.strip()
    shown = shlex.quote(s)
    try:
        if s.endswith("%"):
            v = float(s[:-1]) / 100.0
        elif "." in s or "e" in s.lower():
            v = float(s)
        else:
            v = int(s)
    except ValueError:
        raise SimulationError(f"--sizes {shown}: {SIZES_EXPECTED}") from None
    if isinstance(v, float) and not (math.isfinite(v) and 0 < v <= 1):
        raise SimulationError(f"--sizes {shown}: {SIZES_EXPECTED}")
    if isinstance(v, int) and v < 1:
        raise SimulationError(f"--sizes {shown}: {SIZES_EXPECTED}")
    return v


def _parse_sizes(text: str) -> list:
    """The ``--sizes`` list: validated items (see :func:`_parse_size`), duplicates dropped;
    an empty list is refused."""
    out = []
    for item in text.split(","):
        if item.strip():
            v = _parse_size(item)
            if not any(type(v) is type(x) and v == x for x in out):
                out.append(v)
    if not out:
        raise SimulationError(f"--sizes {shlex.quote(text)}: found no sizes, expected a comma "
                              f"list of fractions in (0, 1] (0.25 or 25%) or integer slot "
                              f"counts >= 1")
    return out


def _parse_policies(text: str) -> list:
    """The ``--policies`` list (names and aliases expanded); an empty list is refused."""
    try:
        policies = expand_policies(text)
    except ValueError as ex:
        raise SimulationError(f"--policies: {ex}") from None
    if not policies:
        raise SimulationError(f"--policies {shlex.quote(text)}: found no policies, expected a "
                              f"comma list of {', '.join(POLICIES)} (aliases: w-tinylfu, all)")
    return policies


def _fmt_size(x):
    return f"{x * 100:g}%" if isinstance(x, float) else f"{x} slots"


def _table(title, rows, cols, cell):
    w0 = max([len(title)] + [len(r) for r in rows])
    heads = [_fmt_size(c) for c in cols]
    ws = [max(9, len(h)) for h in heads]
    lines = [f"{title:<{w0}}  " + "  ".join(f"{h:>{w}}" for h, w in zip(heads, ws))]
    for r in rows:
        lines.append(f"{r:<{w0}}  " + "  ".join(f"{cell(r, c):>{w}}" for c, w in zip(cols, ws)))
    return "\n".join(lines)


def _parse_admit(text):
    """``--admit-cold``: None, ``prompt`` or an int width >= 1."""
    if text is None:
        return None
    if text.strip() == "prompt":
        return "prompt"
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise SimulationError(f"--admit-cold {shlex.quote(text)}: expected 'prompt' or a width "
                              f">= 1 (sets wider than that many experts are admitted cold)")
    return v


def run(paths, policies, sizes, warmup=None, bytes_per_expert=None, per_class_layers=None,
        gbps=DEFAULT_GBPS, compute_ms=None, tokens=None, admit_cold=None, scan_admit="cold"):
    """Simulate every trace x policy x size; returns a list of per-trace dicts."""
    out = []
    for p in paths:
        t = load_trace(p)
        E = t.n_experts
        for sz in sizes:
            if isinstance(sz, float) and math.floor(sz * E + 0.5) < 1:
                raise SimulationError(
                    f"--sizes {sz:g}: {sz:g} x {E} experts = 0 slots per layer for {p}, expected "
                    f"a fraction >= {0.5 / E:g} (at least 1 slot per layer)")
        st = prepare(t, warmup, tokens)
        counted_accesses = int(np.diff(st.set_start)[st.set_counted.astype(bool)].sum())
        bpe, cls = bytes_per_expert, per_class_layers
        if bpe is not None and len(bpe) != t.n_layers:
            raise SimulationError(f"{p}: layout/model has {len(bpe)} MoE layers, expected "
                                  f"{t.n_layers} (the trace's)")
        res = {}
        for pol in policies:
            for sz in sizes:
                try:
                    if admit_cold is not None and pol not in ADMITS_COLD:
                        raise SimulationError(f"--admit-cold: {pol} has no cold admission "
                                              f"(only {', '.join(ADMITS_COLD)})")
                    r = simulate(t, pol, sz, cls, warmup, bpe, stream=st, admit_cold=admit_cold,
                                 scan_admit=scan_admit)
                    if bpe is not None:
                        bpt = r["bytes_per_token"]
                        r["drive_tok_s"] = gbps * 1e9 / bpt if bpt else float("inf")
                        if compute_ms is not None:
                            r["tok_s_with_compute"] = 1.0 / (bpt / (gbps * 1e9)
                                                             + compute_ms / 1e3)
                except SimulationError as ex:
                    r = dict(policy=pol, size=sz, error=str(ex))
                res[(pol, sz)] = r
        out.append(dict(trace=os.fspath(p), model=t.meta.get("model"), n_tokens=t.n_tokens,
                        n_layers=t.n_layers, n_experts=t.n_experts, top_k=t.top_k,
                        counted_tokens=st.counted_tokens, counted_accesses=counted_accesses,
                        warmup=st.warmup, note=st.note, n_classes=len(cls) if cls else 1, results=res))
    return out


def _json_num(v):
    """NaN (no counted accesses) as JSON null: NaN is not JSON."""
    return None if isinstance(v, float) and math.isnan(v) else v


def _why_nothing_counted(o) -> str:
    if o["n_tokens"] == 0:
        return "the trace has no tokens (recorded with no traffic?)"
    if o["counted_tokens"] == 0:
        return (f"none of its {o['n_tokens']} tokens is counted (prompt tokens and a warm-up "
                f"of {o['warmup']} tokens never count)")
    return f"its {o['counted_tokens']} counted tokens route no experts (all -1)"


def _plot(out, policies, sizes, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SimulationError("--plot needs matplotlib (pip install matplotlib)") from None
    n = len(out)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6), squeeze=False)
    xs = sorted(sizes, key=lambda s: (s if isinstance(s, float) else 2.0 + s))
    for ax, o in zip(axes[0], out):
        for pi, pol in enumerate(policies):
            pts = [(s, o["results"][(pol, s)].get("hit_rate")) for s in xs]
            pts = [(s, h) for s, h in pts if h is not None and h == h]
            if pts:
                xv = [s * 100 if isinstance(s, float) else s for s, _ in pts]
                ax.plot(xv, [h * 100 for _, h in pts], marker="o", ms=3, lw=1.2,
                        color=plt.cm.tab20(pi % 20),
                        ls="--" if pol in NEEDS_FUTURE else "-", label=pol)
        ax.set_title(os.path.basename(o["trace"]).replace(".npz", ""), fontsize=8)
        ax.set_xlabel("cache size (% of each layer's experts)" if all(
            isinstance(s, float) for s in xs) else "cache size")
        ax.set_ylabel("hit rate (%)")
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    axes[0][-1].legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _parse_subst(text: str) -> list:
    """``--subst``: comma list of tolerances in [0, 1]."""
    out = []
    for item in text.split(","):
        if not item.strip():
            continue
        try:
            v = float(item)
        except ValueError:
            v = float("nan")
        if not (0.0 <= v <= 1.0):
            raise SimulationError(f"--subst {shlex.quote(item.strip())}: expected a tolerance "
                                  f"0 <= r <= 1 (0.5 grants a candidate scoring at least half "
                                  f"the missing expert's score)")
        if v not in out:
            out.append(v)
    if not out:
        raise SimulationError(f"--subst {shlex.quote(text)}: found no tolerances, expected a "
                              f"comma list such as 0.5,0.8")
    return out


def _parse_caps(text: str) -> list:
    """``--subst-cap``: comma list of ints >= 1 or ``none`` (-1 = no cap)."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if item.lower() == "none":
            v = -1
        else:
            try:
                v = int(item)
            except ValueError:
                v = 0
            if v < 1:
                raise SimulationError(f"--subst-cap {shlex.quote(item)}: expected an integer "
                                      f">= 1 (swaps per token-layer set) or 'none'")
        if v not in out:
            out.append(v)
    if not out:
        raise SimulationError(f"--subst-cap {shlex.quote(text)}: found no caps, expected e.g. "
                              f"1,none")
    return out


def run_subst(paths, policies, sizes, rs, caps, warmup=None, per_class_layers=None,
              tokens=None, refresh=False):
    """:func:`simulate_subst` for every trace x policy x r x cap x size; a trace without
    weights gets ``skipped`` (the reason) instead of results. Returns a list of dicts."""
    out = []
    for p in paths:
        t = load_trace(p)
        o = dict(trace=os.fspath(p), model=t.meta.get("model"), view=SUBST_VIEW,
                 n_experts=t.n_experts, top_k=t.top_k, results=[])
        try:
            v = subst_view(t, warmup, tokens)
        except SimulationError as ex:
            o["skipped"] = str(ex)
            out.append(o)
            continue
        o.update(counted_tokens=v.stream.counted_tokens, note=v.stream.note,
                 routed_per_token=v.routed, view=v.view)
        for pol in policies:
            for r in rs:
                for c in caps:
                    for sz in sizes:
                        try:
                            o["results"].append(simulate_subst(v, pol, sz, r, c,
                                                               per_class_layers, refresh))
                        except SimulationError as ex:
                            o["results"].append(dict(policy=pol, size=sz, r=r, max_swaps=c,
                                                     error=str(ex)))
        out.append(o)
    return out


def _main_subst(a, policies, sizes, cls) -> int:
    rs = _parse_subst(a.subst)
    caps = _parse_caps(a.subst_cap)
    bad = [p for p in policies if p in NEEDS_FUTURE]
    if bad:
        raise SimulationError(f"--subst --policies: {', '.join(bad)} need the future; "
                              f"substitution replays online policies (g-opt is reported "
                              f"beside every row anyway)")
    out = run_subst(a.traces, policies, sizes, rs, caps, a.warmup, cls, a.tokens,
                    a.subst_refresh)
    if a.json:
        js = [dict(o, results=[{k: _json_num(v) for k, v in r.items()} for r in o["results"]])
              for o in out]
        json.dump(js, sys.stdout, indent=1, default=float)
        print()
        return 0
    for o in out:
        print(f"== {o['trace']}: substitution view: {o['view']}")
        if "skipped" in o:
            print(f"skipped: {o['skipped']}")
            print()
            continue
        print(f"{o['routed_per_token']} routed expert(s) per token-layer of top-{o['top_k']}; "
              f"counted tokens {o['counted_tokens']}" + ("; refresh on" if a.subst_refresh
                                                         else ""))
        if o["note"]:
            print(f"note: {o['note']}")
        res = {(r["policy"], r["r"], r["max_swaps"], r["size"]): r for r in o["results"]}
        first = {}
        for r in o["results"]:
            if "error" not in r:
                first.setdefault(r["size"], r)

        def pct(x):
            return "n/a" if x is None or x != x else f"{x * 100:.1f}%"

        rows = {"g-lru": lambda s: pct(first[s]["g_lru"]) if s in first else "n/a",
                "g-opt": lambda s: pct(first[s]["g_opt"]) if s in first else "n/a"}
        for pol in policies:
            for r in rs:
                for c in caps:
                    name = f"{pol} subst r={r:g} cap={'none' if c < 0 else c}"
                    rows[name] = (lambda k: lambda s: "n/a" if "error" in res[k + (s,)]
                                  else pct(res[k + (s,)]["served_rate"]))((pol, r, c))
                    rows["  gap closed"] = None
                    rows[name + " gap"] = (lambda k: lambda s: "n/a" if "error" in res[k + (s,)]
                                           else pct(res[k + (s,)]["gap_closed"]))((pol, r, c))
        rows.pop("  gap closed")
        print(_table("served from cache", list(rows), sizes, lambda row, s: rows[row](s)))
        for e in sorted({r["error"] for r in o["results"] if "error" in r}):
            print(f"n/a: {e}")
        print()
    return 0


def _main_prefetch(a, sizes, bpe, cls) -> int:
    pred = parse_predictor(a.predictor)
    out = []
    for p in a.traces:
        t = load_trace(p)
        st = prepare(t, a.warmup, a.tokens)
        res = []
        for sz in sizes:
            try:
                res.append(simulate_prefetch(t, sz, pred, a.lookahead, cls, bytes_per_expert=bpe,
                                             seed=a.seed, stream=st))
            except SimulationError as ex:
                res.append(dict(size=sz, error=str(ex)))
        out.append(dict(trace=os.fspath(p), predictor=a.predictor, lookahead=a.lookahead,
                        counted_tokens=st.counted_tokens, note=st.note, results=res))
    if a.json:
        json.dump([dict(o, results=[{k: _json_num(v) for k, v in r.items()} for r in o["results"]])
                   for o in out], sys.stdout, indent=1, default=float)
        print()
        return 0
    for o in out:
        print(f"== {o['trace']}: prefetch with the daemon's LRU (g-lru), predictor "
              f"{o['predictor']}, lookahead {o['lookahead']}; counted tokens {o['counted_tokens']}")
        if o["note"]:
            print(f"note: {o['note']}")
        res = {r["size"]: r for r in o["results"]}

        def cell(f):
            return lambda row, s: "n/a" if "error" in res[s] else f(res[s])
        rows = {
            "hit rate, no prefetch": lambda r: f"{r['hit_rate_no_prefetch'] * 100:.1f}%",
            "demand hits": lambda r: f"{r['demand_hits'] / r['accesses'] * 100:.1f}%",
            "prefetch hits": lambda r: f"{r['prefetch_hits'] / r['accesses'] * 100:.1f}%",
            "misses": lambda r: f"{r['misses'] / r['accesses'] * 100:.1f}%",
            "wasted prefetches/token": lambda r: f"{r['wasted_per_token']:.2f}",
            "reads/token": lambda r: f"{r['reads_per_token']:.2f}",
            "reads/token, no prefetch": lambda r: f"{r['reads_per_token_no_prefetch']:.2f}",
        }
        if bpe is not None:
            rows["wasted MB/token"] = lambda r: f"{r['wasted_bytes_per_token'] / 1e6:.1f}"
        print(_table("of counted accesses", list(rows), sizes,
                     lambda row, s: cell(rows[row])(row, s)))
        for e in sorted({r["error"] for r in o["results"] if "error" in r}):
            print(f"n/a: {e}")
        print()
    return 0
