# cython: language_level=3, boundscheck=False, wraparound=False
"""The server's hot path (Cython core of ``moecached.service.server``).

A decoding engine sends two requests per layer and token: an ``acquire`` of experts that are
(mostly) resident, and a ``noreply`` ``release`` of the lease it got; often also a ``noreply``
``prefetch`` of the next layer's experts, mostly resident already. The loop hands every
request frame to :meth:`FastPath.handle` first; it serves exactly those three shapes (a
prefetch only when it has nothing to do, or when its client is over its rate limit and it is
dropped) and returns False for anything else -- a client not seen before, a REQ-style envelope, any other
op or field, a value the general path would refuse, an expert that is absent or loading, a
trace being recorded. ``Server._handle`` (plain Python, the reference behaviour) then handles
the request from scratch and produces every error reply, so this path never answers an
error and changes nothing before it knows it serves the request. Counting is the same on
both paths (tests/test_server.py checks stats after each).

The contract with the server is :class:`ServerHooks`: everything this module may use of it,
built by the server (``Server._fast_handler``) and kept current by it. FastPath reads and
updates the server's state only through those hooks; a lease is registered by the server's
own function (``hooks.register``), the protocol version and the request shapes it serves come
from ``moecached.facts.protocol`` (``PROTOCOL_VERSION``, ``HOT_PATH_FIELDS``).

Per-client request rate: :class:`TokenBucket` (one per client, shared by both paths) with the
server's :class:`RateLimit`. The hot path only *looks* at the bucket before it knows it serves
a request and takes the token when it does, so a request it declines is charged once, by the
general path.
"""
import zmq
from time import monotonic

cdef object _ZMQError = zmq.ZMQError
cdef object _U64 = 1 << 64   # request ids are unsigned 64-bit (a Python int: no C overflow)


cdef class RateLimit:
    """The per-client request rate limit, shared by both paths and changed in place on reload.

    Attributes:
        rate: tokens (requests) per second added to each client's bucket; 0 turns limiting off.
        burst: bucket size: requests a client may send at once after being quiet.
    """
    cdef public double rate, burst

    def __init__(self, double rate=0.0, double burst=1.0):
        self.rate = rate
        self.burst = burst if burst >= 1.0 else 1.0


cdef class TokenBucket:
    """One client's request budget: fills at ``RateLimit.rate`` per second up to ``burst``; each
    limited request takes one token. Starts full."""
    cdef public double tokens, t

    def __init__(self, double tokens, double now):
        self.tokens = tokens
        self.t = now

    cdef inline double _level(self, double now, RateLimit lim) noexcept:
        cdef double tok = self.tokens + (now - self.t) * lim.rate
        return tok if tok < lim.burst else lim.burst

    cpdef bint ready(self, double now, RateLimit lim):
        """True when a request now would get a token (changes nothing)."""
        return lim.rate <= 0.0 or self._level(now, lim) >= 1.0

    cpdef bint take(self, double now, RateLimit lim):
        """Take a token for a request now: True, or False when the client is over its limit."""
        cdef double tok
        if lim.rate <= 0.0:
            return True
        tok = self._level(now, lim)
        self.t = now
        if tok < 1.0:
            self.tokens = tok
            return False
        self.tokens = tok - 1.0
        return True


cdef class ServerHooks:
    """What the hot path gets from a server, and all it gets (the server builds one per session
    and keeps the fields marked *live* current; FastPath reaches for nothing else).

    Shared state (the server's own objects, read and changed in place):
        clients: dict routing id -> client record; the hot path reads ``delim``, ``bucket``
            (a :class:`TokenBucket`) and ``leases`` (set of lease ids) and counts into
            ``last_seen``, ``requests``, ``acquires``, ``hits``, ``prefetch_hits``,
            ``rate_limited``.
        leases: dict lease id -> (routing id, lease) of every delivered lease.
        counters: the server's counters (``collections.Counter``); the hot path counts
            ``requests`` and ``rate_limited``.
        limit: the per-client :class:`RateLimit`.
    Functions:
        send(frame, flags): send one frame on the server's socket (raises ``zmq.ZMQError``).
        packb(obj) -> bytes: encode a reply.
        unpack(payload) -> object: decode a request with the protocol's limits; raises on bad
            input.
        register(client, lease): record a delivered lease as the client's (the one place a
            lease is registered: ``Server._register``).
        undelivered(client, lease, error): a lease could not be sent (``error`` the
            ``zmq.ZMQError``): roll it back.
        acquire_resident(layer, experts) -> lease or None; release(lease);
        generations(items) -> list; drain_pins(); prefetch_noop(layer, experts) -> bool: the
            cache's (``moecached.engine.cache.ExpertCache``).
    Values:
        version: the protocol version requests carry and replies give
            (``moecached.facts.protocol.PROTOCOL_VERSION``).
        fields: op -> the exact field set of a request of that op the hot path may serve
            (``moecached.facts.protocol.HOT_PATH_FIELDS``).
        session: the session id replies carry (a new session builds new hooks).
        max_message_bytes, max_experts: the request limits (*live*).
        tracing: True while a trace is being recorded; acquires then take the general path
            (*live*).
        more_nb, nb: the zmq flag ints for "more frames follow, don't block" and "don't block".
    """
    cdef public object clients, leases, counters, send, packb, unpack, register, undelivered
    cdef public object acquire_resident, release, generations, drain_pins, prefetch_noop
    cdef public object version, fields, session
    cdef public RateLimit limit
    cdef public Py_ssize_t max_message_bytes, max_experts
    cdef public bint tracing
    cdef public int more_nb, nb

    def __init__(self, *, clients, leases, counters, RateLimit limit, send, packb, unpack,
                 register, undelivered, acquire_resident, release, generations, drain_pins,
                 prefetch_noop, version, fields, session, Py_ssize_t max_message_bytes,
                 Py_ssize_t max_experts, bint tracing, int more_nb, int nb):
        self.clients = clients
        self.leases = leases
        self.counters = counters
        self.limit = limit
        self.send = send
        self.packb = packb
        self.unpack = unpack
        self.register = register
        self.undelivered = undelivered
        self.acquire_resident = acquire_resident
        self.release = release
        self.generations = generations
        self.drain_pins = drain_pins
        self.prefetch_noop = prefetch_noop
        self.version = version
        self.fields = dict(fields)
        self.session = session
        self.max_message_bytes = max_message_bytes
        self.max_experts = max_experts
        self.tracing = tracing
        self.more_nb = more_nb
        self.nb = nb


