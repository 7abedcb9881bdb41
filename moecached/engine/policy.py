"""Eviction policies: the pure-Python face of the Cython core ``moecached.engine._policy``.

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
g-lfu-decay   class     the daemon's ``eviction = "lfu-decay"`` (``LFUDecay``): fewest decayed uses
lfu-subst     layer     the daemon's ``eviction = "lfu-subst"``: fewest decayed uses over a short
                        window, a substitute candidate offered worth half a use
g-lfu-subst   class     the same over one budget per size class
g-slru        class     the daemon's ``eviction = "slru"`` (``SLRU``): segmented LRU, protected at
                        most 4/5 of the keys present
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
from moecached.engine._policy import LFUDecay, LRU, SLRU, build_stream, next_use  # noqa: F401
from moecached.engine import _policy as _c

G_LFU_HALVE_EVERY = 64   # g-lfu halves every count each time this many more tokens passed
LFU_DECAY_HALVE_AFTER = 1024   # lfu-decay (daemon and g-lfu-decay) halves after this many uses
# lfu-subst: a use adds 2, a substitute candidate offered with a request that reaches the cache
# adds 1; counts are halved each time 32 more were added (16 uses: a window of ~16 tokens per
# layer with per-layer budgets). docs/policies.md ("Substitution") gives the measurements.
LFU_SUBST_HALVE_AFTER, LFU_SUBST_USE, LFU_SUBST_CAND = 32, 2, 1

# the daemon's eviction orders (config key ``eviction``): name -> factory(n_keys)
EVICTIONS = {
    "lru": lambda n: LRU(n),
    "lfu-decay": lambda n: LFUDecay(n, LFU_DECAY_HALVE_AFTER),
    "lfu-subst": lambda n: LFUDecay(n, LFU_SUBST_HALVE_AFTER, LFU_SUBST_USE, LFU_SUBST_CAND),
    "slru": lambda n: SLRU(n),
}
SCAN_ADMITS = ("cold", "probation")   # where scan-resistant admission puts a miss (scan_admit)

# name -> (scope, factory(group_of_key, capacity, next_use) -> policy, halve_every_tokens)
POLICIES = {
    "lru": ("layer", lambda g, c, nu: _c._LRUPol(g, c), 0),
    "lfu": ("layer", lambda g, c, nu: _c._LFUPol(g, c, False), 0),
    "slru": ("layer", lambda g, c, nu: _c._SLRUPol(g, c, 20), 0),
    "opt": ("layer", lambda g, c, nu: _c._OptPol(g, c, nu), 0),
    "g-lru": ("class", lambda g, c, nu: _c._LRUPol(g, c), 0),
    "g-lfu-decay": ("class", lambda g, c, nu: _c._LRUPol(g, c, EVICTIONS["lfu-decay"]), 0),
    "lfu-subst": ("layer", lambda g, c, nu: _c._LRUPol(g, c, EVICTIONS["lfu-subst"]), 0),
    "g-lfu-subst": ("class", lambda g, c, nu: _c._LRUPol(g, c, EVICTIONS["lfu-subst"]), 0),
    "g-slru": ("class", lambda g, c, nu: _c._LRUPol(g, c, EVICTIONS["slru"]), 0),
    "g-lfu": ("class", lambda g, c, nu: _c._LFUPol(g, c, True), G_LFU_HALVE_EVERY),
    "arc": ("class", lambda g, c, nu: _c._ARCPol(g, c), 0),
    "lru-2": ("class", lambda g, c, nu: _c._LRU2Pol(g, c), 0),
    "w-tinylfu-1": ("class", lambda g, c, nu: _c._WTinyLFUPol(g, c, 1), 0),
    "w-tinylfu-10": ("class", lambda g, c, nu: _c._WTinyLFUPol(g, c, 10), 0),
    "g-opt": ("class", lambda g, c, nu: _c._OptPol(g, c, nu), 0),
}
NEEDS_FUTURE = {"opt", "g-opt"}
ALIASES = {"w-tinylfu": ["w-tinylfu-1", "w-tinylfu-10"], "all": list(POLICIES)}

__all__ = ["LRU", "LFUDecay", "SLRU", "SCAN_ADMITS", "EVICTIONS", "LFU_DECAY_HALVE_AFTER", "LFU_SUBST_HALVE_AFTER",
           "LFU_SUBST_USE", "LFU_SUBST_CAND", "make_eviction", "POLICIES", "NEEDS_FUTURE", "ALIASES", "G_LFU_HALVE_EVERY", "expand_policies",
           "make_policy", "build_stream", "next_use", "replay", "replay_subst"]


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


def make_eviction(name: str, n_keys: int):
    """The daemon's eviction order ``name`` (a key of :data:`EVICTIONS`) over ``n_keys`` keys;
    ValueError naming the choices otherwise."""
    if name not in EVICTIONS:
        raise ValueError(f"eviction: found {name!r}, expected one of {', '.join(EVICTIONS)}")
    return EVICTIONS[name](n_keys)


def make_policy(name, group_of_key, capacity, next_use=None):
    """Build simulator policy ``name`` over keys grouped by ``group_of_key`` (int [n_keys],
    group id per key) with ``capacity[g]`` slots per group. ``next_use`` (int64 [A], from
    :func:`next_use`) is required by ``opt``/``g-opt``. The policy carries its name and its
    halving period (``halve_every``, tokens; 0 = never), which :func:`replay` applies."""
    if name not in POLICIES:
        expand_policies([name])
    if name in NEEDS_FUTURE and next_use is None:
        raise ValueError(f"policy {name}: needs next_use (the future of the access stream)")
    pol = POLICIES[name][1](group_of_key, capacity, next_use)
    pol.name = name
    pol.halve_every = POLICIES[name][2]
    return pol


def replay(pol, keys, set_start, set_layer, set_counted, set_tokens_before, n_layers,
           set_cold=None, scan_admit="cold"):
    """Replay an access stream (from :func:`build_stream`) through ``pol`` (from
    :func:`make_policy`). ``set_cold`` (uint8 [S], optional): sets whose misses are admitted
    at the cold end (the policies driving a daemon eviction order: its ``insert(k,
    cold=True)``), or with ``scan_admit = "probation"`` at its probation point
    (``insert_probation``); ValueError for other policies. Returns (hits int64 [n_layers],
    accesses int64 [n_layers]). Semantics: docs/policies.md ("How accesses are counted",
    "Scan-resistant admission")."""
    if scan_admit not in SCAN_ADMITS:
        raise ValueError(f"scan_admit: found {scan_admit!r}, expected one of {', '.join(SCAN_ADMITS)}")
    return _c.replay(pol, keys, set_start, set_layer, set_counted, set_tokens_before, n_layers,
                     set_cold, scan_admit == "probation")


def replay_subst(pol, keys, key_score, set_start, set_layer, set_counted, set_tokens_before,
                 n_layers, cand_start, cand_keys, cand_score, r, max_swaps=-1, refresh=False):
    """:func:`replay` where a missing routed expert may be replaced by a resident candidate
    scoring >= ``r`` x its score, at most ``max_swaps`` per set (< 0: no cap). Returns (hits,
    accesses, substituted), int64 [n_layers] each. Exact rule: docs/policies.md
    ("Substitution"). ValueError for ``opt``/``g-opt`` (their release order needs every
    access's stream position; a given candidate has none) and for r outside [0, 1]."""
    if getattr(pol, "name", None) in NEEDS_FUTURE:
        raise ValueError(f"policy {pol.name}: substitution replays online policies only")
    if not 0.0 <= float(r) <= 1.0:
        raise ValueError(f"substitution tolerance r: found {r}, expected 0 <= r <= 1")
    return _c.replay_subst(pol, keys, key_score, set_start, set_layer, set_counted,
                           set_tokens_before, n_layers, cand_start, cand_keys, cand_score,
                           float(r), int(max_swaps), bool(refresh))
