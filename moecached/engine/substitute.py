"""Substitution (a part of ``moecached.engine.cache.ExpertCache``; docs/policies.md,
"Substitution"): an acquire may name, per layer, further experts its router ranked, and a
requested expert that is not resident is then replaced by a resident one of them.

The rule, decided once when the acquire arrives (:func:`substitute`): for each layer with
candidates whose requested experts are not all resident (a fast-path hit never gets here),
for each requested expert ``m`` not resident, in request order, while fewer than ``cap``
swaps were made in the layer, the resident candidate not yet given with the highest score
>= ``r * score(m)`` (ties: first) takes ``m``'s place; then every candidate not given is
credited to the eviction order (``lfu-subst`` counts it). The simulator runs the same rule
(``moecached.engine.policy.replay_subst``). A substitute granted counts in ``substituted``
(not as a hit).

Lock discipline: runs under the cache's lock (the caller holds it); reads the pools'
resident maps, credits their eviction orders.
"""
from __future__ import annotations

__all__ = ["substitute"]


def substitute(groups, subst) -> tuple[list, list]:
    """Choose substitutes for a request of ``groups`` (``[(_Layer, [experts])]``, validated)
    under ``subst`` = ``(r, cap, {layer: (scores, candidates)})``: ``scores`` the router's
    scores of the layer's requested experts (same order), ``candidates`` ``[(expert, score),
    ...]`` further experts (none of them requested); ``cap`` < 0: no bound on swaps per layer.
    Returns (requests ``[(layer, [experts])]`` with the substitutes in place, ``[(layer,
    missing, substitute)]``)."""
    r, cap, per = subst
    out, swaps = [], []
    for L, ex in groups:
        got = per.get(L.layer)
        pool, base = L.pool, L.base
        res = pool.res
        if got is None or all(res[base + e] >= 0 for e in ex):
            out.append((L.layer, ex))
            continue
        scores, cands = got
        given = set()
        new = list(ex)
        n = 0
        for i, e in enumerate(ex):
            if res[base + e] >= 0 or (0 <= cap <= n):
                continue
            need = r * scores[i]
            best = None
            for c, sc in cands:
                if res[base + c] >= 0 and c not in given and sc >= need and \
                        (best is None or sc > best[1]):
                    best = (c, sc)
            if best is not None:
                given.add(best[0])
                new[i] = best[0]
                swaps.append((L.layer, e, best[0]))
                n += 1
        credit = pool.lru.credit
        for c, _ in cands:
            if c not in given:
                credit(base + c)
        out.append((L.layer, new))
    return out, swaps
