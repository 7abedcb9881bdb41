"""The daemon's counters: their declarations, and a read-latency histogram.

:data:`CACHE_STATS` and :data:`SERVER_COUNTERS` declare each top-level counter and gauge once
(stats key, kind, Prometheus name, help, where the value lives); ``ExpertCache.stats()`` and the
exporter (``moecached.tools.metrics``) are both generated from them, and docs/operations.md is
checked against them (tests/test_metrics.py).

``LatencyHistogram`` keeps (a) power-of-two microsecond buckets over the whole run and (b) a ring
of the last ``window`` samples, from which p50/p99 are computed exactly (numpy) on demand. Adding
a sample is O(1) and allocation-free; the reader pool calls it under its lock as each read job
finishes (the one read-latency measurement: ``ExpertCache.stats()["read_latency"]`` and the
pool's ``latency_hist`` are views of it).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Union

import bisect

import numpy as np

__all__ = ["LatencyHistogram", "hit_rate", "Stat", "CACHE_STATS", "SERVER_COUNTERS"]


class Stat(NamedTuple):
    """One top-level counter or gauge of the ``stats`` reply.

    key: its name in ``stats``; kind: ``"counter"`` (grows from 0 while the daemon runs) or
    ``"gauge"`` (a value now); metric: the Prometheus family, without the ``moecached_`` prefix
    (counters get ``_total``); help: the metric's help text; value: where it lives: the name
    of an ``ExpertCache`` attribute, a function ``cache -> value``, or None when the server
    fills it in (``Server.stats``).
    """
    key: str
    kind: str
    metric: str
    help: str
    value: Union[str, Callable, None]


#: The cache's counters and gauges, in ``stats()`` order (``ExpertCache.stats`` builds them
#: from these rows, the exporter exposes each one).
CACHE_STATS = (
    Stat("hits", "counter", "hits", "requested experts already resident when asked for",
         lambda c: sum(c._l_hits)),
    Stat("demand_misses", "counter", "demand_misses", "requested experts read while the client waited",
         lambda c: sum(c._l_miss)),
    Stat("prefetch_hits", "counter", "prefetch_hits",
         "requested experts a prefetch had brought in (or was bringing in)", lambda c: sum(c._l_pf)),
    Stat("prefetches", "counter", "prefetches", "prefetch reads queued", "c_prefetches"),
    Stat("prefetches_dropped", "counter", "prefetches_dropped",
         "prefetches not queued: max_prefetch_loads, or the sender's client_max_prefetch, already in flight",
         "c_pf_dropped"),
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
    Stat("reads_in_flight", "gauge", "reads_in_flight", "expert reads queued or running now", "c_inflight"),
    Stat("leases", "counter", "leases", "leases granted", "c_leases"),
    Stat("leases_open", "gauge", "leases_open", "leases held by clients now", lambda c: len(c._leases)),
    Stat("waiting", "gauge", "acquires_waiting", "requests waiting for a slot now", lambda c: len(c._waitq)),
    Stat("acquires_queued", "counter", "acquires_queued", "requests that had to wait for a slot", "c_waits"),
    Stat("pinned", "gauge", "pinned_slots", "slots pinned by open leases now",
         lambda c: sum(p.lru.pinned for p in c._pools)),
    Stat("shrink_events", "counter", "budget_shrinks", "times the memory floor shrank the cache budget",
         "c_shrinks"),
    Stat("grow_events", "counter", "budget_grows", "times the memory floor grew the cache budget back",
         "c_grows"),
    Stat("uptime_s", "gauge", "uptime_seconds", "seconds since the daemon started", None),
)

#: The server's own counters (``stats["server"]``), exported as ``server_<key>``.
SERVER_COUNTERS = tuple(
    Stat(k, "counter", f"server_{k}", f"server {k.replace('_', ' ')} (all clients)", None)
    for k in ("requests", "errors", "malformed", "undeliverable", "clients_dropped", "rate_limited",
              "socket_rebinds"))


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
