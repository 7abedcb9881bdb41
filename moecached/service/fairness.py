"""Fairness between the clients of one server: the per-client limits (request rate, prefetch
loads in flight) and their fair share, and each client's share of the daemon's loop.

A request's cost to the loop is not its count: a prefetch naming every expert of every layer
costs the loop a hundred times a resident acquire, and a ``stats`` reply (every client, every
model) costs it more still, so a flood of either inside every request limit took the loop from
everyone else. Each request's loop time is therefore measured and charged to its client, in two
buckets of *loop time* (seconds), each refilled at ``client_loop_share`` of a second per second
while other clients are active (a client alone is never held back) and holding at most
:data:`LOOP_BURST_S`:

* the **loop** bucket of the client, charged for every request: over it (empty), its newest
  ``noreply`` prefetch waits (an older one it replaces is dropped, counted
  ``prefetches_coalesced``: a newer prediction supersedes it);
* the **control** bucket, charged only for what is not the cache's hot path (``stats``,
  ``status``, ``ping``, ``hello``, ``models``, ``clients``, traces, ``warm``, requests refused
  with an error), :data:`MESSAGE_COST_S` more per request: over it, such requests wait. It is
  one bucket per uid for clients that are no admin (``Peer-Address``: several connections of
  one user share it), one per connection for admins. An engine's acquires and releases never
  drain it, so a busy engine's ``stats`` are not held. Its debt is bounded (a flood delays its
  uid's next requests by about a second at most).

Over the loop bucket, a prefetch that wants a reply is answered at once with nothing queued
(``over_share``), not planned. Requests of the control kind wait in their client's queue, in
order among themselves; nothing of the hot path (acquires, releases, checks, cancels, ``bye``)
ever waits, nor queues behind them, except a release naming no lease of the client and a
``bye`` of a client that holds nothing (they give nothing back). A client with :data:`HELD_MAX` requests waiting has the next
refused ``rate_limited`` once, and further ones dropped (without decoding) until fewer wait.
``throttled`` counts the requests held back.
:class:`ServerFairness` is a part of :class:`moecached.service.server.Server`
(docs/operations.md, "Fairness between clients").
"""
from __future__ import annotations

import time

import msgpack

from moecached.facts import protocol as P
from moecached.service.identity import admin as is_admin, parse_peer

#: most loop time (seconds) a client may spend at once after being quiet
LOOP_BURST_S = 0.02
#: seconds between two looks at how many clients are active (the loop-share applies to >= 2)
SHARE_PERIOD_S = 0.1
#: seconds between two looks at held requests
HOLD_PERIOD_S = 0.003
#: loop and I/O time a message costs beyond what is measured around its handler (receiving it,
#: its reply's send, libzmq's I/O thread): charged to the control bucket with each request, so
#: a flood of cheap requests (pings) is held to its share too
MESSAGE_COST_S = 20e-6
#: requests one client may have held back; the next is refused ``rate_limited``
HELD_MAX = 64
#: ops of the cache's hot path: charged to the loop bucket only, never to the control bucket
HOT_OPS = frozenset({"acquire", "prefetch", "release", "cancel", "check", "bye"})
#: the msgpack bytes of ``"prefetch"``: a request without them is no prefetch
_PREFETCH = b"\xa8prefetch"
#: ... of ``"release"`` and ``"bye"`` (a request without them is neither: cheap to tell)
_RELEASE, _BYE, _ACQUIRE = b"\xa7release", b"\xa3bye", b"\xa7acquire"
#: ... of the key ``"noreply"`` and ``true``: nine bytes no request of the protocol carries
#: anywhere else (no string value, and each number of a list is one element: its bytes hold no
#: ``\xa7`` string header followed by ``true``)
_NOREPLY_TRUE = b"\xa7noreply\xc3"
#: fields a held request is recognised by (the rest of it is skipped, not decoded)
_PEEK = frozenset({"op", "id", "noreply", "lease"})


def peek(payload: bytes):
    """``(op, id, noreply, lease)`` of a request frame without decoding the rest of it (each
    absent, or not of its type: None). Only the map's keys and these values are decoded, within
    the protocol's limits; anything malformed gives what was read before it."""
    op = rid = noreply = lease = None
    try:
        up = msgpack.Unpacker(max_buffer_size=len(payload) + 1, **P.UNPACK_LIMITS)
        up.feed(payload)
        for _ in range(min(up.read_map_header(), P.MAX_MAP_LEN)):
            k = up.unpack()
            if k.__class__ is str and k in _PEEK:
                v = up.unpack()
                if k == "op":
                    op = v if v.__class__ is str else None
                elif k == "noreply":
                    noreply = v if v.__class__ is bool else None
                elif v.__class__ is int and 0 <= v < 2**64:
                    if k == "id":
                        rid = v
                    else:
                        lease = v
            else:
                up.skip()
    except Exception:
        pass
    return op, rid, noreply, lease


