"""Fairness between the clients of one server: the per-client limits (request rate, prefetch
loads in flight) and their fair share. :class:`ServerFairness` is a part of
:class:`moecached.service.server.Server` (docs/operations.md, "Fairness between clients").
"""
from __future__ import annotations

import time


class ServerFairness:
    """The per-client limits of :class:`moecached.service.server.Server` (a part of it)."""

    def set_client_limits(self, rate: float, burst: float, max_prefetch: int | None) -> None:
        """Apply the per-client limits (at start and on reload): ``rate`` requests/s (0: off),
        ``burst`` requests, ``max_prefetch`` prefetch loads in flight per client (None: the
        cache's ``max_prefetch_loads``; 0: no own cap). Connected clients get the new values at
        once."""
        self.rate_limit.rate = max(0.0, float(rate))
        self.rate_limit.burst = max(1.0, float(burst))
        self._auto_pf = max_prefetch is None   # fair share of max_prefetch_loads (see below)
        if max_prefetch is None:
            max_prefetch = int(getattr(self.cache, "max_prefetch_loads", 0))
        self.client_max_prefetch = int(max_prefetch) or None
        for c in self.clients.values():
            c.pf.limit = self.client_max_prefetch

    #: a client that acquired or prefetched within this many seconds shares the prefetch loads
    ACTIVE_S = 2.0

    def _fair_prefetch_share(self, c) -> int:
        """``client_max_prefetch`` left to the daemon: ``max_prefetch_loads`` split evenly
        between the engines active now (acquired or prefetched within ``ACTIVE_S``), so a lone
        engine keeps all of it and a prefetch storm beside a demand-only engine keeps half,
        leaving it slots and disk time."""
        now = time.monotonic()
        active = sum(1 for x in self.clients.values()
                     if x is not c and (x.acquires or x.prefetches) and now - x.last_seen < self.ACTIVE_S)
        return max(1, (self.client_max_prefetch or 0) // (1 + active))
