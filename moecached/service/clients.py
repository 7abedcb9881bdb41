"""What a server keeps of each client, and how a client's life ends.

:class:`_Client` is one connection (one ZeroMQ routing id): its leases, requests in flight,
counters, rate-limit bucket, prefetch quota and pin file; ``summary`` is its entry in stats.
:class:`ServerClients` (a part of :class:`moecached.service.server.Server`) watches local clients
through a pidfd of their process (verified by its start time), opens and closes their pin
files (the shared-memory hit path), and drops a client (its leases and pending acquires
released) when its process exits, it goes silent for ``heartbeat_s`` (unwatched clients
only), or it truncates its pin file.
"""
from __future__ import annotations

import logging
import os
import select
from collections import deque

import numpy as np

from moecached.facts import protocol as P
from moecached.service._serve import TokenBucket
from moecached.engine._shm import RING_N, PinFile
from moecached.engine.cache import PrefetchQuota
from moecached.service.fairness import LoopBucket
from moecached.service.endpoint import _pidfd_open, process_start_time
from moecached.service.pindoor import sealed_pin_fd
from moecached.service.identity import PID_MAX, claimed_pid_matches, parse_peer, process_uid
from moecached.facts.stats import CLIENT_STATS, hit_rate

log = logging.getLogger("moecached.service.server")


