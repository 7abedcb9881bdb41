"""Synthetic MoE routing workload whose locality is fitted to real Qwen3-30B-A3B traces.

Real routing traces cannot ship inside the package, so ``moecache-ctl demo`` replays this
generator by default. Its output is **synthetic** (``meta["synthetic"] = True``, and the demo
says so); only its locality statistics are fitted to real data.

Model (per MoE layer ``l``, independently; ``E`` experts, top-``k``):

* a fixed popularity ``w_l[e] ~ 1 / (rank + 1) ** alpha`` over a random permutation of the
  experts (skew: the share of the busiest 10 % of experts);
* a recency boost ``u_l``, an exponential moving average of the layer's past selections with
  decay ``gamma`` per token (the slow "topic" drift that makes overlap decay with lag);
* each token: every expert the previous token used in this layer is kept with probability
  ``p_copy`` (previous-token overlap); the rest of the ``k`` are drawn without replacement
  with probability proportional to ``w_l + beta * u_l`` (Gumbel top-k). Token 0 draws all.

Fitted numbers (targets measured on ``qwen3_30b_a3b_sharegpt_prefill_2080.npz`` from the
project's shared trace set, 2080 prefill tokens x 48 MoE layers x 128 experts, top-8; every
statistic computed by :func:`locality_stats`, i.e. the same code for both):

=========================================  ==========  ========================================
statistic                                  real trace  synthetic (defaults, 2080 tokens, seed 0)
=========================================  ==========  ========================================
previous-token overlap (pooled)            0.456       0.465
top-10 % share (mean over layers)         0.374       0.337
per-layer LRU hit rate @ 2k = 12.5 % E    0.603       0.586
per-layer LRU hit rate @ 25 % E           0.825       0.826
per-layer LRU hit rate @ 50 % E           0.967       0.973
=========================================  ==========  ========================================

How they were measured: ``prev`` = for each token and layer, the fraction of its experts the
previous token also used, pooled; ``top-10 % share`` = per layer, the share of selections
taken by the 12 most used experts, averaged over layers; LRU hit rates =
``moecached.tools.simulate.simulate(trace, "lru", f, warmup=0)`` (per-layer LRU, cold start, every
token counted) -- the same definitions as ``../shared/traces/PROVENANCE.md``, whose table these
reproduce for the real trace. The parameters were chosen by :func:`fit` (a grid search
minimising the summed squared error of those five numbers, on 1024 tokens x 16 layers over
alpha {0.5, 0.7, 0.9} x p_copy {0.25, 0.35, 0.45} x beta {3, 10, 30} x gamma {0.9, 0.97, 0.99});
the best, alpha 0.7, p_copy 0.35, beta 10, gamma 0.97, are ``DEFAULT_PARAMS``.
``python -m moecached.tools.workload`` re-measures both columns and prints the table (``--trace``
measures another real trace, ``--fit`` re-runs the search).

What it does not model: the attention-sink routing of a request's first token, cross-layer
correlation, decode-vs-prefill differences (the real Qwen3 traces are prefill only).
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from moecached.engine.trace import Trace

__all__ = ["generate", "locality_stats", "fit", "DEFAULT_PARAMS", "FITTED", "REAL_TARGETS"]

# measured on qwen3_30b_a3b_sharegpt_prefill_2080.npz with locality_stats()
REAL_TARGETS = {"prev": 0.456, "top10": 0.374, "lru_2k": 0.603, "lru_25": 0.825,
                "lru_50": 0.967}

DEFAULT_PARAMS = {"alpha": 0.7, "p_copy": 0.35, "beta": 10.0, "gamma": 0.97}

# locality_stats(generate(2080, 48, 128, 8, seed=0)) with DEFAULT_PARAMS
FITTED = {"prev": 0.465, "top10": 0.337, "lru_2k": 0.586, "lru_25": 0.826, "lru_50": 0.973}


def generate(n_tokens: int, n_layers: int, n_experts: int = 128, top_k: int = 8, *,
             seed: int = 0, alpha: float = None, p_copy: float = None, beta: float = None,
             gamma: float = None, name: str = "synthetic") -> Trace:
    """A synthetic routing trace (see module doc). All tokens are decode tokens
    (``is_prompt`` False); ``meta`` says ``synthetic: true`` and holds the parameters."""
    p = dict(DEFAULT_PARAMS)
    for k, v in (("alpha", alpha), ("p_copy", p_copy), ("beta", beta), ("gamma", gamma)):
        if v is not None:
            p[k] = float(v)
    T, L, E, k = int(n_tokens), int(n_layers), int(n_experts), int(top_k)
    if T < 0 or L < 1 or E < 1 or not 1 <= k <= E:
        raise ValueError(f"generate: found tokens={T} layers={L} experts={E} top_k={k}, "
                         "expected tokens >= 0, layers >= 1, 1 <= top_k <= experts")
    rng = np.random.default_rng(seed)
    ranks = np.argsort(rng.random((L, E)), axis=1)          # rank of each expert per layer
    w = 1.0 / (ranks + 1.0) ** p["alpha"]
    w /= w.sum(axis=1, keepdims=True)
    u = np.zeros((L, E))
    out = np.empty((T, L, k), np.int16)
    prev = None
    rows = np.arange(L)[:, None]
    for t in range(T):
        score = np.log(w + p["beta"] * u) + rng.gumbel(size=(L, E))
        if prev is not None:
            keep = rng.random((L, k)) < p["p_copy"]
            # kept experts of the previous token outrank every drawn one
            score[rows, prev] = np.where(keep, np.inf, score[rows, prev])
        sel = np.argpartition(-score, k - 1, axis=1)[:, :k]
        # rank order: kept first, then by score (like a router's descending gate)
        order = np.argsort(-np.take_along_axis(score, sel, axis=1), axis=1, kind="stable")
        sel = np.take_along_axis(sel, order, axis=1)
        out[t] = sel
        u *= p["gamma"]
        u[rows, sel] += (1.0 - p["gamma"]) / k
        prev = sel
    meta = {"model": name, "synthetic": True, "n_experts": E, "top_k": k,
            "generator": "moecached.tools.workload.generate", "params": p, "seed": int(seed),
            "notes": "SYNTHETIC routing: locality fitted to real Qwen3-30B-A3B traces"}
    return Trace(experts=out, is_prompt=np.zeros(T, bool), meta=meta).validate("synthetic")


def locality_stats(trace: Trace) -> dict:
    """prev-token overlap, top-10 % share, per-layer LRU hit rate at 2k / 25 % / 50 % of E
    (definitions in the module doc)."""
    from moecached.tools.simulate import simulate
    ex = trace.experts
    T, L, k = ex.shape
    E = trace.n_experts
    hit = tot = 0
    for t in range(1, T):
        a, b = ex[t], ex[t - 1]
        m = (a[:, :, None] == b[:, None, :]) & (b[:, None, :] >= 0)
        hit += int(m.any(axis=2)[a >= 0].sum())
        tot += int((a >= 0).sum())
    shares = []
    n_top = max(1, int(round(0.1 * E)))
    for l in range(L):
        v = ex[:, l, :].ravel()
        v = v[v >= 0]
        if len(v):
            c = np.sort(np.bincount(v, minlength=E))[::-1]
            shares.append(c[:n_top].sum() / c.sum())
    out = {"prev": hit / tot if tot else float("nan"),
           "top10": float(np.mean(shares)) if shares else float("nan")}
    for key, f in (("lru_2k", 2 * k / E), ("lru_25", 0.25), ("lru_50", 0.5)):
        out[key] = simulate(trace, "lru", float(f), warmup=0)["hit_rate"]
    return out


def _err(s, tgt):
    return sum((s[key] - tgt[key]) ** 2 for key in tgt)


def fit(targets=None, n_tokens=1024, n_layers=16, seed=0, grid=None, progress=False):
    """Grid search of the generator parameters against ``targets`` (default: REAL_TARGETS).
    Returns (best params, their stats, error)."""
    import itertools
    tgt = targets or REAL_TARGETS
    grid = grid or {"alpha": [0.6, 0.8, 1.0], "p_copy": [0.2, 0.3, 0.4],
                    "beta": [1.0, 3.0, 10.0], "gamma": [0.8, 0.9, 0.97]}
    best = None
    keys = list(grid)
    for vals in itertools.product(*(grid[key] for key in keys)):
        p = dict(zip(keys, vals))
        s = locality_stats(generate(n_tokens, n_layers, seed=seed, **p))
        e = _err(s, tgt)
        if progress:
            print(p, {k: round(v, 3) for k, v in s.items()}, round(e, 5), flush=True)
        if best is None or e < best[2]:
            best = (p, s, e)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m moecached.tools.workload",
                                 description="measure (and optionally re-fit) the synthetic "
                                             "workload against a real trace")
    ap.add_argument("--trace", help="real trace to measure (default: targets in the docstring)")
    ap.add_argument("--fit", action="store_true", help="grid-search the parameters")
    ap.add_argument("--tokens", type=int, default=2080)
    ap.add_argument("--layers", type=int, default=48)
    a = ap.parse_args(argv)
    tgt = dict(REAL_TARGETS)
    if a.trace:
        from moecached.engine.trace import load_trace
        tgt = locality_stats(load_trace(a.trace))
    if a.fit:
        p, s, e = fit(tgt, progress=True)
        print("best", json.dumps(p), "err", e)
        syn = locality_stats(generate(a.tokens, a.layers, seed=0, **p))
    else:
        syn = locality_stats(generate(a.tokens, a.layers, seed=0))
    print(f"{'statistic':<10} {'real':>8} {'synthetic':>10}")
    for key in tgt:
        print(f"{key:<10} {tgt[key]:>8.3f} {syn[key]:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
