"""Small counters for the cache: a read-latency histogram with exact recent percentiles.

``LatencyHistogram`` keeps (a) power-of-two microsecond buckets over the whole run and (b) a ring
of the last ``window`` samples, from which p50/p99 are computed exactly (numpy) on demand. Adding
a sample is O(1) and allocation-free; it is called under the cache lock from reader callbacks.
"""
from __future__ import annotations

import numpy as np

__all__ = ["LatencyHistogram", "hit_rate"]


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
    """

    def __init__(self, n_buckets: int = 32, window: int = 8192):
        self.counts = [0] * n_buckets
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