class _Client:
    __slots__ = ("ident", "delim", "name", "hello", "pid", "first_seen", "last_seen", "leases", "pending",
                 "requests", "acquires", "hits", "misses", "prefetch_hits", "prefetches",
                 "errors", "stall_s", "pidfd", "bucket", "pf", "rate_limited", "pins", "fast_closed",
                 "subst", "peer_addr", "peer", "admin", "pin_words", "loop",
                 "throttled", "coalesced", "ctl", "held", "held_pf")

    def __init__(self, ident: bytes, now: float, burst: float = 1.0, max_prefetch=None,
                 peer_addr: str | None = None):
        self.ident = ident
        # the connection's credentials as the kernel gave them (moecached.service.identity);
        # ``admin``: whether it may change the daemon (set by the server)
        self.peer_addr = peer_addr
        self.peer = parse_peer(peer_addr)
        self.admin = False
        self.pin_words = None   # (byte offset, count) of its pin file's u32 pin counts
        # its share of the loop (moecached.service.fairness): its loop bucket; its control
        # bucket (its uid's unless an admin: set by the server); its requests held back, in
        # order; requests held, held ones replaced by newer
        self.loop = LoopBucket()
        self.ctl = None
        self.held = deque()     # its requests that are not the hot path, waiting in order
        self.held_pf = None     # its newest noreply prefetch, waiting
        self.throttled = self.coalesced = 0
        self.delim = False  # the client frames requests REQ-style (empty delimiter first)
        self.name = ident.hex()
        self.hello = False   # it said hello (a connection that only pings, a health check, never does)
        self.pid = None
        self.first_seen = self.last_seen = now
        self.leases: set[int] = set()
        self.pending: dict[int, int] = {}  # ticket -> request id
        self.requests = self.acquires = self.hits = self.misses = 0
        self.prefetch_hits = self.prefetches = self.errors = 0
        self.stall_s = 0.0
        self.subst: dict[int, int] = {}   # layer -> its missing experts replaced by a substitute
        self.pidfd = None  # pidfd of the client's process when watched (ipc + verified pid)
        self.bucket = TokenBucket(burst, now)    # request rate limit (Server.rate_limit)
        self.pf = PrefetchQuota(max_prefetch)     # its prefetch loads in flight / dropped
        self.rate_limited = 0                     # requests refused or dropped: over the rate limit
        self.pins = None   # its pin file (moecached.engine._shm.PinFile) when it uses the fast path
        # counters of its pin files already closed (a new hello, a reload)
        self.fast_closed = dict.fromkeys(("fast_hits", "ring_drops", "ring_resets", "ring_skipped",
                                         "pins_ignored"), 0)

    def fold_pins(self) -> None:
        """Its pin file is closing: keep what it counted (hits go to the socket counters)."""
        pf, self.pins = self.pins, None
        if pf is not None:
            self.hits += pf.hits
            self.prefetch_hits += pf.prefetch_hits
            info = pf.info()
            for k in self.fast_closed:
                self.fast_closed[k] += info[k]

    def fast_pins(self) -> int:
        """Slots its pin file pins now (honoured or not): read with ``pread``, so a pin file
        cut short under the daemon reads as fewer pins, never as a fault."""
        pf, words = self.pins, self.pin_words
        fd = getattr(pf, "fd", None)
        if fd is None or words is None:
            return 0
        off, n = words
        try:
            data = os.pread(fd, 4 * n, off)
        except OSError:
            return 0
        return int(np.count_nonzero(np.frombuffer(data, dtype="<u4", count=len(data) // 4)))

    def fast_counts(self) -> dict:
        """Its shared-memory hit-path counts (closed pin files plus the open one), with ``hits``
        and ``prefetch_hits`` its open pin file took (they count as socket hits would)."""
        pf = self.pins
        fast = dict(self.fast_closed, pins_honoured=0, hits=0, prefetch_hits=0, fast_pins=self.fast_pins())
        if pf is not None:
            fast["hits"], fast["prefetch_hits"] = pf.hits, pf.prefetch_hits
            for k, v in pf.info().items():
                fast[k] += v
        return fast

    def summary(self) -> dict:
        """Its ``stats["clients"][]`` entry: the rows of ``moecached.facts.stats.CLIENT_STATS`` plus
        name, id, pid, hit_rate, fast_path and watched."""
        fast = self.fast_counts()
        out = {"name": self.name, "id": self.ident.hex(), "pid": self.pid}
        out.update((s.key, s.value(self, fast)) for s in CLIENT_STATS)
        out.update(hit_rate=hit_rate(out["hits"], out["prefetch_hits"], out["demand_misses"]),
                   substitutions_by_layer={str(k): v for k, v in sorted(self.subst.items())},
                   fast_path=self.pins is not None,
                   watched="process" if self.pidfd is not None else "heartbeat")
        return out


class ServerClients:
    """The client lifetime of :class:`moecached.service.server.Server` (a part of it)."""

    def _drop_client(self, c: _Client, why: str, tell: bool = False) -> None:
        """Release ``c``'s leases and pending acquires and forget it. ``tell``: the client may
        still be there (it was only silent): answer each pending acquire with an error rather
        than leave it waiting for a reply that would never come."""
        for ticket, rid in list(c.pending.items()):
            self.cache.cancel(ticket)
            if tell:
                self._send_error(c.ident, rid, P.E_TIMEOUT,
                                 f"client {c.name} was {why} (heartbeat_s {self.heartbeat_s:g}): its "
                                 "pending acquires and leases were released; ping while idle, retry")
        c.pending.clear()
        n = 0
        for lid in list(c.leases):
            _, lease = self.leases.pop(lid)
            self.cache.release(lease)
            n += 1
        c.leases.clear()
        self._close_pins(c)
        self._unwatch(c)
        self.clients.pop(c.ident, None)
        self.counters["clients_dropped"] += 1
        if c.hello:   # (the engines' departures, not every health check's)
            gone = c.summary()
            gone["left"] = why
            self.departed.append(gone)
        if n:
            log.info("client %s (pid %s) %s: released %d leases", c.name, c.pid, why, n)

    def _expire_clients(self, now: float) -> None:
        """Release the leases of watched clients whose process exited, and of unwatched ones
        silent for longer than ``heartbeat_s`` (a watched client may stall for any time)."""
        if self._watched:
            for fd, _ in self._watch.poll(0):
                c = self._watched.get(fd)
                if c is not None:
                    self._drop_client(c, "process exited")
        for c in list(self.clients.values()):
            if c.pidfd is None and now - c.last_seen > self.heartbeat_s:
                self._drop_client(c, f"silent for {now - c.last_seen:.1f}s", tell=True)

    def _watch_client(self, c: _Client, pid, pid_start) -> None:
        """Watch ``c``'s process when hello names it: the pid must be the one the kernel says
        connected (``c.peer``, SO_PEERCRED; or its number in the client's own pid namespace),
        else ``pid_mismatch``; the process is then watched by its pid here, verified by its
        start time and by running as the connection's uid (a pid reused since is not it)."""
        self._unwatch(c)
        if type(pid) is not int or not 0 < pid <= PID_MAX:
            return     # no possible process: served as a client without a pid (heartbeat)
        peer = c.peer
        if not self._ipc or peer.pid is None:
            return     # tcp, or a peer in a pid namespace not visible from here: heartbeat
        if not claimed_pid_matches(peer, pid):
            raise P.ProtocolError(P.E_PID_MISMATCH, f"hello claims pid {pid}, but this connection "
                                  f"was made by pid {peer.pid} (uid {peer.uid}, as the kernel says)")
        pid = peer.pid
        c.pid = pid
        if type(pid_start) is not int:
            return
        fd = _pidfd_open(pid)
        if fd is None:
            return
        if process_start_time(pid) != pid_start or process_uid(pid) != peer.uid:
            os.close(fd)    # not that process any more (its pid was reused)
            return
        c.pidfd = fd
        self._watched[fd] = c
        self._watch.register(fd, select.POLLIN)

    def _open_pins(self, c: _Client, by_fd: bool = True) -> dict | None:
        """A pin file for watched client ``c`` (its hello asked for the fast path): the
        ``pins`` field of the hello reply, or None (fast path off, client not watched, a client
        that cannot take its pin file as an fd (``pin_fd``), or the file could not be made:
        logged, and everything goes over the socket). The pin file is a sealed memfd handed
        over by the door (``moecached.service.pindoor``): no process can change its size, so
        none can make its client fault."""
        self._close_pins(c)
        if not self.pin_files or c.pidfd is None or self._door is None or not by_fd:
            return None
        cache = self.cache
        shm = cache._shm
        quota = int(self.pin_quota or cache.default_pin_quota())
        self._pin_seq += 1
        name = f"moecached-pins-{self.session:016x}-{self._pin_seq}"
        try:
            fd = sealed_pin_fd(name, int(shm.file_size), shm.header(self.session, quota))
        except OSError as e:
            self.counters["pin_file_errors"] += 1
            log.warning("cannot create pin file %s for client %s (pid %s): %s; it uses the socket",
                        name, c.name, c.pid, e.strerror or e)
            return None
        try:
            f = PinFile(f"memfd:{name}", fd, shm.file_size, quota)
        except BaseException:
            os.close(fd)
            raise
        with cache._lock:    # (ExpertCache.open_pin_file's registration, for an fd made here)
            shm.add(f, c.peer.uid)   # its uid's pin files share one hit-ring budget
        c.pins = f
        c.pin_words = (int(shm.pins_off), int(shm.n_slots_total))
        return {"door": self._door.path, "token": self._door.offer(fd, c.peer.uid, c.peer.pid),
                "size": f.size, "ring_n": RING_N, "pins_off": shm.pins_off,
                "ring_off": shm.ring_off, "quota": quota}

    def _drop_broken_pins(self, f) -> None:
        """``f`` was truncated under the daemon (its client's doing): drop that client."""
        self.counters["pin_files_truncated"] += 1
        c = next((c for c in self.clients.values() if c.pins is f), None)
        if c is None:
            self.cache.close_pin_file(f)
            return
        log.warning("client %s (pid %s) truncated its pin file %s: dropped (its leases released)",
                    c.name, c.pid, f.path)
        self._drop_client(c, "pin file truncated")

    #: seconds between two warnings about one uid's hit rings going over fast_path_hit_rate
    RING_WARN_S = 60.0

    def _check_hit_rings(self, now: float) -> None:
        """Every tick: warn about a uid whose hit-ring entries were skipped (its clients wrote
        more than ``fast_path_hit_rate`` per second together), one line per uid per
        ``RING_WARN_S`` however often they reconnect (the state is the uid's ``HitBudget``),
        naming the rate in force when they were skipped."""
        for uid, b in self.cache._shm.budgets.items():
            if b.skipped <= b.warned or now < b.warn_until:
                continue
            who = [f"{c.name} (pid {c.pid})" for c in self.clients.values()
                   if c.pins is not None and c.pins.budget is b and c.pins.skipped]
            log.warning("uid %s records hits in the shared-memory rings of its clients faster "
                        "than fast_path_hit_rate (%g entries/s, its clients together): %d entries "
                        "skipped since the last warning, not counted as hits (ring_skipped); "
                        "clients that skipped: %s. An engine records one entry per expert used, "
                        "far fewer: check those clients (a bug, or a flood); raise "
                        "fast_path_hit_rate only if their hits are real", uid, b.skip_rate,
                        b.skipped - b.warned, ", ".join(who[:4]) + (
                            f" and {len(who) - 4} more" if len(who) > 4 else "") or "none now")
            b.warn_until, b.warned = now + self.RING_WARN_S, b.skipped

    def _close_pins(self, c: _Client) -> None:
        f = c.pins
        c.fold_pins()
        if f is not None:
            self.cache.close_pin_file(f)

    def _unwatch(self, c: _Client) -> None:
        fd, c.pidfd = c.pidfd, None
        if fd is not None:
            self._watched.pop(fd, None)
            try:
                self._watch.unregister(fd)
            except (KeyError, ValueError):
                pass
            os.close(fd)
