"""The prefetch gate (a part of ``moecached.engine.cache.ExpertCache``): which prefetched
experts get a load.

Prefetch pays only when the drive has slack, so a prefetch never waits and never jumps the
queue: resident or loading experts are skipped, and so is an expert whose pool has no slot
for it now (all pinned) or acquires queued for slots. Beyond ``max_prefetch_loads`` prefetch
loads in flight (queued or reading, not yet demanded), or the sender's own
:class:`PrefetchQuota`, new prefetches are dropped (counted), so a noisy predictor cannot
bury demand reads.

Confidence (docs/policies.md, "Prefetch confidence"): each prefetched expert carries a
confidence in [0, 1] (1 without one). Below ``prefetch_min_confidence`` it is dropped; the
experts of one prefetch are taken highest confidence first; at a cap, a queued read not yet
started of lower confidence (the sender's own when its own cap is the one reached) is
withdrawn for it (``moecached.engine.loads.Loads.withdraw``); a prefetch never evicts a
*demand-hot* expert (``moecached.engine.pools.Pools.evict``).

Prefetched experts enter the LRU at the cold end and are marked *unused*; the first demand use
counts a prefetch hit and moves them hot; evicting an unused one counts a wasted prefetch.

Lock discipline: :meth:`PrefetchGate.plan` and :meth:`PrefetchGate.queue` run under the
cache's lock (the caller holds it); a sender's ``PrefetchQuota`` is changed only there.
Counters: ``c_prefetches`` (reads queued), ``c_pf_dropped`` (a cap), ``c_pf_low_conf``,
``c_pf_displaced`` (queued reads withdrawn), ``c_pf_hot`` (the only victim was demand-hot).
"""
from __future__ import annotations

from moecached.engine.errors import RequestError

__all__ = ["PrefetchQuota", "PrefetchGate"]


class PrefetchQuota:
    """One sender's share of the prefetch loads (the server keeps one per client).

    Attributes:
        limit: most prefetch loads of this sender in flight (queued or reading, not yet
            demanded); beyond it the sender's new prefetches are dropped. None: no own limit
            (the cache's ``max_prefetch_loads`` still applies).
        in_flight: its prefetch loads in flight now (kept by the cache, under its lock; a load
            stops counting when it lands, fails or a demand takes it over).
        dropped: its prefetch reads not queued because a limit (its own or the cache's) was
            reached.
        past_cap: the cache's ``max_prefetch_loads`` does not apply to this sender's loads (a
            warm fill reading runs keeps two runs in flight: its own window is the limit; its
            loads still count in the cache's, so engines' prefetches wait for it to end).
    """
    __slots__ = ("limit", "in_flight", "dropped", "past_cap")

    def __init__(self, limit: int | None = None, past_cap: bool = False):
        self.limit = limit
        self.in_flight = 0
        self.dropped = 0
        self.past_cap = past_cap


class PrefetchGate:
    """The prefetch rules of one cache (see module doc) over ``layout``, ``pools`` and
    ``loads``. ``max_prefetch_loads``: None: two layers' worth of top-k per size class of
    ``index``, at least 16. ``prefetch_min_confidence``: the config key of that name (a
    reload sets the attribute)."""

    def __init__(self, layout, pools, loads, index, max_prefetch_loads=None,
                 prefetch_min_confidence: float = 0.0):
        self.layout = layout
        self.pools = pools
        self.loads = loads
        self.max_prefetch_loads = int(max_prefetch_loads) if max_prefetch_loads is not None else \
            max(16, 2 * max(1, int(getattr(index, "top_k", 0) or 8)) * max(1, len(index.size_classes)))
        self.prefetch_min_confidence = float(prefetch_min_confidence)
        self.c_prefetches = 0
        self.c_pf_dropped = 0
        self.c_pf_low_conf = 0    # prefetched experts dropped below prefetch_min_confidence
        self.c_pf_displaced = 0   # queued prefetch reads withdrawn for higher-confidence ones
        self.c_pf_hot = 0         # prefetches dropped: the only victim was demand-hot

    def plan(self, requests, conf) -> list:
        """Validate a prefetch of ``[(layer, [experts]), ...]`` with ``conf`` (``[[confidence
        per expert], ...]`` or None: all 1): ``[(confidence, _Layer, expert), ...]`` in request
        order. RequestError on a bad layer, expert or confidence (nothing is queued then)."""
        layers = self.layout.layers
        todo = []
        for i, (layer, experts) in enumerate(requests):
            L = layers.get(layer)
            if L is None:
                raise RequestError(f"layer {layer!r}: not a layer with routed experts")
            cs = conf[i] if conf is not None else None
            if cs is not None and len(cs) != len(experts):
                raise RequestError(f"conf of layer {layer}: {len(cs)} values for {len(experts)} "
                                   f"experts, expected one per expert")
            for j, e in enumerate(experts):
                e = int(e)
                if not 0 <= e < L.ne:
                    raise RequestError(f"layer {layer} expert {e}: out of range 0..{L.ne - 1}")
                c = 1.0 if cs is None else float(cs[j])
                if not 0.0 <= c <= 1.0:
                    raise RequestError(f"conf of layer {layer} expert {e}: {c!r}, expected 0..1")
                todo.append((c, L, e))
        return todo

    def queue(self, todo: list, quota, by_conf: bool, waiting, readers, submits: list) -> tuple:
        """Start the loads of the planned ``todo`` that pass the gate (``by_conf``: highest
        confidence first; ``waiting``: pools acquires wait in; ``readers``: for withdrawals).
        Returns ``(reads queued, whether a read was withdrawn)``: a withdrawn read may have
        freed a slot for a waiting acquire."""
        loads, pools = self.loads, self.pools
        own = quota.limit if quota is not None and quota.limit is not None else None
        if by_conf:
            todo.sort(key=lambda t: -t[0])   # stable: request order among equals
        full, hot = set(), set()   # pools with no slot for a prefetch now / only hot victims
        displaced = False
        queued = 0
        floor = self.prefetch_min_confidence
        for c, L, e in todo:
            pool = L.pool
            if pool in waiting or pool in full:
                continue
            if pool.alloc[L.base + e] >= 0:
                continue
            if c < floor:
                self.c_pf_low_conf += 1
                continue
            if pool in hot:
                self.c_pf_hot += 1
                continue
            mine = own is not None and quota.in_flight >= own
            capped = quota is None or not quota.past_cap
            over = mine or (capped and loads.pf_loading >= self.max_prefetch_loads)
            if over and loads.withdraw(c, quota if mine else None, readers):
                self.c_pf_displaced += 1
                displaced = True
                if pool.alloc[L.base + e] >= 0:
                    continue   # the withdrawn read had evicted this very expert: it is back
                over = (capped and loads.pf_loading >= self.max_prefetch_loads) or (
                    own is not None and quota.in_flight >= own)
            if over:
                self.c_pf_dropped += 1
                if quota is not None:
                    quota.dropped += 1
                continue
            s, victim = pools.take_slot(pool, True)
            if s < 0:
                if s == -2:
                    self.c_pf_hot += 1
                    hot.add(pool)
                else:
                    full.add(pool)
                continue
            loads.start(L, e, s, False, submits, victim, quota=quota, conf=c)
            queued += 1
            self.c_prefetches += 1
        return queued, displaced
