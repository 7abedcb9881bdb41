# cython: language_level=3, boundscheck=False, wraparound=False
"""The server's hot path (Cython core of ``moecached.server``).

A decoding engine sends two requests per layer and token: an ``acquire`` of experts that are
(mostly) resident, and a ``noreply`` ``release`` of the lease it got. The loop hands every
request frame to :meth:`FastPath.handle` first; it serves exactly those two shapes and
returns False for anything else -- a client not seen before, a REQ-style envelope, any other
op or field, a value the general path would refuse, an expert that is absent or loading, a
trace being recorded. ``Server._handle`` (plain Python, the reference behaviour) then handles
the request from scratch and produces every error reply, so this path never answers an
error and changes nothing before it knows it serves the request. Counting is the same on
both paths (tests/test_server.py checks stats after each).
"""
import zmq
from time import monotonic

cdef object _ZMQError = zmq.ZMQError
cdef object _U64 = 1 << 64   # request ids are unsigned 64-bit (a Python int: no C overflow)


cdef class FastPath:
    """Serves resident acquires and own-lease noreply releases of a ``Server`` (see module doc).

    Args:
        server: the ``moecached.server.Server`` (its clients, leases, counters, socket, cache).
        unpack: ``payload bytes -> object`` decoding with the protocol's limits; raises on bad
            input (``moecached.protocol.unpack``).
        more_nb, nb: the zmq flag ints for "more frames follow, don't block" and "don't block".
    """
    cdef object server, clients, leases, counters, send, packb, unpack, acquire_resident, release
    cdef object generations, drain_pins
    cdef object session
    cdef int more_nb, nb

    def __init__(self, server, unpack, int more_nb, int nb):
        self.server = server
        self.clients = server.clients
        self.leases = server.leases
        self.counters = server.counters
        self.send = server.sock.send
        self.packb = server._packb
        self.unpack = unpack
        self.acquire_resident = server.cache.acquire_resident
        self.release = server.cache.release
        self.generations = server.cache.lease_generations
        self.drain_pins = server.cache.drain_pins
        self.session = server.session
        self.more_nb = more_nb
        self.nb = nb

    cdef inline void _seen(self, c) except *:
        c.last_seen = monotonic()
        c.requests += 1
        self.counters["requests"] += 1

    def handle(self, list frames):
        """Serve one request frame set ``[routing id, payload]`` if it is a hot-path request.

        Returns True when served (reply sent, lease registered or released), False when the
        caller must run the general path on the same frames.
        """
        self.drain_pins()   # hits taken through shared memory count first (cheap when none)
        if len(frames) != 2:
            return False
        ident = frames[0]
        payload = frames[1]
        c = self.clients.get(ident)
        if c is None or c.delim:
            return False
        if type(payload) is not bytes or len(<bytes>payload) > self.server.max_message_bytes:
            return False
        try:
            msg = self.unpack(payload)
        except Exception:
            return False
        if type(msg) is not dict or len(<dict>msg) != 5:
            return False
        d = <dict>msg
        rid = d.get("id")
        if type(rid) is not int or rid < 0 or rid >= _U64:
            return False
        v = d.get("v")
        if type(v) is not int or v != 1:
            return False
        op = d.get("op")
        if type(op) is not str:
            return False
        if op == "release":
            return self._release(c, ident, d)
        if op == "acquire":
            return self._acquire(c, ident, rid, d)
        return False

    cdef bint _release(self, c, ident, dict d) except -1:
        if d.get("noreply") is not True:
            return False
        lid = d.get("lease")
        if type(lid) is not int:
            return False
        owner = self.leases.get(lid)
        if owner is None or (<tuple>owner)[0] != ident:
            return False
        self._seen(c)
        del self.leases[lid]
        c.leases.discard(lid)
        self.release((<tuple>owner)[1])
        return True

    cdef bint _acquire(self, c, ident, rid, dict d) except -1:
        layer = d.get("layer")
        experts = d.get("experts")
        if type(layer) is not int or type(experts) is not list:
            return False
        if len(<list>experts) > self.server.checker.max_experts or self.server.recorder is not None:
            return False
        lease = self.acquire_resident(layer, experts)
        if lease is None:
            return False
        self._seen(c)
        lid = lease.id
        hits = lease.hits
        pf = lease.prefetch_hits
        c.acquires += 1
        c.hits += hits
        c.prefetch_hits += pf
        reply = self.packb({"v": 1, "id": rid, "ok": True, "session": self.session,
                            "lease": lid, "items": lease.items,
                            "gens": self.generations(lease.items), "hits": hits,
                            "prefetch_hits": pf, "misses": 0, "stall_us": 0})
        try:
            self.send(ident, self.more_nb)
            self.send(reply, self.nb)
        except _ZMQError as e:
            self.server._undelivered(c, lease, e)
            return True
        # Server._register, inlined (no trace is being recorded: checked above)
        self.leases[lid] = (ident, lease)
        c.leases.add(lid)
        return True