cdef class FastPath:
    """Serves resident acquires, own-lease noreply releases and no-op noreply prefetches of a
    server, through its :class:`ServerHooks` (see module doc)."""
    cdef ServerHooks h
    cdef object clients, leases, counters, send, packb, unpack, acquire_resident, release
    cdef object generations, drain_pins, prefetch_noop, register, version, fields
    cdef RateLimit limit

    def __init__(self, ServerHooks hooks not None):
        self.h = hooks
        # the hooks that never change, held here for speed
        self.clients = hooks.clients
        self.leases = hooks.leases
        self.counters = hooks.counters
        self.send = hooks.send
        self.packb = hooks.packb
        self.unpack = hooks.unpack
        self.acquire_resident = hooks.acquire_resident
        self.release = hooks.release
        self.generations = hooks.generations
        self.drain_pins = hooks.drain_pins
        self.prefetch_noop = hooks.prefetch_noop
        self.register = hooks.register
        self.version = hooks.version
        self.fields = hooks.fields
        self.limit = hooks.limit

    cdef inline void _seen(self, c) except *:
        c.last_seen = monotonic()
        c.requests += 1
        self.counters["requests"] += 1

    cdef inline void _seen_at(self, c, double now) except *:
        c.last_seen = now
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
        if type(payload) is not bytes or len(<bytes>payload) > self.h.max_message_bytes:
            return False
        try:
            msg = self.unpack(payload)
        except Exception:
            return False
        if type(msg) is not dict:
            return False
        d = <dict>msg
        op = d.get("op")
        if type(op) is not str:
            return False
        fields = (<dict>self.fields).get(op)
        if fields is None or len(d) != len(<frozenset>fields) or d.keys() != fields:
            return False
        rid = d["id"]
        if type(rid) is not int or rid < 0 or rid >= _U64:
            return False
        v = d["v"]
        if type(v) is not int or v != self.version:
            return False
        if op == "release":
            return self._release(c, ident, d)
        if op == "acquire":
            return self._acquire(c, ident, rid, d)
        return self._prefetch(c, d)

    cdef bint _prefetch(self, c, dict d) except -1:
        """A noreply prefetch: dropped and counted when the client is over its rate limit (as
        the general path does for any noreply request), served as a no-op when every expert is
        already present; anything else (work to queue, any doubt) goes to the general path."""
        if d["noreply"] is not True:
            return False
        layer = d["layer"]
        experts = d["experts"]
        if type(layer) is not int or type(experts) is not list:
            return False
        if len(<list>experts) > self.h.max_experts:
            return False
        cdef double now = monotonic()
        cdef TokenBucket bucket = <TokenBucket>c.bucket
        if not bucket.ready(now, self.limit):
            self._seen_at(c, now)
            bucket.take(now, self.limit)
            c.rate_limited += 1
            self.counters["rate_limited"] += 1
            return True
        if not self.prefetch_noop(layer, experts):
            return False
        self._seen_at(c, now)
        bucket.take(now, self.limit)
        return True

    cdef bint _release(self, c, ident, dict d) except -1:
        if d["noreply"] is not True:
            return False
        lid = d["lease"]
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
        layer = d["layer"]
        experts = d["experts"]
        if type(layer) is not int or type(experts) is not list:
            return False
        if len(<list>experts) > self.h.max_experts or self.h.tracing:
            return False
        cdef double now = monotonic()
        cdef TokenBucket bucket = <TokenBucket>c.bucket
        if not bucket.ready(now, self.limit):
            return False   # over its rate limit: the general path refuses it
        lease = self.acquire_resident(layer, experts)
        if lease is None:
            return False
        bucket.take(now, self.limit)
        self._seen_at(c, now)
        hits = lease.hits
        pf = lease.prefetch_hits
        c.acquires += 1
        c.hits += hits
        c.prefetch_hits += pf
        reply = self.packb({"v": self.version, "id": rid, "ok": True, "session": self.h.session,
                            "lease": lease.id, "items": lease.items,
                            "gens": self.generations(lease.items), "hits": hits,
                            "prefetch_hits": pf, "misses": 0, "stall_us": 0})
        try:
            self.send(ident, self.h.more_nb)
            self.send(reply, self.h.nb)
        except _ZMQError as e:
            self.h.undelivered(c, lease, e)
            return True
        self.register(c, lease)
        return True
