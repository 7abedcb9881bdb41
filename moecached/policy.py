"""Eviction policies: the pure-Python face of the Cython core ``moecached._policy``.

The daemon's cache and the trace simulator (``moecached.tools.simulate``) use these same classes,
so a simulated hit rate is what the daemon gets on the same trace and size: ``g-lru`` and
``lru`` replay through :class:`LRU`, the daemon's own eviction order.

Simulator policies (exact definitions in ``docs/policies.md``):

============  ========  ================================================================
name          budget    victim
============  ========  ================================================================
lru           layer     least recently used (daemon ``LRU``)
lfu           layer     fewest accesses since the start (ties: least recent)
slru          layer     segmented LRU, 20 % probation
opt           layer     Belady MIN: next use farthest in the future
g-lru         class     least recently used over all layers of a size class (the daemon)
g-lfu         class     fewest accesses, counts halved every 64 tokens
arc           class     ARC (Megiddo & Modha)
lru-2         class     LRU-K with K = 2
w-tinylfu-1   class     W-TinyLFU, 1 % window LRU + SLRU main + count-min admission
w-tinylfu-10  class     same with a 10 % window
g-opt         class     Belady MIN over one shared budget
============  ========  ================================================================

``layer`` policies give every MoE layer its own budget; ``class`` policies one budget per
size class (one budget in all when the model has one size class).
"""
from ._policy import LRU  # noqa: F401
from . import _policy as _c

# name -> (scope, factory(group_of_key, capacity, next_use) -> policy, halve_every_tokens)
POLICIES = {
    "lru": ("layer", lambda g, c, nu: _c._LRUPol(g, c), 0),
    "lfu": ("layer", lambda g, c, nu: _c._LFUPol(g, c, False), 0),
    "slru": ("layer", lambda g, c, nu: _c._SLRUPol(g, c, 20), 0),
    "opt": ("layer", lambda g, c, nu: _c._OptPol(g, c, nu), 0),
    "g-lru": ("class", lambda g, c, nu: _c._LRUPol(g, c), 0),
    "g-lfu": ("class", lambda g, c, nu: _c._LFUPol(g, c, True), 64),
    "arc": ("class", lambda g, c, nu: _c._ARCPol(g, c), 0),
    "lru-2": ("class", lambda g, c, nu: _c._LRU2Pol(g, c), 0),
    "w-tinylfu-1": ("class", lambda g, c, nu: _c._WTinyLFUPol(g, c, 1), 0),
    "w-tinylfu-10": ("class", lambda g, c, nu: _c._WTinyLFUPol(g, c, 10), 0),
    "g-opt": ("class", lambda g, c, nu: _c._OptPol(g, c, nu), 0),
}
NEEDS_FUTURE = {"opt", "g-opt"}
ALIASES = {"w-tinylfu": ["w-tinylfu-1", "w-tinylfu-10"], "all": list(POLICIES)}

__all__ = ["LRU", "POLICIES", "NEEDS_FUTURE", "ALIASES", "expand_policies", "make_policy"]


def expand_policies(names) -> list:
    """Expand a list/comma string of policy names and aliases; ValueError on unknown names."""
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    out = []
    for n in names:
        n = n.strip()
        for m in ALIASES.get(n, [n]):
            if m not in POLICIES:
                raise ValueError(f"policy: found {m!r}, expected one of "
                                 f"{', '.join(list(POLICIES) + list(ALIASES))}")
            if m not in out:
                out.append(m)
    return out


def make_policy(name, group_of_key, capacity, next_use=None):
    """Build simulator policy ``name`` over keys grouped by ``group_of_key`` (int [n_keys],
    group id per key) with ``capacity[g]`` slots per group. ``next_use`` (int64 [A], from
    ``_policy.next_use``) is required by ``opt``/``g-opt``."""
    if name not in POLICIES:
        expand_policies([name])
    if name in NEEDS_FUTURE and next_use is None:
        raise ValueError(f"policy {name}: needs next_use (the future of the access stream)")
    return POLICIES[name][1](group_of_key, capacity, next_use)
