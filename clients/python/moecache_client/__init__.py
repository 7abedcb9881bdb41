"""Python client of the moecached expert cache daemon.

    from moecache_client import Client
    with Client("ipc:///run/moecached/moecached.sock", name="engine-0") as c:
        with c.acquire(layer=3, experts=[5, 17, 42]) as lease:
            gate = lease.part(17, "gate")      # zero-copy read-only numpy uint8 view
        c.prefetch(4, [1, 2, 3])

The client speaks docs/protocol.md over one ZeroMQ DEALER socket. Calls from any thread
are safe: the thread that finds the socket free reads replies for everyone (leader /
followers), so a single-threaded engine pays no thread hand-off. Every request carries an
id; a reply that arrives after its caller timed out is never mistaken for a later call's
(and a late lease is released at once); an acquire given up on is cancelled in the daemon
(``cancel``), so its pins go at once. A background thread pings while idle so the daemon
keeps this client's leases. When the daemon restarts (the connection drops or a reply's
``session`` changes) the calls in flight fail with ``DaemonRestarted`` and the next call
says hello again, re-mapping the new arena.

A lease is valid until it is released (or its client closed), or the daemon restarts, or (for a client the daemon
cannot watch: tcp) it is revoked after a silence; its holder can always tell:
``lease.part()``/``parts()`` raise :class:`LeaseInvalid` once it is not, and
``lease.valid()`` -- a few loads from the arena's control block, no message -- says whether
bytes already read are the granted expert's. Check it after computing with them.

Shared-memory hit path (docs/protocol.md): with the compiled extension ``moecache_client._shm``
(built by ``pip install``; the rules are those of ``clients/c/include/moecache_shm.h``, compiled
in), a local client asks for a pin file at hello and pins experts that are already resident
without a message; such a lease is released by a store. Anything not resident, and every other
call, goes over the socket. Without the extension, or with ``MOECACHE_CLIENT_PURE=1`` in the
environment, the same API works over the socket only (``IMPLEMENTATION`` says which).

Substitution (docs/protocol.md): ``acquire(..., subst=Subst(r, cap, {layer: (scores,
candidates)}))`` hands the daemon the router's scores of the requested experts and further
ranked candidates; for each missing expert it may grant a resident candidate scoring at
least ``r`` x the missing one's score instead. The fast path is tried first (all resident:
nothing to substitute); only a miss sends the candidates. ``lease.substituted`` lists
``(layer, missing, substitute)``; the items name the substitute, whose own routing weight the
engine then uses.
"""
from __future__ import annotations

import importlib.util
import itertools
import logging
import numbers
import operator
import os
import threading
import time
from collections.abc import Iterable
from types import EllipsisType
from typing import Self

import msgpack
import zmq

from ._call import _Call
from .errors import ClientError, DaemonRestarted, LeaseInvalid, ServerError, Timeout
from .fastpath import fast_session
from .lease import DESCRIPTOR_VERSION, _Arena, Lease, LeaseFuture, Subst  # noqa: F401  (the public API)

__version__ = "0.1.0"

_NO_SHM = None   # why the extension is missing (None: loaded, or turned off by MOECACHE_CLIENT_PURE)
if os.environ.get("MOECACHE_CLIENT_PURE", "") not in ("", "0"):
    _shm = None
else:
    try:
        from . import _shm
    except ImportError as e:
        _shm = None
        # a module that is not there is "not built"; one that is there and fails says why
        _NO_SHM = "not built" if importlib.util.find_spec(f"{__name__}._shm") is None else (str(e) or "not built")
IMPLEMENTATION = "python" if _shm is None else "cython"   # "python": socket path only
log = logging.getLogger("moecache_client")

__all__ = ["Client", "Lease", "Subst", "ClientError", "ServerError", "DaemonRestarted", "Timeout",
           "LeaseInvalid", "DEFAULT_ENDPOINT", "IMPLEMENTATION"]

