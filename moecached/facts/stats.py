"""The daemon's counters: their declarations, and a read-latency histogram.

Each counter and gauge is declared once, as a :class:`Stat` row (stats key, kind, Prometheus
name, help, where the value lives): :data:`CACHE_STATS` (top level), :data:`SERVER_COUNTERS`
(``stats["server"]``), :data:`FAST_PATH_STATS` (``stats["fast_path"]``), :data:`CLASS_STATS`
(``stats["classes"][]``), :data:`LAYER_STATS` (``stats["layers"][layer]``) and
:data:`CLIENT_STATS` (``stats["clients"][]``). ``ExpertCache.stats()``, the server's per-client
summary, ``moecache-ctl stats`` and the exporter (``moecached.tools.metrics``) are generated
from them, and tests/test_metrics.py checks every row against each view and
docs/operations.md.

``LatencyHistogram`` keeps (a) power-of-two microsecond buckets over the whole run and (b) a ring
of the last ``window`` samples, from which p50/p99 are computed exactly (numpy) on demand. Adding
a sample is O(1) and allocation-free; the reader pool calls it under its lock as each read job
finishes (the one read-latency measurement: ``ExpertCache.stats()["read_latency"]`` and the
pool's ``latency_hist`` are views of it).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Union

import bisect
import time

import numpy as np

__all__ = ["LatencyHistogram", "hit_rate", "Stat", "CACHE_STATS", "SERVER_COUNTERS", "FAST_PATH_STATS",
           "LAYER_STATS", "CLASS_STATS", "CLIENT_STATS"]


class Stat(NamedTuple):
    """One top-level counter or gauge of the ``stats`` reply.

    key: its name in ``stats``; kind: ``"counter"`` (grows from 0 while the daemon runs) or
    ``"gauge"`` (a value now); metric: the Prometheus family, without the ``moecached_`` prefix
    (counters get ``_total``); help: the metric's help text; value: where it lives, as each
    table says (an attribute name, or a function of what the table names), or None when the
    server fills it in (``Server.stats``).
    """
    key: str
    kind: str
    metric: str
    help: str
    value: Union[str, Callable, None]


def _warm(cache, what: str):
    """A warm-fill counter of ``cache`` (``moecached.engine.warmth.WarmCounters``), 0 before any."""
    w = getattr(cache, "warm", None)
    return getattr(w, what) if w is not None else 0


#: The cache's counters and gauges, in ``stats()`` order (``ExpertCache.stats`` builds them
#: from these rows, the exporter exposes each one). value: an ``ExpertCache`` attribute name,
#: or a function ``cache -> value``.
CACHE_STATS = (
    Stat("hits", "counter", "hits", "requested experts already resident when asked for",
         lambda c: sum(c._l_hits)),
    Stat("demand_misses", "counter", "demand_misses", "requested experts read while the client waited",
         lambda c: sum(c._l_miss)),
    Stat("prefetch_hits", "counter", "prefetch_hits",
         "requested experts a prefetch had brought in (or was bringing in)", lambda c: sum(c._l_pf)),
    Stat("substitutions", "counter", "substitutions",
         "requested experts not resident that an acquire's resident substitute candidate replaced",
         lambda c: sum(c._l_subst)),
    Stat("prefetches", "counter", "prefetches", "prefetch reads queued", "c_prefetches"),
    Stat("prefetches_dropped", "counter", "prefetches_dropped",
         "prefetches not queued: max_prefetch_loads, or the sender's client_max_prefetch, already in flight",
         "c_pf_dropped"),
    Stat("prefetches_dropped_low_confidence", "counter", "prefetches_dropped_low_confidence",
         "prefetched experts dropped: confidence below prefetch_min_confidence", "c_pf_low_conf"),
    Stat("prefetches_displaced", "counter", "prefetches_displaced",
         "queued prefetch reads withdrawn at a prefetch cap for ones of higher confidence",
         "c_pf_displaced"),
    Stat("prefetches_dropped_hot", "counter", "prefetches_dropped_hot",
         "prefetches not queued: their slot would have cost a demand-hot expert", "c_pf_hot"),
    Stat("prefetch_loads_in_flight", "gauge", "prefetch_loads_in_flight", "prefetch loads in flight now",
         "_pf_loading"),
    Stat("wasted_prefetches", "counter", "wasted_prefetches",
         "prefetched experts evicted before anyone used them", "c_wasted"),
    Stat("evictions", "counter", "evictions", "slots reclaimed for other experts", "c_evictions"),
    Stat("ghost_hits", "counter", "ghost_hits",
         "demand misses one more step of budget would have been hits (several models: the split's input)",
         "c_ghost_hits"),
    Stat("bytes_read", "counter", "read_bytes", "bytes read from the model files", "c_bytes"),
    Stat("reads", "counter", "reads", "completed expert reads", "c_reads"),
    Stat("read_errors", "counter", "read_errors", "failed expert reads", "c_read_errors"),
    Stat("reads_discarded", "counter", "reads_discarded",
         "completed reads not published: their slot's generation moved while they were in flight "
         "(must stay 0)", "c_reads_discarded"),
    Stat("reads_in_flight", "gauge", "reads_in_flight", "expert reads queued or running now", "c_inflight"),
    Stat("leases", "counter", "leases", "leases granted", "c_leases"),
    Stat("leases_open", "gauge", "leases_open", "leases held by clients now", lambda c: len(c._leases)),
    Stat("waiting", "gauge", "acquires_waiting", "requests waiting for a slot now", lambda c: len(c._waitq)),
    Stat("acquires_queued", "counter", "acquires_queued", "requests that had to wait for a slot", "c_waits"),
    Stat("pinned", "gauge", "pinned_slots", "slots pinned by open leases now",
         lambda c: sum(p.lru.pinned for p in c._pools)),
    Stat("map_repairs", "counter", "resident_map_repairs",
         "resident-map entries another process had changed, written back by the daemon",
         lambda c: c._layout.map_repairs),
    Stat("shrink_events", "counter", "budget_shrinks", "times the memory floor shrank the cache budget",
         "c_shrinks"),
    Stat("grow_events", "counter", "budget_grows", "times the memory floor grew the cache budget back",
         "c_grows"),
    Stat("repunched_bytes", "counter", "arena_repunched_bytes",
         "bytes of given-back slots a process had read back into memory, punched out again", "c_repunched"),
    Stat("warm_loaded", "counter", "warm_loaded",
         "experts loaded by warm fills (the state file at start, moecache-ctl warm)",
         lambda c: _warm(c, "loaded")),
    Stat("warm_bytes", "counter", "warm_bytes", "bytes of the experts warm fills loaded",
         lambda c: _warm(c, "bytes")),
    Stat("warm_seconds", "counter", "warm_seconds", "seconds warm fills ran (a running one up to now)",
         lambda c: _warm(c, "seconds")),
    Stat("warm_wanted", "gauge", "warm_wanted",
         "experts the last warm fill set out to load (absent ones that fit the free slots)",
         lambda c: _warm(c, "wanted")),
    Stat("warm_pending", "gauge", "warm_pending",
         "experts the running warm fill has yet to load (0: none runs; C engines wait for 0 at connect)",
         lambda c: _warm(c, "pending")),
    Stat("run_reads", "counter", "run_reads",
         "read jobs that loaded a run of consecutive experts at once (warm fills, fill_run)",
         "c_run_reads"),
    Stat("run_loads", "counter", "run_loads", "expert loads read in such runs", "c_run_loads"),
    Stat("uptime_s", "gauge", "uptime_seconds", "seconds since the daemon started", None),
)

#: The server's own counters (``stats["server"]``), exported as ``server_<key>``.
SERVER_COUNTERS = tuple(
    Stat(k, "counter", f"server_{k}", f"server {k.replace('_', ' ')} (all clients)", None)
    for k in ("requests", "errors", "malformed", "undeliverable", "clients_dropped", "rate_limited",
              "pin_file_errors", "pin_files_truncated", "socket_rebinds", "not_permitted", "throttled",
              "prefetches_coalesced"))

#: The shared-memory hit path over all clients (``stats["fast_path"]``), exported as ``fast_*``.
#: value: a function ``cache -> value`` (under the cache's lock).
FAST_PATH_STATS = (
    Stat("pin_files", "gauge", "fast_pin_files", "pin files open now (fast-path clients)",
         lambda c: len(c._shm.files)),
    Stat("fast_hits", "counter", "fast_hits",
         "hits clients took through shared memory (also in hits/prefetch_hits)",
         lambda c: c._shm.fast_hits + sum(f.hits + f.prefetch_hits for f in c._shm.files)),
    Stat("ring_drops", "counter", "fast_ring_drops", "hit-ring entries dropped: key out of range or not resident",
         lambda c: c._shm.drops_closed + sum(f.drops for f in c._shm.files)),
    Stat("ring_resets", "counter", "fast_ring_resets",
         "hit rings reset because a client wrote an implausible head", lambda c: c._shm.resets),
    Stat("ring_skipped", "counter", "fast_ring_skipped",
         "hit-ring entries skipped unread: a uid's clients wrote more than fast_path_hit_rate per second",
         lambda c: c._shm.skipped_closed + sum(f.skipped for f in c._shm.files)),
    Stat("pins_honoured", "gauge", "fast_pins_honoured", "slots held by honoured shared-memory pins now",
         lambda c: sum(len(f.honoured) for f in c._shm.files)),
    Stat("pinned", "gauge", "fast_pinned_slots",
         "slots clients pin through shared memory now, over all pin files (honoured or not)",
         lambda c: c._shm.pinned_now()),
    Stat("pins_ignored", "counter", "fast_pins_ignored",
         "shared-memory pins found past a client's quota (ignored)",
         lambda c: c._shm.ignored_closed + sum(f.ignored for f in c._shm.files)),
    Stat("evictions_held", "counter", "fast_evictions_held",
         "victims skipped because a shared-memory pin held them", lambda c: c._shm.evictions_held),
    Stat("held_keys", "gauge", "fast_held_keys", "experts the LRU keeps pinned for the fast path now",
         lambda c: len(c._held)),
)

#: Per layer (``stats["layers"][layer]``, label ``layer``), exported as ``layer_*``. value: the
#: name of the ``ExpertCache`` list indexed by layer.
LAYER_STATS = (
    Stat("hits", "counter", "layer_hits", "requested experts already resident, per layer", "_l_hits"),
    Stat("demand_misses", "counter", "layer_demand_misses", "requested experts read while the client waited, "
         "per layer", "_l_miss"),
    Stat("prefetch_hits", "counter", "layer_prefetch_hits", "requested experts a prefetch had brought in, "
         "per layer", "_l_pf"),
    Stat("reads", "counter", "layer_reads", "completed expert reads, per layer", "_l_reads"),
    Stat("substitutions", "counter", "layer_substitutions", "requested experts not resident that a resident "
         "substitute candidate replaced, per layer", "_l_subst"),
)

#: Per size class (``stats["classes"][]``, label ``size_class``), exported as ``class_*``.
#: value: a function ``(SizeClass, its pools) -> value``; the counters are the class's layers'
#: :data:`LAYER_STATS` summed (value: the same per-layer list name).
CLASS_STATS = (
    Stat("slot_bytes", "gauge", "class_slot_size_bytes", "bytes per slot of the size class",
         lambda c, pools: c.slot_bytes),
    Stat("slots_max", "gauge", "class_slots_max", "slots of the size class at the configured budget",
         lambda c, pools: sum(p.max_cap for p in pools)),
    Stat("slots", "gauge", "class_slots", "slots of the size class now", lambda c, pools: sum(p.cap for p in pools)),
    Stat("used", "gauge", "class_used_slots", "slots of the size class resident or loading now",
         lambda c, pools: sum(len(p.lru) for p in pools)),
    Stat("pinned", "gauge", "class_pinned_slots", "slots of the size class pinned by open leases now",
         lambda c, pools: sum(p.lru.pinned for p in pools)),
    Stat("loading", "gauge", "class_loading_slots", "slots of the size class being read now",
         lambda c, pools: sum(len(p.loading) for p in pools)),
    Stat("free", "gauge", "class_free_slots", "free slots of the size class now",
         lambda c, pools: sum(len(p.free) for p in pools)),
) + tuple(Stat(s.key, s.kind, "class_" + s.metric[len("layer_"):], s.help.replace("per layer", "per size class"),
               s.value) for s in LAYER_STATS)

#: Per connected client (``stats["clients"][]``, labels ``client``, ``pid``), exported as
#: ``client_*``. value: a function ``(server._Client, fast) -> value``, ``fast`` being the
#: client's shared-memory hit-path counts (``_Client.fast_counts()``).
CLIENT_STATS = (
    Stat("leases", "gauge", "client_leases", "leases the client holds now", lambda c, f: len(c.leases)),
    Stat("pending", "gauge", "client_pending_acquires", "acquires of the client waiting now",
         lambda c, f: len(c.pending)),
    Stat("requests", "counter", "client_requests", "requests of the client", lambda c, f: c.requests),
    Stat("acquires", "counter", "client_acquires", "acquires of the client", lambda c, f: c.acquires),
    Stat("hits", "counter", "client_hits", "requested experts of the client already resident",
         lambda c, f: c.hits + f["hits"]),
    Stat("prefetch_hits", "counter", "client_prefetch_hits",
         "requested experts of the client a prefetch had brought in", lambda c, f: c.prefetch_hits + f["prefetch_hits"]),
    Stat("demand_misses", "counter", "client_demand_misses", "requested experts of the client read while it waited",
         lambda c, f: c.misses),
    Stat("fast_hits", "counter", "client_fast_hits", "hits the client took through shared memory",
         lambda c, f: f["fast_hits"]),
    Stat("ring_drops", "counter", "client_ring_drops", "hit-ring entries of the client dropped",
         lambda c, f: f["ring_drops"]),
    Stat("ring_resets", "counter", "client_ring_resets", "hit rings of the client reset (implausible head)",
         lambda c, f: f["ring_resets"]),
    Stat("ring_skipped", "counter", "client_ring_skipped",
         "hit-ring entries of the client skipped unread (its uid over fast_path_hit_rate)",
         lambda c, f: f["ring_skipped"]),
    Stat("pins_honoured", "gauge", "client_pins_honoured",
         "slots the client's honoured shared-memory pins hold now", lambda c, f: f["pins_honoured"]),
    Stat("fast_pins", "gauge", "client_fast_pins",
         "slots the client pins through shared memory now (honoured or not)", lambda c, f: f["fast_pins"]),
    Stat("pins_ignored", "counter", "client_pins_ignored", "shared-memory pins of the client past its quota",
         lambda c, f: f["pins_ignored"]),
    Stat("substitutions", "counter", "client_substitutions",
         "requested experts of the client replaced by a resident substitute candidate",
         lambda c, f: sum(c.subst.values())),
    Stat("prefetches", "counter", "client_prefetches", "prefetches of the client", lambda c, f: c.prefetches),
    Stat("prefetches_dropped", "counter", "client_prefetches_dropped", "prefetches of the client not queued",
         lambda c, f: c.pf.dropped),
    Stat("prefetch_loads_in_flight", "gauge", "client_prefetch_loads_in_flight",
         "prefetch loads of the client in flight now (client_max_prefetch caps them)", lambda c, f: c.pf.in_flight),
    Stat("rate_limited", "counter", "client_rate_limited", "requests of the client over the rate limit or with too many waiting for its loop share",
         lambda c, f: c.rate_limited),
    Stat("throttled", "counter", "client_throttled",
         "requests of the client held back: over its share of the daemon's loop",
         lambda c, f: c.throttled),
    Stat("prefetches_coalesced", "counter", "client_prefetches_coalesced",
         "held-back prefetches of the client replaced by a newer one (never carried out)",
         lambda c, f: c.coalesced),
    Stat("errors", "counter", "client_errors", "error replies to the client", lambda c, f: c.errors),
    Stat("stall_s", "counter", "client_stall_seconds", "time the client's acquires waited for reads",
         lambda c, f: round(c.stall_s, 6)),
    Stat("idle_s", "gauge", "client_idle_seconds", "seconds since the client's last request",
         lambda c, f: round(time.monotonic() - c.last_seen, 3)),
)


def hit_rate(hits: int, prefetch_hits: int, demand_misses: int):
    """Share of requested experts that needed no read while the client waited:
    ``(hits + prefetch_hits) / (hits + prefetch_hits + demand_misses)``, None before any."""
    looked = hits + prefetch_hits + demand_misses
    return (hits + prefetch_hits) / looked if looked else None


class LatencyHistogram:
    """Latencies in seconds; buckets ``[2**i, 2**(i+1))`` microseconds, ``i = 0 .. n_buckets-1``.

    Bucket 0 also holds everything below 1 us, the last bucket everything above.

    Args:
        n_buckets: number of buckets (default 32: up to ~71 minutes).
        window: samples kept for exact percentiles (default 8192).
        edges: optional fixed bucket upper edges in seconds, counted as well (``edge_counts``:
            ``len(edges) + 1`` counts, the last one above the last edge), for a Prometheus
            histogram.
    """

    def __init__(self, n_buckets: int = 32, window: int = 8192, edges=()):
        self.counts = [0] * n_buckets
        self.edges = list(edges)
        self.edge_counts = [0] * (len(self.edges) + 1)
        self.n = 0
        self.sum_s = 0.0
        self.max_s = 0.0
        self._ring = np.zeros(window, dtype=np.float64)
        self._w = window

    def add(self, seconds: float) -> None:
        """Record one latency (seconds, >= 0)."""
        us = int(seconds * 1e6)
        b = us.bit_length() - 1 if us > 0 else 0
        if b >= len(self.counts):
            b = len(self.counts) - 1
        self.counts[b] += 1
        if self.edges:
            self.edge_counts[bisect.bisect_left(self.edges, seconds)] += 1
        self._ring[self.n % self._w] = seconds
        self.n += 1
        self.sum_s += seconds
        if seconds > self.max_s:
            self.max_s = seconds

    def percentile_us(self, q: float) -> float | None:
        """``q``-th percentile (0..100) in microseconds over the last ``window`` samples, or None."""
        m = min(self.n, self._w)
        if m == 0:
            return None
        return float(np.percentile(self._ring[:m], q) * 1e6)

    def to_dict(self) -> dict:
        """``{"count", "mean_us", "max_us", "p50_us", "p99_us", "buckets_us": {upper_us: count}}``.

        ``buckets_us`` lists only non-empty buckets, keyed by their exclusive upper bound in us
        (as a string, JSON-friendly).
        """
        return {
            "count": self.n,
            "mean_us": (self.sum_s / self.n * 1e6) if self.n else None,
            "max_us": self.max_s * 1e6 if self.n else None,
            "p50_us": self.percentile_us(50),
            "p99_us": self.percentile_us(99),
            "buckets_us": {str(2 ** (i + 1)): c for i, c in enumerate(self.counts) if c},
        }