class LoopBucket:
    """Loop seconds one principal may still spend: refilled lazily at the share, at most
    :data:`LOOP_BURST_S`, its debt at most as much (a flood is held back a bounded while)."""
    __slots__ = ("tokens", "t")

    def __init__(self):
        self.tokens, self.t = LOOP_BURST_S, time.perf_counter()

    def refill(self, now: float, rate: float) -> float:
        """Its level now (refilled to ``now`` at ``rate`` seconds per second)."""
        tok = self.tokens + (now - self.t) * rate
        self.tokens = tok if tok < LOOP_BURST_S else LOOP_BURST_S   # NaN (0 x inf): full
        self.t = now
        return self.tokens

    def charge(self, now: float, rate: float, cost: float) -> None:
        tok = self.refill(now, rate) - cost
        self.tokens = tok if tok > -LOOP_BURST_S else -LOOP_BURST_S


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
        self._held: set = set()          # routing ids of clients with requests held back
        self._ctl_buckets: dict = {}     # uid -> the control bucket its non-admin clients share
        self._told: set = set()          # clients told their queue is full (until it is not)
        self._share_now = float("inf")   # refill rate now (inf: nobody is held back)
        self._next_share = 0.0
        # the op of the request being handled by the general path ("" when it has none); None
        # while the hot path serves it (so it is charged as the hot path)
        self._op = None

    def set_loop_share(self, share: float) -> None:
        """Apply ``client_loop_share`` (at start and on reload); 0 turns the holding off."""
        self.client_loop_share = max(0.0, float(share))
        self._next_share = 0.0           # the timer looks again at once

    def _ctl_bucket(self, c) -> LoopBucket:
        """The control bucket of a new client: its uid's (shared) unless it is an admin."""
        uid = getattr(c.peer, "uid", None)
        if c.admin or uid is None:
            return LoopBucket()
        b = self._ctl_buckets.get(uid)
        if b is None:
            b = self._ctl_buckets[uid] = LoopBucket()
        return b

    def _first_of_spent_uid(self, ident: bytes, peer: str | None):
        """A new connection whose uid (no admin) has spent its control share: its client, made
        now so that its first request waits like the others of its uid; else None."""
        uid = parse_peer(peer).uid if peer else None
        b = self._ctl_buckets.get(uid)
        if b is None or self._share_now == float("inf") or not b.refill(time.perf_counter(), self._share_now) < 0:
            return None
        if is_admin(parse_peer(peer), self.admin_gid):
            return None
        return self._new_client(ident, time.monotonic())

    def _charge(self, c, t0: float, t1: float) -> None:
        """Charge client ``c`` the loop time ``t1 - t0`` its request took (the request's op
        in ``self._op``; None: the hot path served it)."""
        op, self._op = self._op, None
        if c is None:
            return
        rate, cost = self._share_now, t1 - t0
        c.loop.charge(t1, rate, cost)
        if op is not None and op not in HOT_OPS:
            c.ctl.charge(t1, rate, cost + MESSAGE_COST_S)

    def _suspect(self, c) -> bool:
        """Whether ``c``'s next request may have to wait (cheap: no refill, no decoding)."""
        return bool(c.held) or c.held_pf is not None or c.loop.tokens < 0 or c.ctl.tokens < 0

    def _hold(self, c, frames: list) -> bool:
        """Hold ``c``'s request back (True) when it must wait for its share of the loop, or
        refuse it when too many wait; False: serve it now. Only two kinds ever wait: a
        ``noreply`` prefetch (the newest one, over the loop bucket) and what is not the hot
        path (in order, over the control bucket); acquires, releases and the rest of the hot
        path are served at once, never behind them."""
        held, payload = c.held, frames[-1]
        if (c.held_pf is not None and c.loop.tokens < 0 and len(payload) <= self.max_message_bytes
                and _NOREPLY_TRUE in payload and _PREFETCH in payload
                and c.loop.refill(time.perf_counter(), self._share_now) < 0):
            # a newer noreply prefetch of a client whose last one still waits for its share:
            # it replaces that one without being decoded (a flood of wide prefetches costs the
            # loop what receiving it does; one that only looks like a prefetch is told apart
            # when it runs, in _fair_timer)
            c.held_pf = frames
            c.coalesced += 1
            self.counters["prefetches_coalesced"] += 1
            self._held_back(c)
            return True
        if (len(held) >= HELD_MAX and c.ident in self._told and _RELEASE not in payload
                and _BYE not in payload and _ACQUIRE not in payload and _PREFETCH not in payload):
            # it sends without reading its replies: the cheapest way out (no decoding); it was
            # told once, when its queue filled up
            c.rate_limited += 1
            self.counters["rate_limited"] += 1
            c.throttled += 1
            self.counters["throttled"] += 1
            return True
        if not held:
            if self._share_now == float("inf"):
                return False
            if not c.ctl.tokens < 0 and _PREFETCH not in payload:
                return False   # only a prefetch could have to wait (a cheap look, no decoding)
        t0 = time.perf_counter()
        op, rid, noreply, lease = peek(payload)
        rate = self._share_now
        if op == "prefetch":
            if not c.loop.refill(t0, rate) < 0:
                return False
            if noreply is not True:
                # over its share, a prefetch that wants a reply is answered at once with nothing
                # queued, not planned (a prefetch is advice; a flood of them, each answered, went
                # around the share); the client's acquires are never held
                self._held_back(c)
                self._reply(c.ident, rid or 0, queued=0, over_share=True)
                self._op = op
                self._charge(c, t0, time.perf_counter())
                return True
            if c.held_pf is not None:            # a newer prediction supersedes the held one
                c.coalesced += 1
                self.counters["prefetches_coalesced"] += 1
            c.held_pf = frames
            self._held.add(c.ident)
        elif op in HOT_OPS and not self._gives_nothing_back(c, op, lease):
            return False
        elif not held and not c.ctl.refill(t0, rate) < 0:
            return False
        elif len(held) >= HELD_MAX:
            c.rate_limited += 1
            self.counters["rate_limited"] += 1
            if noreply is not True and c.ident not in self._told:   # told once, then dropped
                self._send_error(c.ident, rid or 0, P.E_RATE_LIMITED,
                                 f"client {c.name} has {len(held)} requests waiting for its share of "
                                 f"the daemon's loop (client_loop_share {self.client_loop_share:g}); "
                                 "wait for their replies before sending more (until fewer wait, "
                                 "further requests are dropped without a reply)")
                self._told.add(c.ident)
        else:
            held.append(frames)
            self._held.add(c.ident)
        self._held_back(c)
        self._op = op if op is not None else ""
        self._charge(c, t0, time.perf_counter())   # the look at it is its own loop time too
        return True

    def _held_back(self, c) -> None:
        """Count a request of ``c`` held back, replaced or answered without being carried out
        (``throttled``); the client is active (it sent it)."""
        c.throttled += 1
        self.counters["throttled"] += 1
        c.last_seen = time.monotonic()

    def _gives_nothing_back(self, c, op, lease) -> bool:
        """A ``bye`` of a client that holds nothing, or a ``release`` of one ``lease`` that is
        not the client's (``leases`` counts as giving back): nothing that must never wait, so
        it waits like a control request when its share is spent (a flood of them, each a new
        client or an error, went around every limit)."""
        if op == "bye":
            return not c.leases and not c.pending and c.pins is None
        if op == "release" and lease is not None:
            owner = self.leases.get(lease)
            return owner is None or owner[0] != c.ident
        return False

    def _run_held(self, ident, frames) -> None:
        """Serve a request that waited (the general path unless the hot path takes it)."""
        t = time.perf_counter()
        self._op = None
        try:
            served = self._fast(frames)
        except Exception:
            served = False
        if not served:
            self._handle(frames)
        self._charge(self.clients.get(ident), t, time.perf_counter())

    def _fair_timer(self, now: float) -> None:
        """The loop's timer: how many clients are active (the share applies from two on), and
        the held requests of clients whose bucket filled up again, run now, in order."""
        if now >= self._next_share:
            active = sum(1 for x in self.clients.values() if now - x.last_seen < self.ACTIVE_S)
            share = self.client_loop_share
            self._share_now = share if share > 0 and active >= 2 else float("inf")
        pc = time.perf_counter
        rate = self._share_now
        soonest = SHARE_PERIOD_S    # seconds until a held request may run (the next look)
        blocked = set()             # control buckets found empty in this pass (shared per uid)
        for ident in list(self._held):
            c = self.clients.get(ident)
            if c is None or (not c.held and c.held_pf is None):
                self._held.discard(ident)
                self._told.discard(ident)
                continue
            if c.held_pf is not None:
                tok = c.loop.refill(pc(), rate)
                if not tok < 0:
                    frames, c.held_pf = c.held_pf, None
                    # it replaced the one before on a look at its bytes: what is no prefetch
                    # goes the way its op goes (a control request waits for the control share)
                    if peek(frames[-1])[0] == "prefetch" or not self._hold(c, frames):
                        self._run_held(ident, frames)
                else:
                    soonest = min(soonest, -tok / rate)
            held = c.held
            b = c.ctl
            while held and self.clients.get(ident) is c:
                if id(b) in blocked or b.refill(pc(), rate) < 0:
                    if id(b) not in blocked:
                        blocked.add(id(b))
                        soonest = min(soonest, -b.tokens / rate)
                    break
                self._run_held(ident, held.popleft())
            if len(held) < HELD_MAX:
                self._told.discard(ident)
            if self.clients.get(ident) is not c or (not held and c.held_pf is None):
                self._held.discard(ident)
        # with many clients waiting on a drained share, the next look is when it has refilled,
        # not every HOLD_PERIOD_S (each look walks every client that waits)
        self._next_share = now + (max(HOLD_PERIOD_S, soonest) if self._held else SHARE_PERIOD_S)