DEFAULT_ENDPOINT = "ipc:///run/moecached/moecached.sock"
_INT_ONLY = frozenset((int,))
PROTOCOL_VERSION = 1
# the public API's argument types: a layer's experts (ints: a list, a tuple, a numpy array...),
# several layers' requests, and a timeout where ``...`` means the client's default
Experts = Iterable[int]
Requests = Iterable[tuple[int, Experts]]
TimeoutArg = float | None | EllipsisType

_noted = False


def _note_no_fast_path() -> None:
    """Once per process: say that the shared-memory fast path is off and how to get it."""
    global _noted
    if not _noted:
        _noted = True
        log.warning("moecache_client: shared-memory fast path OFF (extension moecache_client._shm: %s); "
                    "using the socket only. To build it: pip install 'Cython>=3.0' && pip install "
                    "--no-build-isolation --force-reinstall ./clients/python (MOECACHE_CLIENT_PURE=1 silences this)",
                    _NO_SHM)


def _own_start_time() -> int | None:
    """This process's start time (``/proc/self/stat`` field 22): with the pid, the daemon can
    watch this process exactly and keep its leases through any stall."""
    try:
        with open("/proc/self/stat", "rb") as f:
            st = f.read()
        return int(st[st.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None




class Client:
    """Connection to a moecached daemon.

    Args:
        endpoint: the daemon's ZeroMQ endpoint (default ``ipc:///run/moecached/moecached.sock``).
        name: shown per client in ``moecache-ctl stats`` (the first 64 characters).
        timeout: default seconds a call waits for its reply (``None`` = forever).
        heartbeat_s: seconds between pings while idle (default: a third of the daemon's).
        connect_timeout: seconds to wait for the first hello.
        map_arena: map the arena read-only at hello (default); tools that only read
            counters pass False.
        fast_path: pin resident experts through shared memory, without a message, when the
            daemon offers it (default; needs the compiled extension, an ``ipc://`` endpoint
            and ``map_arena``). False: every acquire goes over the socket.
        model: the model to use when the daemon serves several (its name; optional when it
            serves one). The daemon answers hello with the model's own endpoint, where the
            client connects and says hello again (``endpoint`` then names it). A new session
            (after a restart or a dropped connection) starts at the endpoint given here again,
            so a removed model's calls raise ServerError ``unknown_model`` at once, and work
            again once the model is added back.
    Raises:
        ClientError: an ``ipc://`` endpoint whose socket file does not exist (no daemon
            there): raised at once, without waiting ``connect_timeout``.
        Timeout: the daemon did not answer hello within ``connect_timeout``.
        ServerError: the daemon refused hello (protocol version).

    Threads: whichever calling thread finds the socket free becomes the *leader*: it sends,
    then reads replies and hands each to the future of the call it answers (its own or
    another thread's) until its own reply is in. So a single-threaded engine pays no thread
    hand-off per call, and many threads can share one Client. A small background thread
    pings while the client is idle, notices a vanished daemon, and releases leases that
    arrive after their caller timed out.

    Fork: a Client belongs to the process that created it (a ZeroMQ socket cannot cross a
    ``fork()``); in a child every call raises ClientError at once: create a new Client there.
    """

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *, name: str | None = None,
                 timeout: float | None = 30.0, heartbeat_s: float | None = None,
                 connect_timeout: float = 10.0, map_arena: bool = True, fast_path: bool = True,
                 model: str | None = None):
        self.endpoint = endpoint                # where the current session's socket connects
        self._origin = endpoint                 # where every new session says hello first
        self.model = model
        self._ipc = endpoint.startswith("ipc://")
        path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None
        if path is not None and not os.path.exists(path):
            raise ClientError(f"no daemon socket at {path}: is moecached running? (systemctl status moecached)")
        self.map_arena = map_arena
        self._want_fast = bool(fast_path) and map_arena and self._ipc and _shm is not None
        if fast_path and map_arena and self._ipc and _NO_SHM is not None:
            _note_no_fast_path()
        self._fast = None                      # (arena, Shm) while the current hello's session can pin in shm
        self._fast_ids = itertools.count(-1, -1)   # ids of leases taken without a message
        # the daemon keeps 64 characters of a name; a longer one would not fit its limits
        self.name = (name or f"pid{os.getpid()}")[:64]
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._hb = heartbeat_s
        self._ids = itertools.count(1)
        self._pid = os.getpid()                # a ZeroMQ socket is unusable in a forked child
        self._lock = threading.Lock()          # owns the socket, _pending and the session
        self._pending: dict[int, _Call] = {}
        self._closed = False
        self.session = None
        self.info: dict = {}
        self._arena: _Arena | None = None
        self._last_tx = self._last_rx = time.monotonic()
        self._ping_sent = None
        self._ctx = zmq.Context.instance()
        with self._lock:
            self._sock, self._mon = self._new_socket()
            try:
                self._hello_locked(connect_timeout)
            except BaseException:
                self._close_socket()
                raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="moecache-client-hb", daemon=True)
        self._thread.start()

    # ---- public API ---------------------------------------------------------------------
    @property
    def expert_layers(self) -> list[int]:
        """GGUF block numbers that have routed experts (the ``layer`` values to send)."""
        return self.info["expert_layers"]

    @property
    def n_experts(self) -> int:
        """Routed experts per layer (ids are ``0 .. n_experts-1``)."""
        return self.info["n_experts"]

    @property
    def top_k(self) -> int:
        """Experts the router picks per token and layer (0 when the model file does not say)."""
        return self.info["top_k"]

    @property
    def arena(self) -> _Arena | None:
        """This session's arena mapping (None with ``map_arena=False``): ``.address`` (int base
        address), ``.size`` (bytes), ``.descriptor`` (the hello's ``arena`` map)."""
        return self._arena

    @property
    def fast_path(self) -> bool:
        """True while resident experts are pinned without a message (docs/protocol.md,
        "Shared-memory hit path")."""
        return self._fast is not None

    def acquire(self, layer: int | None, experts: Experts | None, *, tag: str | None = None,
                timeout: TimeoutArg = ..., layers: Requests | None = None, subst: Subst | None = None) -> Lease:
        """Pin ``experts`` of ``layer`` (GGUF block number), waiting for reads; returns a Lease.

        ``layers=[(layer, [experts]), ...]`` acquires several layers in one lease.
        ``subst`` (:class:`Subst`): on a miss the daemon may grant resident candidates in
        place of missing experts (``lease.substituted`` says which).
        Raises ServerError (bad layer/expert, too large, load failed, model_changed: the
        model file changed and the expert is not resident), Timeout, DaemonRestarted.
        """
        if self._fast is not None:
            lease = self._fast_acquire(layer, experts, layers)
            if lease is not None:
                return lease
        msg = {"op": "acquire"}
        self._requests(msg, layer, experts, layers)
        if tag is not None:
            msg["tag"] = tag
        if subst is not None:
            msg["subst"] = subst.wire()
        rep = self._wait(self._submit(msg), self._t(timeout), "acquire")
        return Lease(self, rep["session"], rep["_arena"], rep)

    def acquire_many(self, requests: Requests, *, tag: str | None = None, timeout: TimeoutArg = ...,
                     subst: Subst | None = None) -> Lease:
        """Several layers in one lease: ``requests = [(layer, [experts]), ...]``."""
        return self.acquire(None, None, tag=tag, timeout=timeout, layers=requests, subst=subst)

    def acquire_async(self, layer: int | None, experts: Experts | None, *, tag: str | None = None,
                      layers: Requests | None = None, timeout_ms: int | None = None,
                      subst: Subst | None = None) -> LeaseFuture:
        """Non-blocking acquire for pipelining: returns a future; ``.result(timeout)`` -> Lease."""
        if self._fast is not None:
            lease = self._fast_acquire(layer, experts, layers)
            if lease is not None:
                return LeaseFuture(self, None, lease)
        msg = {"op": "acquire"}
        self._requests(msg, layer, experts, layers)
        if tag is not None:
            msg["tag"] = tag
        if subst is not None:
            msg["subst"] = subst.wire()
        if timeout_ms is not None:
            msg["timeout_ms"] = int(timeout_ms)
        return LeaseFuture(self, self._submit(msg))

    def prefetch(self, layer: int | None, experts: Experts | None = None, *, layers: Requests | None = None,
                 wait: bool = False, conf: Iterable[float] | Iterable[Iterable[float]] | None = None) -> int | None:
        """Queue reads only (no pins). ``wait=False`` sends without waiting for the reply.
        ``conf``: the predictor's confidence per expert, numbers in [0, 1]: ``[c, ...]``
        parallel to ``experts``, or ``[[c, ...], ...]`` parallel to ``layers`` (docs/protocol.md,
        ``prefetch``); without it every expert counts as confidence 1."""
        msg = {"op": "prefetch"}
        self._requests(msg, layer, experts, layers)
        if conf is not None:
            msg["conf"] = ([[float(c) for c in cs] for cs in conf] if layers is not None
                           else [float(c) for c in conf])
        if not wait:
            msg["noreply"] = True
            self._submit(msg, expect_reply=False)
            return None
        return self._call(msg)["queued"]

    def release(self, lease: Lease) -> None:
        """Same as ``lease.release()``."""
        lease.release()

    def stats(self) -> dict:
        """Every counter of the daemon (docs/operations.md, "What each stat means")."""
        return self._call({"op": "stats"})["stats"]

    def status(self) -> dict:
        """A short status map: state, pid, uptime, budget, slots, hit rate, reads in flight."""
        return self._call({"op": "status"})["status"]

    def models(self, action: str = "list", **fields: object) -> dict:
        """The daemon's models (several models under one budget): ``list`` (per model: share,
        residency, hit rate, bytes read; and the split), ``add`` (``name``, ``path``, optional
        ``min_budget``/``max_budget`` bytes, ``weight``), ``remove`` (``name``) or
        ``rebalance`` (one period of the split now). ServerError ``refused`` with the reason."""
        return self._call({"op": "models", "action": action, **fields})

    def ping(self) -> float:
        """Round trip to the daemon, in seconds."""
        t = time.perf_counter()
        self._call({"op": "ping"})
        return time.perf_counter() - t

    def trace_start(self, path: str, client: str | None = None) -> dict:
        """Ask the daemon to record the acquires it serves (only ``client``'s when given) into
        ``path``: an absolute path of a new file on the daemon's machine. ServerError
        ``refused`` for a relative path, a missing directory or an existing file."""
        msg = {"op": "trace_start", "path": path}
        if client:
            msg["client"] = client
        return self._call(msg)

    def trace_stop(self) -> dict:
        """Stop recording; returns ``{"path", "info": {tokens, moe_layers, ...}}``."""
        return self._call({"op": "trace_stop"})

    def close(self) -> None:
        """Say bye (the daemon releases this client's leases) and close the socket."""
        if self._closed:
            return
        if os.getpid() != self._pid:
            self._closed = True   # a forked child: the socket is the parent's; leave it alone
            return
        try:
            if self.session is not None:
                self._call({"op": "bye"}, timeout=1.0)
        except Exception:
            pass
        self._closed = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5)
        with self._lock:
            self._fail_pending(lambda op: ClientError(f"{op}: client closed"))
            self._close_socket()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals: calls -----------------------------------------------------------------
    def _requests(self, msg: dict, layer, experts, layers) -> None:
        """Fill ``layer``/``experts`` or ``layers`` into ``msg``; ClientError on values the
        daemon would refuse anyway (non-integers, more experts than its limit)."""
        def ints(xs, what):
            if set(map(type, xs)) <= _INT_ONLY:
                return xs
            try:
                return [operator.index(x) for x in xs]
            except TypeError:
                bad = next(x for x in xs if not isinstance(x, numbers.Integral))
                raise ClientError(f"{what}: {bad!r} is {type(bad).__name__}, expected integers") from None
        if layers is not None:
            out = []
            for item in layers:
                l, ex = item
                out.append([ints([l], "layer")[0], ints(list(ex), f"experts of layer {l}")])
            msg["layers"] = out
            total = sum(len(ex) for _, ex in out)
        else:
            msg["layer"] = layer if type(layer) is int else ints([layer], "layer")[0]
            if type(experts) is not list:
                experts = list(experts)
            msg["experts"] = ints(experts, f"experts of layer {layer}")
            total = len(experts)
        limit = (self.info.get("limits") or {}).get("max_request_experts")
        if limit is not None and total > limit:
            raise ClientError(f"request names {total} experts: the daemon accepts at most {limit} "
                              "per request (split it)")


    def _fast_acquire(self, layer, experts, layers) -> Lease | None:
        """Pin the experts without a message (all resident; the extension checks the values and
        leaves anything doubtful to the socket path); None: use the socket."""
        fast = self._fast
        if fast is None or os.getpid() != self._pid:
            return None      # (a forked child: the socket path raises the error)
        arena, shm = fast
        try:
            r = shm.pin(layer, experts, layers)
        except (TypeError, ValueError, IndexError):
            return None      # a malformed request: the socket path says what is wrong
        if type(r) is int:
            if r == _shm.STALE and shm.epoch() != shm.session:
                # the daemon of the current hello is gone: void it; the socket call says hello again
                with self._lock:
                    if self.session == shm.session:
                        self._void_session("the daemon restarted")
            return None
        return Lease._pinned(self, shm.session, arena, next(self._fast_ids), r)

    def _t(self, timeout):
        return self.timeout if timeout is ... else timeout

    def _call(self, msg: dict, timeout=...) -> dict:
        fut = self._submit(msg)
        return self._wait(fut, self._t(timeout), msg["op"])

    def _submit(self, msg: dict, expect_reply: bool = True) -> _Call | None:
        if self._closed:
            raise ClientError("client is closed")
        if os.getpid() != self._pid:
            raise ClientError(f"{msg['op']}: this Client was created in process {self._pid}, before "
                              "a fork(); a ZeroMQ socket cannot be used across fork: create a new "
                              "Client in the child")
        rid = next(self._ids)
        fut = _Call(rid, msg["op"]) if expect_reply else None
        msg["v"] = PROTOCOL_VERSION
        msg["id"] = rid
        with self._lock:
            if self.session is None:
                self._hello_locked(self.connect_timeout)  # after a restart: hello first
            if expect_reply:
                self._pending[rid] = fut
            try:
                self._send(msg)
            except zmq.ZMQError as e:
                self._pending.pop(rid, None)
                raise ClientError(f"{msg['op']}: send failed: {e}") from None
        return fut

    def _wait(self, fut: _Call, timeout, op: str):
        """Wait for ``fut``, reading the socket while no other thread does. Returns the reply."""
        deadline = None if timeout is None else time.monotonic() + timeout
        lock = self._lock
        while not fut.state:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                if self._pending.pop(fut.rid, None) is not None:
                    # given up: a late reply finds no entry, is dropped, its lease released;
                    # the call ends with this Timeout (waiting on it again raises it at once)
                    fut.set_exception(Timeout(f"{op}: no reply within {timeout}s"))
                    if op == "acquire":
                        self._cancel(fut.rid)
                    break
                while not fut.state:   # the reader took it a moment ago: it is being set
                    fut.wait(0.002)
                break
            if lock.acquire(blocking=False):
                try:
                    self._pump_locked(fut, 0.05 if left is None else min(left, 0.05))
                finally:
                    lock.release()
            else:
                fut.wait(0.002 if left is None else min(left, 0.002))
        return fut.result()

    def _cancel(self, rid: int) -> None:
        """Ask the daemon to drop the pending acquire ``rid`` (noreply, best effort): its pins
        go now rather than when its reads finish. A lease that still arrives is released as a
        late reply."""
        with self._lock:
            if self._closed or self.session is None:  # restarted: the acquire died with it
                return
            try:
                self._send({"v": PROTOCOL_VERSION, "id": next(self._ids), "op": "cancel",
                            "request": rid, "noreply": True})
            except zmq.ZMQError:
                pass

    # ---- internals: the socket (call with self._lock held) ---------------------------------
    def _send(self, msg: dict) -> None:
        self._sock.send(msgpack.packb(msg, use_bin_type=True))
        self._last_tx = time.monotonic()

    def _new_socket(self):
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        s.setsockopt(zmq.RCVTIMEO, 20)   # blocking reads wake every 20 ms to check the monitor
        mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        s.connect(self.endpoint)
        return s, mon

    def _connect_locked(self, endpoint: str) -> None:
        """Replace the socket by one connected to ``endpoint``."""
        self._close_socket()
        self.endpoint = endpoint
        self._ipc = endpoint.startswith("ipc://")
        self._sock, self._mon = self._new_socket()

    def _close_socket(self):
        try:
            self._sock.disable_monitor()
        except Exception:
            pass
        self._mon.close(0)
        self._sock.close(0)

    def _fail_pending(self, exc_factory):
        pend, self._pending = self._pending, {}
        for fut in pend.values():
            if not fut.done():
                fut.set_exception(exc_factory(fut.op))

    def _void_session(self, why: str):
        """The daemon went away: every call in flight fails; the next call says hello again."""
        self._fast = None
        self._fail_pending(lambda op: DaemonRestarted(f"{op}: {why}"))
        self.session = None
        self._ping_sent = None

    def _hello_locked(self, timeout: float, redirects: int = 0) -> None:
        if redirects == 0 and self.endpoint != self._origin:
            # a new session starts where the client was opened (the daemon's endpoint): it
            # redirects again while the model is served, or refuses at once once it is not
            # (the model's own endpoint may be gone with it)
            self._connect_locked(self._origin)
        rid = next(self._ids)
        fut = _Call(rid, "hello")
        self._pending[rid] = fut
        hello = {"v": PROTOCOL_VERSION, "id": rid, "op": "hello", "client": self.name, "pid": os.getpid()}
        if self.model is not None:
            hello["model"] = self.model
        start = _own_start_time()
        if start is not None:
            hello["pid_start"] = start
            if self._want_fast:
                hello["fast_path"] = True
                hello["pin_fd"] = True   # the pin file comes as a sealed fd from the door
        self._send(hello)
        deadline = time.monotonic() + timeout
        while not fut.done():
            left = deadline - time.monotonic()
            if left <= 0:
                self._pending.pop(rid, None)
                raise Timeout(f"no hello from {self.endpoint} within {timeout}s (is moecached running?)")
            self._pump_locked(fut, min(left, 0.1), hello=True)
        rep = fut.result()  # raises ServerError if refused
        where = rep.get("redirect")
        if where is not None:   # the model is served on its own endpoint: hello there
            if redirects >= 4 or not isinstance(where, str):
                raise ClientError(f"hello: {self.endpoint} redirected model {self.model!r} "
                                  f"to {where!r} again; the daemon's models are inconsistent")
            self._connect_locked(where)
            return self._hello_locked(timeout, redirects + 1)
        # A disconnect the monitor reports now happened before this hello's connection was
        # made (the reply came through it): it belongs to the daemon before this hello.
        self._check_monitor(hello=True)
        # leases of an earlier session keep their own arena object (unmapped when they go)
        self._fast = None
        # no arena: the daemon's endpoint when it serves several models (control only)
        arena = _Arena(rep["arena"]) if self.map_arena and rep.get("arena") else None
        if arena is not None and _shm is not None:
            arena.shm = self._shm_session(arena, rep)
        self._arena = arena
        self.info = rep
        self.session = rep["session"]
        if arena is not None and arena.shm is not None and arena.shm.fast:
            self._fast = (arena, arena.shm)
        self._last_rx = time.monotonic()

    def _shm_session(self, arena: _Arena, rep: dict):
        shm, self.pin_map = fast_session(_shm, arena, rep, self._want_fast, self.endpoint)
        return shm

    def _pump_locked(self, until: _Call | None, wait: float, hello: bool = False) -> None:
        """Read replies for up to ``wait`` seconds, until ``until`` is done.

        Blocks in ``recv`` (RCVTIMEO slices of 20 ms) rather than a poller: the cheapest wait
        pyzmq offers, which is what a single-threaded engine pays per call. The monitor (a
        dropped connection) is looked at whenever a slice passes without a reply.
        """
        sock = self._sock
        end = time.monotonic() + wait
        flags = 0 if wait > 0 else zmq.NOBLOCK
        while True:
            try:
                data = sock.recv(flags)
            except zmq.Again:
                self._check_monitor(hello)
                if (until is not None and until.done()) or time.monotonic() >= end:
                    return
                continue
            self._dispatch(data, hello)
            if until is not None and until.done():
                return
            if time.monotonic() >= end:
                flags = zmq.NOBLOCK  # past the wait: take what is queued, then stop

    def _check_monitor(self, hello: bool) -> None:
        mon = self._mon
        while True:
            try:
                from zmq.utils.monitor import parse_monitor_message
                ev = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if ev["event"] == zmq.EVENT_DISCONNECTED and not hello:
                self._void_session("connection to the daemon dropped")

    def _dispatch(self, data: bytes, hello: bool) -> None:
        self._last_rx = time.monotonic()
        try:
            rep = msgpack.unpackb(data, raw=False, strict_map_key=False)
            rid = rep["id"]
        except Exception:
            return
        ent = self._pending.pop(rid, None)
        session = rep.get("session")
        if ent is not None and ent.op == "hello":
            if rep.get("ok"):
                ent.set_result(rep)
            else:
                err = rep.get("error") or {}
                ent.set_exception(ServerError(err.get("code", "?"), err.get("message", "")))
            return
        if rid == self._ping_sent:
            self._ping_sent = None
        if self.session is None or (session is not None and session != self.session):
            # an answer from a daemon other than the one we said hello to: void
            if ent is not None and not ent.done():
                ent.set_exception(DaemonRestarted(f"{ent.op}: the daemon restarted"))
            if self.session is not None:
                self._void_session("the daemon restarted")
            return
        if ent is None:
            # late reply to a call that gave up: never hand it to anyone; give back its lease
            if rep.get("ok") and "lease" in rep:
                self._send({"v": PROTOCOL_VERSION, "id": next(self._ids), "op": "release",
                            "lease": rep["lease"], "noreply": True})
            return
        if rep.get("ok"):
            if "lease" in rep:
                rep["_arena"] = self._arena  # bind views to the current hello's arena
            ent.set_result(rep)
        else:
            err = rep.get("error") or {}
            ent.set_exception(ServerError(err.get("code", "?"), err.get("message", "")))

    def _release_lease(self, lease: Lease) -> None:
        if lease.session != self.session or self._closed:
            return  # the daemon that issued it is gone, and with it the pin
        try:
            self._submit({"op": "release", "lease": lease.id, "noreply": True}, expect_reply=False)
        except ClientError:
            pass

    # ---- internals: heartbeat ----------------------------------------------------------------
    def _heartbeat_loop(self):
        while not self._stop.wait(self._hb or (self.info.get("heartbeat_s", 5.0) / 3)):
            hb = self._hb or (self.info.get("heartbeat_s", 5.0) / 3)
            if not self._lock.acquire(timeout=hb):
                continue
            try:
                if self._closed:
                    return
                now = time.monotonic()
                self._pump_locked(None, 0)
                if self.session is None:
                    continue
                if self._ping_sent is None and now - self._last_tx >= hb * 0.9:
                    self._ping_sent = next(self._ids)
                    self._send({"v": PROTOCOL_VERSION, "id": self._ping_sent, "op": "ping"})
                    self._ping_started = now
                elif (self._ping_sent is not None and not self._ipc and now - self._ping_started > 3 * hb
                      and now - self._last_rx > 3 * hb):
                    # tcp: no answer for a while, the daemon or the host is gone; start afresh.
                    # (over ipc a daemon that went away drops the connection, which the monitor
                    # sees; a stalled one keeps this client's leases, so nothing is voided)
                    self._void_session("daemon not answering")
                    self._close_socket()
                    self._sock, self._mon = self._new_socket()
            except Exception:
                pass
            finally:
                self._lock.release()


