"""The policy simulator: replay a routing trace through an eviction policy at a cache size.

``moecache-ctl policy TRACE... [--policies LIST] [--sizes LIST] [--layout JSON | --model GGUF]
[--gbps X] [--compute-ms X] [--warmup N] [--tokens N] [--json] [--plot PNG]`` (its command line:
``moecached.tools.policycli``). Owns the cache simulation per policy (:func:`simulate`), the
scan-resistant admission of a set (:func:`cold_sets`) and every trace x policy x size
(:func:`run`). The stream it replays is :mod:`moecached.tools.simstream`'s, its budgets
:mod:`moecached.tools.simsizes`'; substitution is :mod:`moecached.tools.simsubst`, prefetch
:mod:`moecached.tools.simprefetch`, several models against one budget
:mod:`moecached.tools.mixsim`.

Access model (exact rules in ``docs/policies.md``): each set (one layer of one step,
:mod:`moecached.tools.simstream`) is granted as the daemon's cache grants one request: first
the experts of the set that are resident (hits, in set order), then the others (misses, in set
order), each loaded, evicting the policy's victim when the budget is full; every accessed
expert stays pinned until the whole set is done, so a miss never evicts an expert of its own
set. ``g-lru`` (and ``lru`` for the daemon's per-layer mode) is the daemon's hit count exactly.
Only counted sets (decode tokens, or every token after the warm-up) count.
"""
from __future__ import annotations

import math
import os
import time
from typing import Optional

import numpy as np

from moecached.engine.policy import (NEEDS_FUTURE, POLICIES, SCAN_ADMITS, expand_policies,
                                     make_policy, replay)
from moecached.engine.trace import load_trace
from moecached.tools.simsizes import budgets, capacities, layer_classes
from moecached.tools.simstream import SimulationError, Stream, prepare

__all__ = ["simulate", "cold_sets", "run", "ADMITS_COLD", "DEFAULT_GBPS"]

#: drive read bandwidth (GB/s) the simulator's tok/s assume unless told (``--gbps``)
DEFAULT_GBPS = 3.7

#: the policies with scan-resistant (cold) admission: ``admit_cold`` applies to them only
ADMITS_COLD = ("lru", "g-lru", "g-lfu-decay", "lfu-subst", "g-lfu-subst", "g-slru")


def simulate(trace, policy: str, size, per_class_layers=None, warmup: Optional[int] = None,
             bytes_per_expert=None, stream: Optional[Stream] = None,
             tokens: Optional[int] = None, admit_cold=None, scan_admit: str = "cold") -> dict:
    """Replay ``trace`` through ``policy`` at cache ``size``.

    Args:
        trace: Trace or path (ignored when ``stream`` from ``simstream.prepare`` is given).
        policy: a name of ``moecached.engine.policy.POLICIES`` (e.g. ``"g-lru"``, the daemon's).
        size: float fraction of each layer's experts, or int total slots
            (:mod:`moecached.tools.simsizes`).
        per_class_layers: list of lists of trace-layer indices, one list per size class;
            ``class`` policies get one budget per class, exactly like the daemon. Default: one
            class holding every layer.
        warmup, tokens: see :func:`moecached.tools.simstream.prepare`.
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
    cls = layer_classes(per_class_layers, L)
    class_caps, layer_caps, desc = capacities(size, L, E, cls)
    group, caps = budgets(scope, cls, class_caps, layer_caps, E)
    if scope == "layer":
        need = st.max_set
        for l in range(L):
            if caps[l] < max(need[l], 1):
                raise SimulationError(
                    f"size {size} ({desc}): layer {l} gets {caps[l]} slots, expected >= "
                    f"{max(need[l], 1)} (too small: one step routes that many experts to the "
                    f"layer, and they must be resident together)")
    else:
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

