"""The protocol operations of a server that serve one client's own work: ``hello``, ``ping``,
``acquire``, ``prefetch``, ``release``, ``cancel``, ``bye`` (the general path: the Cython hot
path serves the common resident acquires and noreply releases before these, with the same
result). :class:`ServerOps` is a part of :class:`moecached.service.server.Server`; the views
(``stats``, ``status``, traces) are in ``moecached.service.views``, the control plane
(``clients``, who may change the daemon) in ``moecached.service.admin``.
"""
from __future__ import annotations

import heapq
import time

from moecached import __version__
from moecached.facts import protocol as P
from moecached.service.clients import _Client


class ServerOps:
    """The per-client operations of :class:`moecached.service.server.Server` (a part of it)."""

    def _op_hello(self, c: _Client, rid: int, msg: dict) -> None:
        want = msg.get("model")
        if want is not None and (not isinstance(want, str) or not want):
            raise P.ProtocolError(P.E_BAD_TYPE, "field 'model' must be a non-empty string")
        if self.route_model is not None:
            where = self.route_model(self, want)
            if where is not None:   # served on its own endpoint: the client says hello there
                self._reply(c.ident, rid, redirect=where, model_name=want)
                self._redirected(c)
                return
        self._hello_reply(c, rid, self._hello_client(c, msg))

    def _redirected(self, c: _Client) -> None:
        """A client was sent to its model's own socket (a Router forgets it)."""

    def _hello_client(self, c: _Client, msg: dict) -> bool:
        """What hello says of the client (name, pid: watched): whether it asks for the
        shared-memory hit path."""
        name = msg.get("client")
        if name is not None:
            if not isinstance(name, str) or not name:
                raise P.ProtocolError(P.E_BAD_TYPE, "field 'client' must be a non-empty string")
            c.name = name[:64]
        c.hello = True
        c.pid = c.peer.pid   # as the kernel says; a claimed pid is checked against it
        self._watch_client(c, msg.get("pid"), msg.get("pid_start"))
        fast = msg.get("fast_path", False)
        if not isinstance(fast, bool):
            raise P.ProtocolError(P.E_BAD_TYPE, f"field 'fast_path' = {fast!r:.20}: expected true or false")
        # the pin file is a sealed memfd the client fetches from the door (pin_fd): a client
        # that could only open a path uses the socket
        return fast and msg.get("pin_fd") is True

    def _hello_reply(self, c: _Client, rid: int, fast: bool) -> None:
        pins = self._open_pins(c) if fast else None
        if not fast:
            self._close_pins(c)
        idx = self.index
        self._reply(c.ident, rid, protocol=P.PROTOCOL_VERSION, server=f"moecached {__version__}",
                    fingerprint=idx.fingerprint(), model=self.model_path,
                    model_files=[{k: f[k] for k in ("path", "size", "mtime_ns", "dev", "ino")}
                                 for f in idx.file_facts()],
                    model_name=self.model_name, arena=self.cache.descriptor(), index=idx.to_json(),
                    expert_layers=list(idx.expert_layers), n_experts=idx.n_experts,
                    top_k=idx.top_k, heartbeat_s=self.heartbeat_s,
                    lease_watch="process" if c.pidfd is not None else "heartbeat", pins=pins,
                    limits={"max_message_bytes": self.max_message_bytes,
                            "max_array_len": P.MAX_ARRAY_LEN, "max_map_len": P.MAX_MAP_LEN,
                            "max_str_len": P.MAX_STR_LEN,
                            "max_request_experts": self.checker.max_experts,
                            "client_rate_limit": self.rate_limit.rate,
                            "client_rate_burst": self.rate_limit.burst,
                            "client_max_prefetch": self.client_max_prefetch or 0,
                            "fast_path_hit_rate": self.pin_hit_rate})

    def _op_ping(self, c: _Client, rid: int, msg: dict) -> None:
        # warm_pending: what an engine waiting for the warm fill polls (cheap, unlike stats)
        w = getattr(self.cache, "warm", None)
        self._reply(c.ident, rid, t=time.time(), warm_pending=w.pending if w is not None else 0)

    def _op_acquire(self, c: _Client, rid: int, msg: dict) -> None:
        reqs = self.checker.requests(msg)
        tag = msg.get("tag")
        if tag is not None and tag not in ("prompt", "decode"):
            raise P.ProtocolError(P.E_BAD_TYPE, f"field 'tag' = {tag!r:.20}: expected 'prompt' or 'decode'")
        timeout_ms = msg.get("timeout_ms")
        if timeout_ms is not None:
            timeout_ms = P._int(msg, "timeout_ms", lo=0, hi=86_400_000)
        elif self.acquire_timeout_s is not None:
            timeout_ms = int(self.acquire_timeout_s * 1000)
        subst = self.checker.subst(msg, reqs)
        box: list = []
        ident = c.ident
        ticket = self.cache.acquire_async(reqs, lambda res: self._complete(ident, rid, box, tag, res), tag=tag,
                                          subst=subst)
        box.append(ticket)
        if subst is not None and self.recorder is not None:
            box.append(subst)   # read by _drain_done, for the trace
        # The callback may already have run inline (all resident): then it is in self.done
        # with box filled now, and _drain_done sees the ticket as pending below.
        c.pending[ticket] = rid
        if timeout_ms is not None and ticket in c.pending:
            heapq.heappush(self.deadlines, (time.monotonic() + timeout_ms / 1000, ticket, ident, rid))
        self._drain_done()

    def _op_prefetch(self, c: _Client, rid: int, msg: dict) -> None:
        quiet = self._noreply(msg)
        if "layers" in msg and self._prefetch_noop(msg):
            if not quiet:
                self._reply(c.ident, rid, queued=0)
            return
        reqs = self.checker.requests(msg)
        conf = self.checker.confidence(msg, reqs)
        if self._auto_pf:
            c.pf.limit = self._fair_prefetch_share(c)
        n = self.cache.prefetch_many(reqs, c.pf, conf)
        c.prefetches += n
        if not quiet:
            self._reply(c.ident, rid, queued=n)

    def _prefetch_noop(self, msg: dict) -> bool:
        """True when a prefetch of several layers has nothing to do: each layer's experts are
        resident or loading, checked layer by layer in Cython (``cache.prefetch_noop``) without
        the general path's validation and planning of every expert (16 layers of 64: 408 us of
        the loop otherwise). Any doubt (a field it does not check, a repeated layer, too many
        experts, a bad id): False, and the general path answers it precisely."""
        raw = msg["layers"]
        if type(raw) is not list or not raw or "layer" in msg or "experts" in msg or "conf" in msg:
            return False
        seen, total, noop, most = set(), 0, self.cache.prefetch_noop, self.checker.max_experts
        for it in raw:
            if type(it) is not list or len(it) != 2 or type(it[0]) is not int or type(it[1]) is not list:
                return False
            layer, experts = it
            total += len(experts)
            if layer in seen or total > most or not noop(layer, experts):
                return False
            seen.add(layer)
        return True

    def _op_release(self, c: _Client, rid: int, msg: dict) -> None:
        quiet = self._noreply(msg)
        if "leases" in msg and "lease" in msg:
            raise P.ProtocolError(P.E_BAD_TYPE, "give either 'lease' or 'leases', not both")
        if "leases" in msg:
            ids = msg["leases"]
            if not isinstance(ids, list):
                raise P.ProtocolError(P.E_BAD_TYPE, "field 'leases' must be an array of lease ids")
            _few_leases(ids)
        else:
            ids = [msg.get("lease")]
        for lid in ids:
            if isinstance(lid, bool) or not isinstance(lid, int) or not 0 <= lid < 2**64:
                raise P.ProtocolError(P.E_BAD_TYPE, f"lease id {lid!r:.30}: expected an unsigned 64-bit integer")
        # validate all before releasing any (all-or-nothing)
        for lid in ids:
            owner = self.leases.get(lid)
            if owner is None:
                if self.cache.own_lease_id(lid):
                    raise P.ProtocolError(P.E_UNKNOWN_LEASE, f"lease {lid} is not held: released twice or expired")
                raise P.ProtocolError(P.E_STALE_LEASE, f"lease {lid} was not issued by this daemon instance (stale: from before a restart?)")
            if owner[0] != c.ident:
                raise P.ProtocolError(P.E_NOT_OWNER, f"lease {lid} belongs to another client")
        for lid in ids:
            _, lease = self.leases.pop(lid)
            c.leases.discard(lid)
            self.cache.release(lease)
        if not quiet:
            self._reply(c.ident, rid, released=len(ids))

    def _op_check(self, c: _Client, rid: int, msg: dict) -> None:
        """Whether this client still holds each of ``leases`` (granted to it, not released,
        not taken back): the lease validity of a client without the shared-memory rule."""
        ids = msg.get("leases")
        if isinstance(ids, list):
            _few_leases(ids)
        if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
            raise P.ProtocolError(P.E_BAD_TYPE, "field 'leases' must be an array of lease ids")
        held = []
        for lid in ids:
            owner = self.leases.get(lid)
            held.append(owner is not None and owner[0] == c.ident)
        self._reply(c.ident, rid, held=held)

    def _op_cancel(self, c: _Client, rid: int, msg: dict) -> None:
        """Drop this client's pending acquire whose request id is ``request`` (its caller gave
        up): its pins go, its reads go on as prefetches, it gets no reply. ``cancelled`` is
        false when no such acquire is pending (already answered, or never sent)."""
        quiet = self._noreply(msg)
        target = P._int(msg, "request", lo=0, hi=2**64 - 1)
        ticket = next((t for t, r in c.pending.items() if r == target), None)
        done = ticket is not None and self.cache.cancel(ticket)
        if done:
            del c.pending[ticket]
        if not quiet:
            self._reply(c.ident, rid, cancelled=done)

    def _op_bye(self, c: _Client, rid: int, msg: dict) -> None:
        n = len(c.leases)
        self._reply(c.ident, rid, released=n)
        self._drop_client(c, "said bye")


def _few_leases(ids: list) -> None:
    """A release or check names at most ``MAX_LEASES_PER_REQUEST`` leases (each is looked at in
    the loop: a request of 65,536 took it for milliseconds)."""
    if len(ids) > P.MAX_LEASES_PER_REQUEST:
        raise P.ProtocolError(P.E_TOO_LARGE, f"field 'leases' names {len(ids)} leases: at most "
                              f"{P.MAX_LEASES_PER_REQUEST} per request; send several requests")
