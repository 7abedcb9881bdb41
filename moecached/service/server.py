"""The moecached server: one ZeroMQ ROUTER socket in front of an ExpertCache.

One event-loop thread owns the socket (ZeroMQ sockets are not thread-safe) and blocks in one
``recv`` on it. Acquires are handed to the cache asynchronously; reader threads finish loads
and hand completions back to the loop through a deque plus a wake-up message sent to the same
ROUTER over inproc, so the loop never blocks on a read. Every request frame goes first to the
Cython hot path (``moecached.service._serve.FastPath``: resident acquires, own-lease noreply
releases); whatever it declines is handled by :meth:`Server._handle`, the reference
behaviour that also produces every error reply. Replies use ``ROUTER_MANDATORY``: a reply to
a client that vanished raises EHOSTUNREACH and the lease it carried is rolled back (released)
at once.

Leases belong to the ZeroMQ routing id (one DEALER connection) that took them. Who is on
the other end is the kernel's word, not the client's: on ipc every request's routing-id frame
carries the connection's uid, gid and pid (``SO_PEERCRED``, ``moecached.service.identity``); a
hello that claims another pid is refused, and a request under a routing id whose connection
changed belongs to a new client. A local client whose hello names its pid and that process's
start time is watched through a pidfd: its leases are kept while the process lives, however
long it stalls, and released as soon as it exits. Any other client that sends nothing for
``heartbeat_s`` seconds loses its leases; the Python client pings on its own while idle.
Wherever a lease is released without its holder's word, the generations of its slots in the
arena's control block move before the slots are reused, so the holder can tell
(docs/protocol.md, "Lease validity").

The server in parts: the endpoint's lock (``moecached.service.endpoint``); the clients and
their pin files (``clients``); the per-client ops (``ops``); stats, status and the trace ops
(``views``); who may change the daemon and the ``clients`` op (``admin``); the per-client
limits (``fairness``); sessions and cache changes (``session``); the several-models endpoint
(``router``).
"""
from __future__ import annotations

import collections
import errno
import heapq
import logging
import os
import select
import signal
import threading
import time

import msgpack
import zmq

from moecached import MoecacheError
from moecached.facts import protocol as P
from moecached.service._serve import FastPath, RateLimit, ServerHooks
from moecached.engine.arena import STATE_MODEL_CHANGED, STATE_SERVING
from moecached.service.admin import ServerAdmin
from moecached.service.clients import ServerClients, _Client
from moecached.service.endpoint import (ServerError, ServerSocketFile, _ipc_path,  # noqa: F401 (re-exported)
                       lock_endpoint, process_start_time, unlock_endpoint)
from moecached.service.identity import admin as is_admin
from moecached.service.fairness import ServerFairness
from moecached.service.ops import ServerOps
from moecached.service.pindoor import PinDoor, door_path
from moecached.service.session import ServerSession
from moecached.service.views import ServerViews

log = logging.getLogger("moecached.service.server")

_MORE_NB = int(zmq.SNDMORE | zmq.NOBLOCK)  # plain ints: enum flag arithmetic per send is slow
_NB = int(zmq.NOBLOCK)
#: environment variable: "0" starts every Server with ``fast_path`` False (the hot path off;
#: everything takes the general path). The test suite runs the server-facing tests both ways.
HOT_PATH_ENV = "MOECACHED_HOT_PATH"
#: ops never rate-limited: they give resources back (refusing them would keep pins)
_UNLIMITED_OPS = frozenset({"release", "bye"})


