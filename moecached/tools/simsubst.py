"""Substitution in the simulator: a missing routed expert served by a resident candidate.

``moecache-ctl policy TRACE --subst R[,R...] [--subst-cap N] [--subst-refresh]``. Owns the
substitution view of a trace (:func:`subst_view`: routed experts, their scores and each set's
candidates, made up from gate weights or taken from the trace's recorded candidates) and its
replay through an online policy beside ``g-lru`` and ``g-opt`` on the same view
(:func:`simulate_subst`, every trace x policy x r x cap x size: :func:`run_subst`). The exact
rule is ``docs/policies.md``, "Substitution".
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from moecached.engine.policy import NEEDS_FUTURE, POLICIES, make_policy, replay_subst
from moecached.engine.trace import Trace, load_trace
from moecached.tools.simsizes import budgets, capacities, layer_classes
from moecached.tools.simstream import SimulationError, Stream, prepare
from moecached.tools.simulate import simulate

__all__ = ["SUBST_VIEW", "SUBST_VIEW_RECORDED", "SubstView", "subst_view", "simulate_subst",
           "run_subst"]

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
    L, E = st.n_layers, st.n_experts
    cls = layer_classes(per_class_layers, L)
    class_caps, layer_caps, _ = capacities(size, L, E, cls)
    pol = make_policy(policy, *budgets(POLICIES[policy][0], cls, class_caps, layer_caps, E))
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
