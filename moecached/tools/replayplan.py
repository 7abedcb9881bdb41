"""What a replay replays, worked out offline: which tokens of a trace are replayed and which
count (:func:`plan`), each step's expert sets (:func:`step_sets`), the prefetch predictions
(:func:`parse_predictor`, :func:`predictions`), and the daemon's LRU driven offline the way the
cache drives it (:func:`pin_resident`, :func:`reference_lru`: the second check of a replay's
hits, apart from the simulator's replay kernel; ``mixsim`` replays each model with it).

The live replay against a daemon is :mod:`moecached.tools.replay`; the counting rules are
``moecache-ctl policy``'s, so the numbers are comparable (the window of ``--tokens N`` is
``moecached.tools.simstream.window_end``).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from moecached import MoecacheError
from moecached.engine.policy import LRU
from moecached.engine.trace import Trace
from moecached.tools.simstream import window_end

__all__ = ["ReplayError", "Plan", "plan", "step_sets", "pin_resident", "reference_lru",
           "parse_predictor", "predictions"]


class ReplayError(MoecacheError, ValueError):
    """Bad replay input (one line)."""


class Plan:
    """Which tokens of a trace are replayed and which count.

    Attributes: ``start``/``end`` (token window of the trace), ``trace`` (the window as a Trace),
    ``steps`` (list of (first token, last token + 1) in window coordinates), ``counted``
    (bool per step), ``warm_tokens``, ``counted_tokens``, ``sim_warmup`` (the ``warmup`` to
    pass to ``simulate`` on ``trace``), ``note``.
    """

    def __init__(self, **kw):
        self.__dict__.update(kw)


def plan(trace: Trace, warm_tokens: Optional[int] = None, tokens: Optional[int] = None) -> Plan:
    """The :class:`Plan` of ``trace`` under ``--warm-tokens`` / ``--tokens`` (the rules:
    :mod:`moecached.tools.replay`). ReplayError when the window counts no token."""
    t = trace
    T = t.n_tokens
    if warm_tokens is not None and warm_tokens < 0:
        raise ReplayError(f"--warm-tokens: found {warm_tokens}, expected >= 0")
    if tokens is not None and tokens < 1:
        raise ReplayError(f"--tokens: found {tokens}, expected >= 1")
    has_decode = t.n_decode > 0
    if has_decode:
        first = int(np.argmax(~t.is_prompt))
        start = 0 if warm_tokens is None else max(0, first - warm_tokens)
        end = T if tokens is None else window_end(t, 0, tokens)
        sim_warmup = 0
        note = ""
    else:
        w = min(256, T // 4) if warm_tokens is None else min(warm_tokens, T)
        start = 0
        end = T if tokens is None else window_end(t, w, tokens)
        sim_warmup = w
        note = (f"trace has no decode tokens (prefill only): tokens after a warm-up prefix of "
                f"{w} are treated as decode tokens")
    sub = t.window(start, end)
    n = end - start
    bounds = sub.step_starts()
    steps = list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
    if has_decode:
        dec = ~sub.is_prompt
        counted = [bool(dec[a:b].any()) for a, b in steps]
    else:
        counted = [a >= sim_warmup for a, b in steps]
    ct = sum(b - a for (a, b), c in zip(steps, counted) if c)
    warm = sum(b - a for (a, b), c in zip(steps, counted) if not c)
    if ct == 0:
        raise ReplayError(f"nothing to count: the window has {n} tokens, {warm} of them warm-up "
                          "(lower --warm-tokens or give a longer trace)")
    return Plan(start=start, end=end, trace=sub, steps=steps, counted=counted,
                warm_tokens=warm, counted_tokens=ct, sim_warmup=sim_warmup, note=note,
                has_decode=has_decode)


def step_sets(arr: np.ndarray, steps) -> list:
    """[step][layer] -> list of expert ids (union over the step's tokens, first appearance)."""
    out = []
    L = arr.shape[1]
    for a, b in steps:
        if b - a == 1:
            row = arr[a]
            out.append([[int(e) for e in row[l] if e >= 0] for l in range(L)])
        else:
            per = []
            for l in range(L):
                seen = []
                for e in arr[a:b, l].ravel():
                    e = int(e)
                    if e >= 0 and e not in seen:
                        seen.append(e)
                per.append(seen)
            out.append(per)
    return out


def pin_resident(lr, keys) -> tuple:
    """The first half of the daemon's acquire on one LRU (``moecached.engine.policy.LRU``): touch and
    pin every resident key of ``keys``, in order. Returns (hits, the missing keys in order)."""
    miss = []
    h = 0
    for k in keys:
        if lr.contains(k):
            lr.touch(k)
            lr.pin(k)
            h += 1
        else:
            miss.append(k)
    return h, miss


def reference_lru(sets, counted, class_of_layer, class_caps, n_experts):
    """The daemon's global LRU on the request stream, without the daemon and apart from the
    simulator's replay kernel (a second check of ``simulate(.., "g-lru", ..)``): per (step, layer)
    request, pin every resident expert (touch, in order), then load each missing one (evict
    the coldest unpinned key when the class is full), then release. Returns (hits, accesses)
    over counted steps."""
    L = len(class_of_layer)
    lrus = [LRU(L * n_experts) for _ in class_caps]
    H = A = 0
    for ss, c in zip(sets, counted):
        for l in range(L):
            keys = [l * n_experts + e for e in ss[l]]
            if not keys:
                continue
            g = class_of_layer[l]
            lr, cap = lrus[g], class_caps[g]
            h, miss = pin_resident(lr, keys)
            for k in miss:
                if len(lr) >= cap:
                    lr.remove(lr.victim())
                lr.insert(k)
                lr.pin(k)
            for k in keys:
                lr.unpin(k)
            if c:
                H += h
                A += len(keys)
    return H, A


def parse_predictor(s: str):
    """'trace' | 'oracle' | 'noisy:RECALL,EXTRA' -> (name, recall, extra)."""
    s = (s or "oracle").strip()
    if s in ("trace", "oracle"):
        return (s, 1.0, 0.0)
    if s.startswith("noisy:"):
        try:
            r, x = (float(v) for v in s[6:].split(","))
        except ValueError:
            raise ReplayError(f"--predictor: found {s!r}, expected noisy:RECALL,EXTRA "
                              "(e.g. noisy:0.8,0.5)") from None
        if not 0 <= r <= 1 or x < 0:
            raise ReplayError(f"--predictor: found recall {r}, extra {x}, expected "
                              "0 <= RECALL <= 1 and EXTRA >= 0")
        return ("noisy", r, x)
    raise ReplayError(f"--predictor: found {s!r}, expected trace, oracle or noisy:RECALL,EXTRA")


def predictions(pred, sub: Trace, steps, true_sets, n_experts, seed=0) -> list:
    """[step][layer] -> the experts prefetched for that layer: ``oracle`` the true sets,
    ``trace`` the trace's ``predicted`` array, ``noisy`` each true expert kept with probability
    RECALL plus EXTRA wrong experts per true one (seeded)."""
    name, recall, extra = pred
    if name == "oracle":
        return true_sets
    if name == "trace":
        if sub.predicted is None:
            raise ReplayError("--predictor trace: the trace has no 'predicted' array "
                              "(use oracle or noisy:RECALL,EXTRA)")
        return step_sets(sub.predicted, steps)
    rng = np.random.default_rng(seed)
    out = []
    for ss in true_sets:
        per = []
        for true in ss:
            keep = [e for e in true if rng.random() < recall]
            want = extra * len(true)
            nw = int(want) + (1 if rng.random() < want - int(want) else 0)
            others = np.setdiff1d(np.arange(n_experts), true)
            wrong = rng.choice(others, size=min(nw, len(others)), replace=False).tolist() \
                if nw and len(others) else []
            per.append(keep + [int(e) for e in wrong])
        out.append(per)
    return out

