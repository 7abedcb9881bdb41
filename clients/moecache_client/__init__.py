"""Python client of the moecached expert cache daemon.

    from moecache_client import Client
    with Client("ipc:///run/moecached/moecached.sock", name="engine-0") as c:
        with c.acquire(layer=3, experts=[5, 17, 42]) as lease:
            gate = lease.part(17, "gate")      # zero-copy read-only numpy uint8 view
        c.prefetch(4, [1, 2, 3])

The client speaks docs/protocol.md over a ZeroMQ DEALER socket owned by one I/O thread;
calls from any thread hand requests to it and wait on a future, so one Client is safe to
share between threads. Every request carries an id; a reply that arrives after its caller
timed out is never mistaken for a later call's (and a late lease is released at once).
The I/O thread pings while idle so the daemon keeps this client's leases, notices a daemon
restart (the connection drops or the reply's ``session`` changes), fails the calls in
flight with ``DaemonRestarted`` and says hello again, re-mapping the new arena.
"""
from __future__ import annotations

import collections
import itertools
import mmap
import os
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as _FutTimeout

import msgpack
import numpy as np
import zmq

__all__ = ["Client", "Lease", "ClientError", "ServerError", "DaemonRestarted", "Timeout",
           "DEFAULT_ENDPOINT"]

DEFAULT_ENDPOINT = "ipc:///run/moecached/moecached.sock"
PROTOCOL_VERSION = 1


class ClientError(Exception):
    """Base class of the client's errors."""


class ServerError(ClientError):
    """The daemon refused a request; ``code`` is the protocol's error code string."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


class DaemonRestarted(ClientError):
    """The daemon went away (or restarted) while the call was in flight; retry it."""


class Timeout(ClientError):
    """No reply within the call's timeout."""


