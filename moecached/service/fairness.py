"""Fairness between the clients of one server: the per-client limits (request rate, prefetch
loads in flight) and their fair share, and each client's share of the daemon's loop.

A request's cost to the loop is not its count: a prefetch naming every expert of every layer
costs the loop a hundred times a resident acquire, so a flood of them inside every request
limit took the loop from everyone else. Each client therefore has a bucket of *loop time*
(seconds, measured around each of its requests), refilled at ``client_loop_share`` of a second
per second while other clients are active (a client alone is never held back), holding at most
:data:`LOOP_BURST_S`. A client whose bucket is empty has its ``noreply`` prefetches held back,
not carried out: the newest one waits (an older one it replaces is dropped, counted
``prefetches_coalesced``: a newer prediction supersedes it) and runs once the bucket is full
again; every other request of it is served as usual (releases must never wait) and charged.
``throttled`` counts the prefetches held back. :class:`ServerFairness` is a part of
:class:`moecached.service.server.Server` (docs/operations.md, "Fairness between clients").
"""
from __future__ import annotations

import time

#: most loop time (seconds) a client may spend at once after being quiet
LOOP_BURST_S = 0.02
#: seconds between two looks at how many clients are active (the loop-share applies to >= 2)
SHARE_PERIOD_S = 0.1
#: seconds between two looks at held prefetches
HOLD_PERIOD_S = 0.003
#: the msgpack bytes of ``"op": "prefetch"`` and ``"noreply": true`` (a held request is
#: recognised without decoding it: it is the sender's own request either way)
_PREFETCH, _NOREPLY = b"\xa8prefetch", b"\xa7noreply\xc3"


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

    # ---- each client's share of the loop -------------------------------------------------
    def _fair_init(self, share: float) -> None:
        self.client_loop_share = max(0.0, float(share))
        self._held: dict = {}          # routing id -> the frames of its held noreply prefetch
        self._share_now = float("inf")  # refill rate now (inf: nobody is held back)
        self._next_share = 0.0

    def _charge(self, c, t0: float, t1: float) -> None:
        """Charge client ``c`` the loop time ``t1 - t0`` its request took."""
        if c is None:
            return
        tok = c.loop_tokens + (t1 - c.loop_t) * self._share_now
        c.loop_tokens = (tok if tok < LOOP_BURST_S else LOOP_BURST_S) - (t1 - t0)
        c.loop_t = t1

    def _hold(self, c, frames: list) -> bool:
        """``c`` is over its loop share: hold its request back when it is a noreply prefetch
        (True), replacing one held before; anything else is served (False)."""
        payload = frames[-1]
        if _PREFETCH not in payload or _NOREPLY not in payload:
            return False
        if c.ident in self._held:
            c.coalesced += 1
            self.counters["prefetches_coalesced"] += 1
        self._held[c.ident] = frames
        c.throttled += 1
        self.counters["throttled"] += 1
        return True

    def _fair_timer(self, now: float) -> None:
        """The loop's timer: how many clients are active (the share applies from two on), and
        the held prefetches of clients whose bucket filled up again, run now."""
        pc = time.perf_counter()
        if now >= self._next_share:
            active = sum(1 for x in self.clients.values() if now - x.last_seen < self.ACTIVE_S)
            share = self.client_loop_share
            self._share_now = share if share > 0 and active >= 2 else float("inf")
        for ident, frames in list(self._held.items()):
            c = self.clients.get(ident)
            if c is None:
                del self._held[ident]
                continue
            self._charge(c, pc, pc)   # refill
            if c.loop_tokens >= 0:
                del self._held[ident]
                t0 = time.perf_counter()
                try:
                    served = self._fast(frames)
                except Exception:
                    served = False
                if not served:
                    self._handle(frames)
                self._charge(c, t0, time.perf_counter())
        self._next_share = now + (HOLD_PERIOD_S if self._held else SHARE_PERIOD_S)