class Server(ServerOps, ServerClients, ServerViews, ServerAdmin, ServerFairness, ServerSession,
             ServerSocketFile):
    """Serves one ExpertCache on one ZeroMQ endpoint.

    Args:
        cache: a ``moecached.engine.cache.ExpertCache``.
        endpoint: ``ipc:///path`` (default deployment) or ``tcp://host:port``.
        model_path: shown in hello/stats.
        heartbeat_s: seconds of silence after which a client's leases are released.
        socket_mode / gid: permissions of the ipc socket file (0660, service group).
        on_tick: optional callable(now) run about every ``tick_s`` seconds in the loop
            (the memory floor hooks in here).
    Attributes:
        fast_path: True (default; False when the environment has ``MOECACHED_HOT_PATH=0``) to
            offer each request to the Cython hot path first; set it False before
            ``serve_forever`` to serve everything with :meth:`_handle` (tests compare the two).
        extra_stats: optional callable -> dict merged into ``stats`` (the memory floor's).
        extra_status: optional callable -> dict merged into ``status`` (the arena's health).
        endpoint_lock: the fd :func:`lock_endpoint` returned, when the caller took it first.
        on_model_change: optional callable(message) run in the loop thread after
            :meth:`model_changed` was called (from any thread) with why the model file is no
            longer the one indexed; the daemon reloads or exits there.
        rate_limit: the per-client request rate limit (``RateLimit``: ``rate`` per second,
            ``burst``); :meth:`set_client_limits` changes it.
    Fairness between clients (see docs/operations.md): ``client_rate_limit`` requests/s with
    bursts of ``client_rate_burst`` per client (0: off); a replied request over the limit is
    answered ``rate_limited``, a noreply prefetch is dropped, both counted per client;
    releases and bye are never limited. ``client_max_prefetch``: prefetch loads one client may
    have in flight (None: the cache's ``max_prefetch_loads``, so a lone client is limited as
    before; 0: no own cap); its prefetches beyond it are dropped and counted per client.
    With several models, each model's server routes a hello that names another model
    (``route_model``), and the daemon's endpoint is a :class:`moecached.service.router.Router`, a
    server of no model.
    Raises:
        ServerError: another daemon holds the endpoint, or the endpoint cannot be bound.
    """

    def __init__(self, cache, *, endpoint: str, model_path: str = "", heartbeat_s: float = 5.0,
                 socket_mode: int = 0o660, gid: int | None = None, on_tick=None, tick_s: float = 1.0,
                 max_request_experts: int = P.MAX_ARRAY_LEN, max_message_bytes: int = P.MAX_MESSAGE_BYTES,
                 acquire_timeout_s: float | None = None, endpoint_lock: int | None = None,
                 client_rate_limit: float = 0.0, client_rate_burst: float = 1.0,
                 client_max_prefetch: int | None = None, pin_files: bool = True,
                 pin_quota: int | None = None, admin_gid: int | None = None, model_dirs=(),
                 client_loop_share: float = 0.02, pin_hit_rate: float = 0.0):
        self.cache = cache
        self.index = cache.index if cache is not None else None   # None: a Router
        self.endpoint = endpoint
        self.model_path = model_path
        self.heartbeat_s = float(heartbeat_s)
        self.on_tick = on_tick
        self.tick_s = tick_s
        self.session = int.from_bytes(os.urandom(8), "little") >> 1 | 1
        self.started = time.time()
        # the control plane (moecached.service.admin): the admin_group's gid, model_dirs
        self.admin_gid = admin_gid
        self.model_dirs = tuple(model_dirs or ())
        self._peer_addr = None   # Peer-Address of the request being handled
        self._set_model(max_request_experts)
        self.max_message_bytes = int(max_message_bytes)
        # default deadline of an acquire that gives no timeout_ms (on_pressure = wait gives up)
        self.acquire_timeout_s = acquire_timeout_s
        # shared-memory hit path (config fast_path, fast_path_quota): a pin file per watched
        # client that asks for it in hello; pin_quota None or 0: the cache's default
        self.pin_files = bool(pin_files)
        self.pin_quota = pin_quota or None
        self._pin_seq = 0
        self.pin_hit_rate = 0.0
        self.set_pin_hit_rate(pin_hit_rate)
        self.clients: dict[bytes, _Client] = {}
        self._watch = select.poll()           # pidfds of watched clients (POLLIN: exited)
        self._watched: dict[int, _Client] = {}
        self.rate_limit = RateLimit()
        self.client_max_prefetch = None
        self.set_client_limits(client_rate_limit, client_rate_burst, client_max_prefetch)
        self._fair_init(client_loop_share)
        self.leases: dict[int, tuple[bytes, object]] = {}
        self.deadlines: list = []  # heap of (t, ticket, ident, rid)
        self.done = collections.deque()
        self.recorder = None
        self.recorder_client = None
        self.counters = collections.Counter()
        self.departed = collections.deque(maxlen=32)  # summaries of the last clients that left
        self.extra_stats = None  # optional callable -> dict merged into stats (the floor)
        self.extra_status = None  # optional callable -> dict merged into status
        self.on_model_change = None  # optional callable(message), run in the loop thread
        # several models (moecached.daemon.multi): this server's model name, ``route_model(server,
        # name) -> None (served here) | endpoint`` (raises ProtocolError for a model not
        # served), and the ``models`` op's handler ``(msg) -> dict``; None: one model
        self.model_name = None
        self.route_model = None
        self.models_handler = None
        self._model_change = None    # message waiting for on_model_change
        self._fast = None
        self._hooks = None   # the hot path's ServerHooks (kept current: see _fast_handler)
        self._stopping = False
        self._loop_tid = None
        self._hup = False        # SIGHUP seen; the loop runs self._on_hup
        self._ops = self._op_table()
        self._packb = msgpack.Packer(use_bin_type=True).pack  # reused; the loop thread only
        # serve resident acquires / own noreply releases in Cython first
        self.fast_path = os.environ.get(HOT_PATH_ENV, "1") != "0"
        self._on_hup = None
        self._lock_fd = None
        self._bound = None     # (mode, gid) of the ipc socket file once bound
        self._endpoint_lock = endpoint_lock
        self._ipc = _ipc_path(endpoint)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        # Frames up to 16x the limit are received and answered `malformed`; beyond that ZeroMQ
        # drops the connection without allocating (the only defence against a 2 GB frame).
        self.sock.setsockopt(zmq.MAXMSGSIZE, 16 * max(int(max_message_bytes), P.MAX_MESSAGE_BYTES))
        self._bind(socket_mode, gid)
        # pin files are handed out as sealed memfds through the door beside the socket
        self._door = None
        if self._ipc and self.pin_files and cache is not None:
            try:
                self._door = PinDoor(door_path(self._ipc), socket_mode, gid)
            except OSError as e:
                log.warning("cannot open the pin-file door %s: %s; clients use the socket only",
                            door_path(self._ipc), e)
        # Wake-ups (read completions from reader threads, stop, SIGHUP) arrive on the ROUTER
        # itself, from an inproc DEALER with a routing id no remote peer can hold (it connects
        # first, and the ROUTER refuses a second peer with the same id), so the loop blocks in
        # one recv on one socket: no poller, no ZMQ_EVENTS probing per message.
        self._wake_id = b"\xffmoecached-wake-" + os.urandom(8)
        wake_ep = f"inproc://moecached-wake-{os.getpid()}-{id(self):x}"
        self.sock.bind(wake_ep)
        self._wake_sock = self.ctx.socket(zmq.DEALER)
        self._wake_sock.setsockopt(zmq.ROUTING_ID, self._wake_id)
        self._wake_sock.setsockopt(zmq.LINGER, 0)
        self._wake_sock.setsockopt(zmq.SNDHWM, 0)
        self._wake_sock.connect(wake_ep)
        self._wake_lock = threading.Lock()
        self._wake_pending = False

    def _set_model(self, max_request_experts: int) -> None:
        """The model this socket serves: requests are checked against its index, and the
        arena's control block names the session it serves (leases of any other are void)."""
        self.cache.arena.set_epoch(self.session, STATE_SERVING)
        self.checker = P.RequestChecker(self.index.expert_layers, self.index.n_experts,
                                        max_experts=max_request_experts)
        self.moe_index = {l: i for i, l in enumerate(self.index.expert_layers)}

    def _op_table(self) -> dict:
        """op -> its handler."""
        return {op: getattr(self, "_op_" + op) for op in P.OPS}

    # ---- start / stop -------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the loop to stop (thread- and signal-safe)."""
        self._stopping = True
        self._wake()

    def install_signal_handlers(self, on_hup=None) -> None:
        """SIGTERM/SIGINT stop the loop gracefully; SIGHUP runs ``on_hup`` (reload) in the loop
        thread (a signal handler only sets a flag and wakes the loop)."""
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        signal.signal(signal.SIGINT, lambda *_: self.stop())
        if on_hup is not None:
            self._on_hup = on_hup

            def _hup(*_):
                self._hup = True
                self._wake()
            signal.signal(signal.SIGHUP, _hup)

    def close(self) -> None:
        """Fail pending requests, close the socket, remove the socket and lock files."""
        for c in list(self.clients.values()):
            for ticket, rid in list(c.pending.items()):
                self.cache.cancel(ticket)
                self._send_error(c.ident, rid, P.E_SHUTDOWN, "daemon is shutting down")
            c.pending.clear()
        self._drain_done(final=True)
        for lid, (ident, lease) in list(self.leases.items()):
            try:
                self.cache.release(lease)
            except Exception:
                pass
        self.leases.clear()
        for c in list(self.clients.values()):
            self._close_pins(c)
            self._unwatch(c)
        if self.recorder is not None:
            self._trace_stop()
        self.sock.close(linger=0)
        if self._door is not None:
            self._door.close()
        if self._ipc:
            for p in (self._ipc,):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            if self._lock_fd is not None:
                try:
                    os.unlink(self._ipc + ".lock")
                except FileNotFoundError:
                    pass
                os.close(self._lock_fd)
                self._lock_fd = None
        with self._wake_lock:
            self._wake_sock.close(linger=0)

    # ---- the loop ---------------------------------------------------------------------
    #: longest the loop sleeps in recv when no deadline is nearer (timers are checked then)
    IDLE_WAKE_MS = 100
    #: while something waits on a slot a fast-path pin holds, pins are swept this often (a
    #: release through shared memory sends no message: the sweep is how the loop sees it)
    PIN_DRAIN_MS = 3
    #: while pin files are open and nothing waits on one, their rings are drained this often
    #: (each wake costs the cores an engine computes on; a ring holds 16,384 hits, and every
    #: request drains them first, so the order of hits and requests is kept)
    PIN_SWEEP_MS = 20

    def serve_forever(self, ready=None) -> None:
        """Run the event loop until ``stop()``; then ``close()``.

        The loop blocks in one ``recv`` on the ROUTER socket (``RCVTIMEO`` = the idle wake, or
        less when an acquire deadline is nearer); wake-up messages from reader threads, ``stop``
        and SIGHUP arrive on the same socket. Heartbeat expiry and the periodic task run when
        their time has come, checked after every message or timeout (so at most
        ``IDLE_WAKE_MS`` late).

        Args:
            ready: optional callable run once the socket is bound and the loop starts
                (the daemon sends READY=1 to systemd here).
        """
        self._loop_tid = threading.get_ident()
        sock, wake_id = self.sock, self._wake_id
        idle_ms = self.IDLE_WAKE_MS
        cur_ms = idle_ms
        sock.setsockopt(zmq.RCVTIMEO, cur_ms)
        now = time.monotonic()
        next_tick = now
        next_hb = now + self.heartbeat_s / 4
        next_timer = min(next_tick, next_hb)
        last_sweep = now
        recv, more, pc = sock.recv, zmq.RCVMORE, time.perf_counter
        getmore = sock.getsockopt
        clients = self.clients
        handle = self._handle
        self._fast = fast = self._fast_handler()
        if ready:
            ready()
        try:
            while not self._stopping:
                try:
                    # the routing-id frame uncopied: it carries the connection's credentials
                    f0 = recv(0, False)
                    frames = [f0.bytes]
                    while getmore(more):
                        frames.append(recv())
                except zmq.Again:
                    frames = None
                except zmq.ZMQError as e:
                    if e.errno != errno.EINTR:
                        raise
                    frames = None
                if frames is not None:
                    if frames[0] == wake_id:
                        with self._wake_lock:
                            self._wake_pending = False  # before draining: no wake-up is lost
                        if self._hup and self._on_hup is not None:
                            self._hup = False
                            try:
                                self._on_hup()
                            except Exception as e:
                                log.error("reload failed: %s", e)
                        if self._model_change is not None:
                            msg, self._model_change = self._model_change, None
                            # shared-memory pins stop; resident hits go on over the socket
                            self.cache.arena.set_state(STATE_MODEL_CHANGED)
                            if self.on_model_change is not None:
                                try:
                                    self.on_model_change(msg)
                                except Exception:
                                    log.exception("model change handling failed")
                            fast = self._fast   # a reload starts a new session
                    else:
                        try:
                            peer = f0.get("Peer-Address")
                        except zmq.ZMQError:
                            peer = None
                        c = clients.get(frames[0])
                        if c is not None and c.peer_addr != peer:
                            self._replaced(c)
                        self._peer_addr = peer   # for a client first seen in _handle
                        if c is None and self._ctl_buckets:
                            c = self._first_of_spent_uid(frames[0], peer)
                        if c is None or not self._suspect(c) or not self._hold(c, frames):
                            t0 = pc()
                            try:
                                served = fast(frames)
                            except Exception:  # a bug in the hot path must not stop the loop
                                log.exception("internal error in the fast path; "
                                              "the request goes to the general path")
                                served = False
                            if not served:
                                handle(frames)
                            self._charge(c or clients.get(frames[0]), t0, pc())
                if self.done:
                    self._drain_done()
                dl = self.deadlines
                if dl or cur_ms != idle_ms or frames is None or time.monotonic() >= next_timer:
                    now = time.monotonic()
                    while dl and dl[0][0] <= now:
                        _, ticket, ident, rid = heapq.heappop(dl)
                        c = self.clients.get(ident)
                        if c is not None and ticket in c.pending and self.cache.cancel(ticket):
                            del c.pending[ticket]
                            c.errors += 1
                            self._send_error(ident, rid, P.E_TIMEOUT, "acquire timed out waiting for reads")
                    if now >= self._next_share:
                        self._fair_timer(now)   # held prefetches of clients back in budget
                    if now >= next_hb:
                        self._expire_clients(now)
                        next_hb = now + max(0.05, self.heartbeat_s / 4)
                    cache = self.cache   # None: a Router (no model)
                    if cache is not None and cache.pin_files and now - last_sweep >= self._pin_sweep_s(cache):
                        last_sweep = now
                        try:
                            self.cache.sweep_pins()
                            if self.recorder is not None:
                                self._record_fast_hits()
                            for f in self.cache.take_broken_pin_files():
                                self._drop_broken_pins(f)
                        except Exception:
                            log.exception("internal error draining the pin files")
                    if now >= next_tick:
                        next_tick = now + self.tick_s
                        self._check_socket_file()
                        if cache is not None:
                            self._check_resident_map()
                            if cache.pin_files:
                                self._check_hit_rings(now)
                        if self.on_tick is not None:
                            try:
                                self.on_tick(now)
                            except Exception as e:  # never let the floor kill the server
                                log.error("periodic task failed: %s", e)
                            fast = self._fast   # the periodic task may have reloaded the model
                    next_timer = min(next_tick, next_hb, self._next_share)
                    want = idle_ms
                    if dl:
                        want = max(0, min(idle_ms, int((dl[0][0] - now) * 1000) + 1))
                    cache = self.cache   # (the periodic task may have reloaded the model)
                    if cache is not None and cache.pin_files:
                        # releases through shared memory send no message: under a steady stream
                        # of requests the sweep must still come
                        sweep_at = last_sweep + self._pin_sweep_s(cache)
                        next_timer = min(next_timer, sweep_at)
                        want = min(want, max(1, int((sweep_at - now) * 1000) + 1))
                    if self._held:
                        want = min(want, self.PIN_DRAIN_MS)   # held requests: look again soon
                    if want != cur_ms:
                        sock.setsockopt(zmq.RCVTIMEO, want)
                        cur_ms = want
        finally:
            self.close()

    def _pin_sweep_s(self, cache) -> float:
        """Seconds between sweeps of the pin files: PIN_DRAIN_MS while an eviction waits on a
        slot a fast-path pin holds, PIN_SWEEP_MS otherwise."""
        return (self.PIN_DRAIN_MS if cache.pins_awaited else self.PIN_SWEEP_MS) / 1000

    def _fast_handler(self):
        """``frames -> bool``: the Cython hot path (``moecached.service._serve.FastPath``) on this
        server's :class:`~moecached.service._serve.ServerHooks` (all it may use of the server), or a
        stub that always declines when ``fast_path`` is False (everything then takes
        ``_handle``). Built again for each session; the hooks' live fields (request limits,
        tracing) are kept current by :meth:`set_request_limits` and the trace ops."""
        self._hooks = None
        if not self.fast_path:
            return lambda frames: False
        cache = self.cache
        self._hooks = hooks = ServerHooks(
            clients=self.clients, leases=self.leases, counters=self.counters,
            limit=self.rate_limit, sock=self.sock, hits=cache.hit_path,
            drain_pins=cache.drain_pins, release=cache.release, undelivered=self._undelivered,
            version=P.PROTOCOL_VERSION, fields=P.HOT_PATH_FIELDS, session=self.session,
            max_message_bytes=self.max_message_bytes, max_experts=self.checker.max_experts,
            tracing=self.recorder is not None, more_nb=_MORE_NB, nb=_NB)
        return FastPath(hooks).handle

    def set_pin_hit_rate(self, rate: float) -> None:
        """Apply ``fast_path_hit_rate`` (at start and on reload): hit-ring entries per second
        the cache takes from one uid's pin files together, bursts of one ring; 0: no limit
        (the drain reads it under the cache's lock; one float store)."""
        self.pin_hit_rate = max(0.0, float(rate))
        if self.cache is not None:
            self.cache._shm.hit_rate = self.pin_hit_rate

    def set_request_limits(self, max_request_experts: int, max_message_bytes: int) -> None:
        """Apply the request limits (at reload): experts per request, bytes per message."""
        self.checker.max_experts = int(max_request_experts)
        self.max_message_bytes = int(max_message_bytes)
        if self._hooks is not None:
            self._hooks.max_experts = self.checker.max_experts
            self._hooks.max_message_bytes = self.max_message_bytes

    def _wake(self) -> None:
        """Wake the loop (any thread, or a signal handler in the loop's thread)."""
        if not self._wake_lock.acquire(blocking=False):
            # Another thread is sending a wake-up right now (the loop will run), or this is a
            # signal handler that interrupted the loop inside the lock: the loop is awake.
            if threading.get_ident() == self._loop_tid:
                return
            self._wake_lock.acquire()
        try:
            if not self._wake_pending and not self._wake_sock.closed:
                self._wake_pending = True
                self._wake_sock.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        finally:
            self._wake_lock.release()

    @staticmethod
    def _noreply(msg: dict) -> bool:
        v = msg.get("noreply", False)
        if not isinstance(v, bool):
            raise P.ProtocolError(P.E_BAD_TYPE, f"field 'noreply' = {v!r:.20}: expected true or false")
        return v

    def _new_client(self, ident: bytes, now: float) -> _Client:
        """The client of a routing id first seen now (its credentials: ``self._peer_addr``)."""
        c = self.clients[ident] = _Client(ident, now, self.rate_limit.burst,
                                          self.client_max_prefetch, self._peer_addr)
        c.admin = is_admin(c.peer, self.admin_gid)
        c.ctl = self._ctl_bucket(c)
        return c

    def _handle(self, frames: list) -> None:
        self._op = ""   # what it costs is charged to the control share unless it is a hot op
        if len(frames) == 2:
            ident, envelope, payload = frames[0], None, frames[1]
        elif len(frames) == 3 and frames[1] == b"":
            ident, envelope, payload = frames[0], b"", frames[2]
        else:
            if len(frames) >= 1:  # envelope unknown: answered without a delimiter
                self._send_error(frames[0], 0, P.E_MALFORMED, f"request has {len(frames) - 1} frames: "
                                 "expected 1 (or an empty delimiter + 1)", delim=False)
            return
        if self.cache is not None:
            self.cache.drain_pins()   # hits taken through shared memory count first
        if self.recorder is not None:
            self._record_fast_hits()
        now = time.monotonic()
        c = self.clients.get(ident)
        if c is None:
            c = self._new_client(ident, now)
        c.last_seen = now
        c.delim = envelope is not None
        c.requests += 1
        self.counters["requests"] += 1
        rid = 0
        try:
            msg = P.unpack(payload, self.max_message_bytes)
            r = msg.get("id")
            op = msg.get("op")
            if type(op) is str:
                self._op = op
            fn = self._ops.get(op) if type(op) is str else None
            if type(r) is int and 0 <= r < 2**64:
                rid = r  # answer with the caller's id even when the rest is wrong
                v = msg.get("v")
                if fn is None or type(v) is not int or v != P.PROTOCOL_VERSION:
                    P.header(msg)  # raises the precise error
            else:
                P.header(msg)
            if op in P.ADMIN_OPS:
                self._permit(c, op, msg)
            if op not in _UNLIMITED_OPS and not c.bucket.take(now, self.rate_limit):
                c.rate_limited += 1
                self.counters["rate_limited"] += 1
                if msg.get("noreply") is not True:
                    self._send_error(ident, rid, P.E_RATE_LIMITED,
                                     f"client {c.name} is over its rate limit of "
                                     f"{self.rate_limit.rate:g} requests/s (burst "
                                     f"{self.rate_limit.burst:g}); slow down and retry")
                return
            fn(c, rid, msg)
        except P.ProtocolError as e:
            self._op = ""   # a refused request is no hot path: charged to the control share
            c.errors += 1
            self.counters["errors"] += 1
            self._send_error(ident, rid, e.code, str(e))
        except MoecacheError as e:
            self._op = ""
            c.errors += 1
            self.counters["errors"] += 1
            self._send_error(ident, rid, _code_of(e), str(e))
        except Exception as e:  # a bug must not take the daemon down for everyone
            log.exception("internal error handling a request")
            self._send_error(ident, rid, P.E_INTERNAL, f"{type(e).__name__}: {e}")

    def _send(self, ident: bytes, msg: dict) -> bool:
        c = self.clients.get(ident)
        return self._send_frame(ident, c is not None and c.delim, P.pack(msg))

    def _send_frame(self, ident: bytes, delim: bool, payload: bytes) -> bool:
        """Send one reply frame to ``ident`` (after an empty delimiter for REQ-style peers).
        False when the peer is gone (ROUTER_MANDATORY: EHOSTUNREACH on the routing frame,
        before anything of the message went out) or its queue is full."""
        send = self.sock.send
        try:
            send(ident, _MORE_NB)
            if delim:
                send(b"", _MORE_NB)
            send(payload, _NB)
            return True
        except zmq.ZMQError as e:
            if e.errno in (errno.EHOSTUNREACH, zmq.EAGAIN):
                self.counters["undeliverable"] += 1
                return False
            raise

    def _reply(self, ident: bytes, rid: int, **fields) -> bool:
        fields.update(v=P.PROTOCOL_VERSION, id=rid, ok=True, session=self.session)
        return self._send(ident, fields)

    def _send_error(self, ident: bytes, rid: int, code: str, message: str, delim: bool | None = None) -> bool:
        """Send an error reply; every error reply goes through here, so ``malformed`` counts
        each reply with that code. ``delim``: None = as the client's last request."""
        if code == P.E_MALFORMED:
            self.counters["malformed"] += 1
        msg = {"v": P.PROTOCOL_VERSION, "id": rid, "ok": False, "session": self.session,
               "error": {"code": code, "message": message}}
        if delim is None:
            return self._send(ident, msg)
        return self._send_frame(ident, delim, P.pack(msg))

    # ---- completions from reader threads ----------------------------------------------
    def _complete(self, ident: bytes, rid: int, ticket_box: list, tag, result) -> None:
        """Cache callback (any thread): queue the result for the loop."""
        self.done.append((ident, rid, ticket_box, tag, result))
        if threading.get_ident() != self._loop_tid:
            self._wake()  # from a reader thread; inline completions are drained right away

    def _drain_done(self, final: bool = False) -> None:
        while self.done:
            ident, rid, ticket_box, tag, result = self.done.popleft()
            ticket = ticket_box[0] if ticket_box else None
            subst = ticket_box[1] if len(ticket_box) > 1 else None
            c = self.clients.get(ident)
            alive = c is not None and (ticket is None or ticket in c.pending)
            if c is not None and ticket is not None:
                c.pending.pop(ticket, None)
            if isinstance(result, Exception):
                if alive and not final:
                    c.errors += 1
                    self._send_error(ident, rid, _code_of(result), str(result))
                continue
            lease = result
            if not alive or final:
                self.cache.release(lease)  # nobody to hand it to: roll back
                continue
            self._deliver(c, rid, lease, tag, subst)

    def _deliver(self, c: _Client, rid: int, lease, tag, subst=None) -> None:
        """Send a granted lease to its client and register it; roll it back when undeliverable."""
        c.acquires += 1
        c.hits += lease.hits
        c.misses += lease.misses
        c.prefetch_hits += lease.prefetch_hits
        c.stall_s += lease.stall_s
        ident = c.ident
        lid = lease.id
        rep = {"v": P.PROTOCOL_VERSION, "id": rid, "ok": True, "session": self.session,
               "lease": lid, "items": lease.items,
               "gens": self.cache.lease_generations(lease.items), "hits": lease.hits,
               "prefetch_hits": lease.prefetch_hits, "misses": lease.misses,
               "stall_us": int(lease.stall_s * 1e6)}
        if lease.swaps:
            rep["subst"] = [list(s) for s in lease.swaps]
            for layer, _, _ in lease.swaps:
                c.subst[layer] = c.subst.get(layer, 0) + 1
        payload = self._packb(rep)
        if not self._send_frame(ident, c.delim, payload):
            self.cache.release(lease)  # undelivered: roll back
            self._drop_client(c, "unreachable")
            return
        self._register(c, lease, tag, subst)

    def _register(self, c: _Client, lease, tag=None, subst=None) -> None:
        """Record a delivered lease as ``c``'s (and in the trace being recorded, if any, with
        the acquire's substitution scores and candidates, ``subst`` as from
        ``checker.subst``; a swapped item is recorded as the expert routed)."""
        lid = lease.id
        self.leases[lid] = (c.ident, lease)
        c.leases.add(lid)
        if self.recorder is not None and (self.recorder_client in (None, c.name)):
            offer = subst[2] if subst is not None else {}
            for layer, experts in _group(lease.items):
                sc = cands = None
                if layer in offer:
                    sc, cands = offer[layer]
                    for sl, missing, sub in lease.swaps:
                        if sl == layer:
                            experts[experts.index(sub)] = missing
                self.recorder.record(self.moe_index[layer], experts, tag == "prompt", c.name,
                                     scores=sc, candidates=cands)

    def _undelivered(self, c: _Client, lease, e: zmq.ZMQError) -> None:
        """The fast path could not send ``lease`` (peer gone or its queue full): roll back."""
        if e.errno not in (errno.EHOSTUNREACH, zmq.EAGAIN):
            raise e
        self.counters["undeliverable"] += 1
        self.cache.release(lease)
        self._drop_client(c, "unreachable")

def _group(items):
    """[(layer, expert, class, slot), ...] -> [(layer, [experts]), ...] in order."""
    out: dict[int, list[int]] = {}
    for layer, expert, _, _ in items:
        out.setdefault(layer, []).append(expert)
    return list(out.items())


def _code_of(e: Exception) -> str:
    name = type(e).__name__
    return {"LoadError": P.E_LOAD_FAILED, "ModelChangedError": P.E_MODEL_CHANGED,
            "RequestError": P.E_TOO_LARGE,
            "LeaseError": P.E_UNKNOWN_LEASE, "CapacityError": P.E_UNAVAILABLE,
            "TimeoutError": P.E_TIMEOUT, "CacheClosed": P.E_SHUTDOWN}.get(name, getattr(e, "code", P.E_INTERNAL))