class _Arena:
    """A read-only mapping of the daemon's arena file plus its layout descriptor."""

    def __init__(self, desc: dict):
        self.desc = desc
        fd = os.open(desc["path"], os.O_RDONLY)
        try:
            self.mm = mmap.mmap(fd, desc["size"], mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self.buf = np.frombuffer(self.mm, dtype=np.uint8)
        self.classes = {int(c["id"]): c for c in desc["classes"]}

    def part(self, class_id: int, slot: int, part: str) -> np.ndarray:
        c = self.classes[class_id]
        n = c["part_bytes"][part]
        off = c["part_off"][part] + slot * n
        return self.buf[off:off + n]

    def close(self):
        self.buf = None
        try:
            self.mm.close()
        except BufferError:
            pass  # views still alive; the mapping goes when they do


class Lease:
    """Experts pinned in the daemon's arena until ``release()`` (or the ``with`` block ends).

    Attributes:
        id: lease id (int).
        items: [(layer, expert, class_id, slot), ...] in request order.
        slots: slot index of each requested expert, in request order.
        hits / prefetch_hits / misses: what the daemon found for this request.
        stall_us: microseconds the daemon waited for reads for this request.
    """

    def __init__(self, client: "Client", session: int, arena: _Arena, reply: dict):
        self._client = client
        self.session = session
        self._arena = arena
        self.id = reply["lease"]
        self.items = [tuple(t) for t in reply["items"]]
        self.hits = reply.get("hits", 0)
        self.prefetch_hits = reply.get("prefetch_hits", 0)
        self.misses = reply.get("misses", 0)
        self.stall_us = reply.get("stall_us", 0)
        self.released = False
        self._where = {(l, e): (c, s) for l, e, c, s in self.items}

    @property
    def slots(self) -> list[int]:
        return [s for _, _, _, s in self.items]

    def part(self, expert: int, part: str, layer: int | None = None) -> np.ndarray:
        """Zero-copy read-only uint8 view of one part ('gate', 'up', 'down', ...) of an expert.

        ``layer`` may be left out when the lease covers one layer. Raises KeyError when the
        expert is not in this lease.
        """
        if layer is None:
            layers = {l for l, _, _, _ in self.items}
            if len(layers) != 1:
                raise KeyError("lease covers several layers: pass layer=")
            layer = next(iter(layers))
        cls, slot = self._where[(layer, expert)]
        return self._arena.part(cls, slot, part)

    def parts(self, expert: int, layer: int | None = None) -> dict[str, np.ndarray]:
        """All parts of one expert as {part: uint8 view}."""
        if layer is None:
            layer = self.items[0][0]
        cls, _ = self._where[(layer, expert)]
        return {p: self.part(expert, p, layer) for p in self._arena.classes[cls]["parts"]}

    def release(self) -> None:
        """Unpin (idempotent). A lease from before a daemon restart is dropped silently."""
        if not self.released:
            self.released = True
            self._client._release_lease(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class Client:
    """Connection to a moecached daemon.

    Args:
        endpoint: the daemon's ZeroMQ endpoint (default ``ipc:///run/moecached/moecached.sock``).
        name: shown per client in ``moecache-ctl stats``.
        timeout: default seconds a call waits for its reply (``None`` = forever).
        heartbeat_s: seconds between pings while idle (default: a third of the daemon's).
        connect_timeout: seconds to wait for the first hello.
    Raises:
        Timeout: the daemon did not answer hello within ``connect_timeout``.
        ServerError: the daemon refused hello (protocol version).
    """

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *, name: str | None = None,
                 timeout: float | None = 30.0, heartbeat_s: float | None = None,
                 connect_timeout: float = 10.0):
        self.endpoint = endpoint
        self.name = name or f"pid{os.getpid()}"
        self.timeout = timeout
        self._hb = heartbeat_s
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[Future, str]] = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closed = False
        self.session = None
        self.info: dict = {}
        self._arena: _Arena | None = None
        self._hello_ready = threading.Event()
        self._hello_error: Exception | None = None
        self._ctx = zmq.Context.instance()
        self._thread = threading.Thread(target=self._io_loop, name="moecache-client-io", daemon=True)
        self._thread.start()
        if not self._hello_ready.wait(connect_timeout):
            self.close()
            raise Timeout(f"no hello from {endpoint} within {connect_timeout}s (is moecached running?)")
        if self._hello_error is not None:
            err = self._hello_error
            self.close()
            raise err

    # ---- public API ---------------------------------------------------------------------
    @property
    def expert_layers(self) -> list[int]:
        return self.info["expert_layers"]

    @property
    def n_experts(self) -> int:
        return self.info["n_experts"]

    @property
    def top_k(self) -> int:
        return self.info["top_k"]

    def acquire(self, layer: int, experts, *, tag: str | None = None,
                timeout: float | None = ..., layers=None) -> Lease:
        """Pin ``experts`` of ``layer`` (GGUF block number), waiting for reads; returns a Lease.

        ``layers=[(layer, [experts]), ...]`` acquires several layers in one lease.
        Raises ServerError (bad layer/expert, too large, load failed), Timeout, DaemonRestarted.
        """
        return self.acquire_async(layer, experts, tag=tag, layers=layers).result(self._t(timeout))

    def acquire_many(self, requests, *, tag=None, timeout=...) -> Lease:
        """Several layers in one lease: ``requests = [(layer, [experts]), ...]``."""
        return self.acquire(None, None, tag=tag, timeout=timeout, layers=requests)

    def acquire_async(self, layer, experts, *, tag=None, layers=None, timeout_ms: int | None = None) -> "LeaseFuture":
        """Non-blocking acquire for pipelining: returns a future; ``.result(timeout)`` -> Lease."""
        msg = {"op": "acquire"}
        if layers is not None:
            msg["layers"] = [[int(l), [int(e) for e in ex]] for l, ex in layers]
        else:
            msg["layer"] = int(layer)
            msg["experts"] = [int(e) for e in experts]
        if tag is not None:
            msg["tag"] = tag
        if timeout_ms is not None:
            msg["timeout_ms"] = int(timeout_ms)
        return LeaseFuture(self, self._submit(msg))

    def prefetch(self, layer: int, experts=None, *, layers=None, wait: bool = False) -> int | None:
        """Queue reads only (no pins). ``wait=False`` sends without waiting for the reply."""
        msg = {"op": "prefetch"}
        if layers is not None:
            msg["layers"] = [[int(l), [int(e) for e in ex]] for l, ex in layers]
        else:
            msg["layer"], msg["experts"] = int(layer), [int(e) for e in experts]
        if not wait:
            msg["noreply"] = True
            self._submit(msg, expect_reply=False)
            return None
        return self._call(msg)["queued"]

    def release(self, lease: Lease) -> None:
        """Same as ``lease.release()``."""
        lease.release()

    def stats(self) -> dict:
        return self._call({"op": "stats"})["stats"]

    def status(self) -> dict:
        return self._call({"op": "status"})["status"]

    def ping(self) -> float:
        """Round trip to the daemon, in seconds."""
        t = time.perf_counter()
        self._call({"op": "ping"})
        return time.perf_counter() - t

    def trace_start(self, path: str, client: str | None = None) -> dict:
        msg = {"op": "trace_start", "path": path}
        if client:
            msg["client"] = client
        return self._call(msg)

    def trace_stop(self) -> dict:
        return self._call({"op": "trace_stop"})

    def close(self) -> None:
        """Say bye (the daemon releases this client's leases), stop the I/O thread."""
        if self._closed:
            return
        try:
            if self.session is not None and self._thread.is_alive():
                self._submit({"op": "bye"}).result(1.0)
        except Exception:
            pass
        self._closed = True
        self._poke()
        self._thread.join(5)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- internals ----------------------------------------------------------------------
    def _t(self, timeout):
        return self.timeout if timeout is ... else timeout

    def _call(self, msg: dict, timeout=...) -> dict:
        fut = self._submit(msg)
        try:
            return fut.result(self._t(timeout))
        except _FutTimeout:
            raise Timeout(f"{msg['op']}: no reply within {self._t(timeout)}s") from None

    def _poke(self):
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _submit(self, msg: dict, expect_reply: bool = True) -> Future:
        if self._closed:
            raise ClientError("client is closed")
        fut: Future = Future()
        rid = next(self._ids)
        msg["v"] = PROTOCOL_VERSION
        msg["id"] = rid
        self._outbox.put((rid, msg, fut if expect_reply else None))
        self._poke()
        if not expect_reply:
            fut.set_result(None)
        return fut

    def _release_lease(self, lease: Lease) -> None:
        if lease.session != self.session or self._closed:
            return  # the daemon that issued it is gone, and with it the pin
        self._submit({"op": "release", "lease": lease.id, "noreply": True}, expect_reply=False)

    def _new_socket(self):
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        s.connect(self.endpoint)
        return s, mon

    def _fail_pending(self, exc_factory):
        pend, self._pending = self._pending, {}
        for rid, (fut, op) in pend.items():
            if not fut.done():
                fut.set_exception(exc_factory(op))

    def _io_loop(self):
        from zmq.utils.monitor import parse_monitor_message
        sock, mon = self._new_socket()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        hello_rid = None
        hello_rids: set = set()  # every hello sent; any of their answers may bring the session
        last_rx = last_tx = time.monotonic()
        ping_rid = None
        ping_sent = 0.0
        abandoned: collections.OrderedDict = collections.OrderedDict()

        def send(m):
            nonlocal last_tx
            sock.send(msgpack.packb(m, use_bin_type=True))
            last_tx = time.monotonic()

        def say_hello(force=False):
            # one hello in flight at a time; sends pause (session None) until it is answered
            nonlocal hello_rid
            if not force and hello_rid is not None and self.session is None and self._hello_ready.is_set():
                return
            self.session = None
            hello_rid = next(self._ids)
            hello_rids.add(hello_rid)
            send({"v": PROTOCOL_VERSION, "id": hello_rid, "op": "hello",
                  "client": self.name, "pid": os.getpid()})

        say_hello()
        try:
            while not self._closed:
                hb = self._hb or (self.info.get("heartbeat_s", 5.0) / 3)
                events = dict(poller.poll(int(max(10, hb * 1000 / 2))))
                now = time.monotonic()
                if self._wake_r in events:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                if mon in events:
                    while True:
                        try:
                            ev = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                        if os.environ.get("MOECACHE_CLIENT_DEBUG"):
                            print("client event", ev["event"], flush=True)
                        if ev["event"] == zmq.EVENT_DISCONNECTED:
                            self._fail_pending(lambda op: DaemonRestarted(f"{op}: connection to the daemon dropped"))
                            ping_rid = None
                            if self._hello_ready.is_set() and self._hello_error is None:
                                self.session = None  # hold new requests until hello is answered
                        elif ev["event"] == zmq.EVENT_CONNECTED and self._hello_ready.is_set():
                            say_hello(force=True)
                # outgoing (only after hello, so a restart's calls go to a mapped arena)
                while self.session is not None or self._hello_error is not None:
                    try:
                        rid, msg, fut = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    if fut is not None:
                        self._pending[rid] = (fut, msg["op"])
                    try:
                        send(msg)
                    except zmq.ZMQError as e:
                        self._pending.pop(rid, None)
                        if fut is not None:
                            fut.set_exception(ClientError(f"{msg['op']}: send failed: {e}"))
                if sock in events:
                    while True:
                        try:
                            data = sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        last_rx = now
                        try:
                            rep = msgpack.unpackb(data, raw=False, strict_map_key=False)
                            rid = rep["id"]
                        except Exception:
                            continue
                        session = rep.get("session")
                        if os.environ.get("MOECACHE_CLIENT_DEBUG"):
                            print("client rx", rid, rep.get("ok"), session, self.session, hello_rid, flush=True)
                        if rid in hello_rids:
                            hello_rids.discard(rid)
                            if rep.get("ok") or rid == hello_rid:
                                self._on_hello(rep)
                            continue
                        if self.session is None:
                            # sent before the current hello (to a daemon since replaced): void
                            ent = self._pending.pop(rid, None)
                            if ent is not None and not ent[0].done():
                                ent[0].set_exception(DaemonRestarted(f"{ent[1]}: the daemon restarted"))
                            continue
                        if rid == ping_rid:
                            ping_rid = None
                        if session is not None and self.session is not None and session != self.session:
                            # a new daemon answered: everything in flight is void; re-hello
                            self._fail_pending(lambda op: DaemonRestarted(f"{op}: the daemon restarted"))
                            say_hello()
                            continue
                        ent = self._pending.pop(rid, None)
                        if ent is None:
                            # late reply to a call that timed out: never hand it to anyone;
                            # give back a lease it may carry
                            if rep.get("ok") and "lease" in rep:
                                send({"v": PROTOCOL_VERSION, "id": next(self._ids), "op": "release",
                                      "lease": rep["lease"], "noreply": True})
                            continue
                        fut, op = ent
                        if fut.done():  # caller gave up (future cancelled)
                            if rep.get("ok") and "lease" in rep:
                                send({"v": PROTOCOL_VERSION, "id": next(self._ids), "op": "release",
                                      "lease": rep["lease"], "noreply": True})
                            continue
                        if rep.get("ok"):
                            rep["_arena"] = self._arena  # bind views to this session's arena
                            fut.set_result(rep)
                        else:
                            err = rep.get("error") or {}
                            fut.set_exception(ServerError(err.get("code", "?"), err.get("message", "")))
                # heartbeat: ping when idle; if pings go unanswered, the daemon is gone
                if ping_rid is None and now - last_tx > hb and self.session is not None:
                    ping_rid = next(self._ids)
                    ping_sent = now
                    send({"v": PROTOCOL_VERSION, "id": ping_rid, "op": "ping"})
                elif ping_rid is not None and now - ping_sent > 3 * hb and now - last_rx > 3 * hb:
                    self._fail_pending(lambda op: DaemonRestarted(f"{op}: daemon not answering"))
                    ping_rid = None
                    # reconnect with a fresh socket (drops anything queued in ZeroMQ)
                    poller.unregister(sock)
                    poller.unregister(mon)
                    sock.disable_monitor()
                    mon.close(0)
                    sock.close(0)
                    sock, mon = self._new_socket()
                    poller.register(sock, zmq.POLLIN)
                    poller.register(mon, zmq.POLLIN)
                    say_hello(force=True)
                    last_rx = now
        finally:
            self._fail_pending(lambda op: ClientError(f"{op}: client closed"))
            try:
                sock.disable_monitor()
            except Exception:
                pass
            mon.close(0)
            sock.close(0)
            if self._arena is not None:
                self._arena.close()

    def _on_hello(self, rep: dict) -> None:
        if not rep.get("ok"):
            err = rep.get("error") or {}
            self._hello_error = ServerError(err.get("code", "?"), err.get("message", ""))
            self._hello_ready.set()
            return
        old = self._arena
        self._arena = _Arena(rep["arena"])
        self.info = rep
        self.session = rep["session"]
        self._hello_ready.set()
        if old is not None:
            old.close()


class LeaseFuture:
    """Pending acquire; ``result(timeout)`` returns the Lease (or raises the call's error)."""

    def __init__(self, client: Client, fut: Future):
        self._client = client
        self._fut = fut

    def done(self) -> bool:
        return self._fut.done()

    def result(self, timeout: float | None = None) -> Lease:
        try:
            rep = self._fut.result(timeout)
        except _FutTimeout:
            # give up; if the reply comes later, the I/O thread releases its lease
            if self._fut.cancel():
                raise Timeout(f"acquire: no reply within {timeout}s") from None
            rep = self._fut.result()  # it arrived just now
        return Lease(self._client, rep["session"], rep["_arena"], rep)
