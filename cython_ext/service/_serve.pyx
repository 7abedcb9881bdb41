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

A hit is one call into Cython that runs no Python-level code: the request is read by this
module's own msgpack reader (:func:`parse_request`: the three shapes only, any other encoding
declined), the lease taken by the cache's ``HitPath`` (``moecached.engine._hits``: the cache
lock, pin, touch, counters), the reply written by its own msgpack writer
(:func:`lease_reply`: byte for byte what ``msgpack.packb`` writes) and sent through the
socket's C ``send``, the lease registered in the server's tables. Python is called only off
the hit path: to drain the hits clients took through shared memory when their rings hold
some (``hooks.drain_pins``), to release a lease while acquires wait for slots
(``hooks.release``, which grants them), and when a reply cannot be delivered
(``hooks.undelivered``). tests/test_hot_path.py proves it (a profiler and spies on every hook
see nothing during hits).

The contract with the server is :class:`ServerHooks`: everything this module may use of it,
built by the server (``Server._fast_handler``) and kept current by it. The protocol version
and the request shapes it serves come from ``moecached.facts.protocol``
(``PROTOCOL_VERSION``, ``HOT_PATH_FIELDS``).

Per-client request rate: :class:`TokenBucket` (one per client, shared by both paths) with the
server's :class:`RateLimit`. The hot path only *looks* at the bucket before it knows it serves
a request and takes the token when it does, so a request it declines is charged once, by the
general path.
"""
import zmq
from time import monotonic

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy

cdef object _ZMQError = zmq.ZMQError
#: the socket's send in C (``zmq.Socket.send`` is Python that calls it)
cdef object _send = zmq.backend.Socket.send


# ---- the request reader ---------------------------------------------------------------------
# Fields the hot path's requests may carry (bits), ops it may serve.
cdef enum:
    F_V = 1
    F_ID = 2
    F_OP = 4
    F_LAYER = 8
    F_EXPERTS = 16
    F_LEASE = 32
    F_NOREPLY = 64
    OP_ACQUIRE = 1
    OP_RELEASE = 2
    OP_PREFETCH = 3
    MAX_IDS = 256     # experts per hot-path request (HitPath serves at most 256)

cdef dict _FIELD_BITS = {"v": F_V, "id": F_ID, "op": F_OP, "layer": F_LAYER,
                         "experts": F_EXPERTS, "lease": F_LEASE, "noreply": F_NOREPLY}
cdef dict _OPS = {"acquire": OP_ACQUIRE, "release": OP_RELEASE, "prefetch": OP_PREFETCH}

cdef struct Req:
    int fields            # F_* bits seen (each at most once)
    int op                # OP_*
    unsigned long long v, id, layer, lease
    Py_ssize_t n          # experts
    unsigned long long experts[MAX_IDS]


cdef inline bint _uint(const unsigned char *p, Py_ssize_t end, Py_ssize_t *pos,
                       unsigned long long *out) noexcept nogil:
    """A msgpack integer >= 0 at ``p[pos]`` (any width): True and ``out``; False for anything
    else (a negative integer included: every field the hot path reads declines one)."""
    cdef Py_ssize_t i = pos[0], w, j
    cdef unsigned char t
    cdef unsigned long long x = 0
    if i >= end:
        return False
    t = p[i]
    if t < 0x80:
        out[0] = t
        pos[0] = i + 1
        return True
    if t == 0xcc or t == 0xd0:
        w = 1
    elif t == 0xcd or t == 0xd1:
        w = 2
    elif t == 0xce or t == 0xd2:
        w = 4
    elif t == 0xcf or t == 0xd3:
        w = 8
    else:
        return False
    if i + 1 + w > end:
        return False
    if t >= 0xd0 and p[i + 1] & 0x80:   # a signed width holding a negative value
        return False
    for j in range(w):
        x = (x << 8) | p[i + 1 + j]
    out[0] = x
    pos[0] = i + 1 + w
    return True


cdef inline bint _key(const unsigned char *p, Py_ssize_t end, Py_ssize_t *pos,
                      const char *name, Py_ssize_t n) noexcept nogil:
    """The fixstr at ``p[pos]`` is ``name`` (``n`` bytes): True, past it."""
    cdef Py_ssize_t i = pos[0]
    if i + 1 + n > end or p[i] != 0xa0 + n or memcmp(p + i + 1, name, n) != 0:
        return False
    pos[0] = i + 1 + n
    return True


cdef bint _parse(const unsigned char *p, Py_ssize_t end, Req *r) noexcept nogil:
    """Read one request map of the hot path's shapes into ``r``; False (``r`` meaningless) for
    anything else: another type or encoding, an unknown or repeated key, a value of another
    type, more than MAX_IDS experts, trailing bytes. Whatever it accepts, ``msgpack.unpackb``
    with the protocol's limits decodes to the same fields and values."""
    cdef Py_ssize_t pos = 0, count, i, j, n
    cdef unsigned char t
    cdef int bit
    cdef unsigned long long x
    r.fields = 0
    r.op = 0
    r.n = 0
    if end < 1:
        return False
    t = p[0]
    if 0x80 <= t <= 0x8f:
        count = t & 0x0f
        pos = 1
    elif t == 0xde and end >= 3:
        count = (p[1] << 8) | p[2]
        pos = 3
    else:
        return False
    for i in range(count):
        if pos >= end:
            return False
        t = p[pos]
        if t == 0xa1 and _key(p, end, &pos, "v", 1):
            bit = F_V
            if not _uint(p, end, &pos, &r.v):
                return False
        elif t == 0xa2 and _key(p, end, &pos, "id", 2):
            bit = F_ID
            if not _uint(p, end, &pos, &r.id):
                return False
        elif t == 0xa2 and _key(p, end, &pos, "op", 2):
            bit = F_OP
            if _key(p, end, &pos, "acquire", 7):
                r.op = OP_ACQUIRE
            elif _key(p, end, &pos, "release", 7):
                r.op = OP_RELEASE
            elif _key(p, end, &pos, "prefetch", 8):
                r.op = OP_PREFETCH
            else:
                return False
        elif t == 0xa5 and _key(p, end, &pos, "layer", 5):
            bit = F_LAYER
            if not _uint(p, end, &pos, &r.layer):
                return False
        elif t == 0xa5 and _key(p, end, &pos, "lease", 5):
            bit = F_LEASE
            if not _uint(p, end, &pos, &r.lease):
                return False
        elif t == 0xa7 and _key(p, end, &pos, "experts", 7):
            bit = F_EXPERTS
            if pos >= end:
                return False
            t = p[pos]
            if 0x90 <= t <= 0x9f:
                n = t & 0x0f
                pos += 1
            elif t == 0xdc and pos + 3 <= end:
                n = (p[pos + 1] << 8) | p[pos + 2]
                pos += 3
            else:
                return False
            if n > MAX_IDS:
                return False
            for j in range(n):
                if not _uint(p, end, &pos, &r.experts[j]):
                    return False
            r.n = n
        elif t == 0xa7 and _key(p, end, &pos, "noreply", 7):
            bit = F_NOREPLY
            if pos >= end or p[pos] != 0xc3:   # true; anything else goes the general way
                return False
            pos += 1
        else:
            return False
        if r.fields & bit:
            return False
        r.fields |= bit
    return pos == end


def parse_request(bytes payload not None):
    """The fields of a request the hot path's reader accepts, as a dict (what
    ``msgpack.unpackb`` gives for it), or None when it declines the bytes (tests use this)."""
    cdef Req r
    if not _parse(<const unsigned char *>PyBytes_AS_STRING(payload), PyBytes_GET_SIZE(payload), &r):
        return None
    out = {}
    if r.fields & F_V:
        out["v"] = r.v
    if r.fields & F_ID:
        out["id"] = r.id
    if r.fields & F_OP:
        out["op"] = {OP_ACQUIRE: "acquire", OP_RELEASE: "release", OP_PREFETCH: "prefetch"}[r.op]
    if r.fields & F_LAYER:
        out["layer"] = r.layer
    if r.fields & F_LEASE:
        out["lease"] = r.lease
    if r.fields & F_EXPERTS:
        out["experts"] = [r.experts[i] for i in range(r.n)]
    if r.fields & F_NOREPLY:
        out["noreply"] = True
    return out


# ---- the reply writer -------------------------------------------------------------------------
cdef inline Py_ssize_t _put_uint(unsigned char *b, Py_ssize_t i, unsigned long long x) noexcept nogil:
    """``x`` as msgpack writes a non-negative integer (the narrowest form)."""
    cdef int w, j
    if x < 0x80:
        b[i] = <unsigned char>x
        return i + 1
    if x < 0x100:
        b[i] = 0xcc
        w = 1
    elif x < 0x10000:
        b[i] = 0xcd
        w = 2
    elif (x >> 32) == 0:
        b[i] = 0xce
        w = 4
    else:
        b[i] = 0xcf
        w = 8
    for j in range(w):
        b[i + w - j] = <unsigned char>(x >> (8 * j))
    return i + 1 + w


cdef inline Py_ssize_t _put_key(unsigned char *b, Py_ssize_t i, const char *k, int n) noexcept nogil:
    b[i] = 0xa0 + n
    memcpy(b + i + 1, k, n)
    return i + 1 + n


cdef inline Py_ssize_t _put_array(unsigned char *b, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    if n < 16:
        b[i] = 0x90 + n
        return i + 1
    if n < 0x10000:
        b[i] = 0xdc
        b[i + 1] = <unsigned char>(n >> 8)
        b[i + 2] = <unsigned char>n
        return i + 3
    b[i] = 0xdd
    b[i + 1] = <unsigned char>(n >> 24)
    b[i + 2] = <unsigned char>(n >> 16)
    b[i + 3] = <unsigned char>(n >> 8)
    b[i + 4] = <unsigned char>n
    return i + 5


cdef bytes _lease_reply(unsigned char **buf, Py_ssize_t *cap, unsigned long long version,
                        unsigned long long rid, unsigned long long session, lease, list gens):
    """The reply to a hit (the general path's ``_deliver`` of an all-resident lease), written
    into ``*buf`` (grown when short): ``{"v", "id", "ok": true, "session", "lease", "items",
    "gens", "hits", "prefetch_hits", "misses": 0, "stall_us": 0}``."""
    cdef list items = lease.items
    cdef Py_ssize_t n = len(items), i = 0, k
    cdef Py_ssize_t need = 160 + n * 46 + len(gens) * 9
    cdef unsigned char *b
    if need > cap[0]:
        b = <unsigned char *>realloc(buf[0], need)
        if b == NULL:
            raise MemoryError()
        buf[0] = b
        cap[0] = need
    b = buf[0]
    b[i] = 0x8b   # a map of 11
    i += 1
    i = _put_key(b, i, "v", 1)
    i = _put_uint(b, i, version)
    i = _put_key(b, i, "id", 2)
    i = _put_uint(b, i, rid)
    i = _put_key(b, i, "ok", 2)
    b[i] = 0xc3
    i += 1
    i = _put_key(b, i, "session", 7)
    i = _put_uint(b, i, session)
    i = _put_key(b, i, "lease", 5)
    i = _put_uint(b, i, lease.id)
    i = _put_key(b, i, "items", 5)
    i = _put_array(b, i, n)
    for it in items:
        t = <tuple?>it
        i = _put_array(b, i, len(t))
        for k in range(len(t)):
            i = _put_uint(b, i, t[k])
    i = _put_key(b, i, "gens", 4)
    i = _put_array(b, i, len(gens))
    for g in gens:
        i = _put_uint(b, i, g)
    i = _put_key(b, i, "hits", 4)
    i = _put_uint(b, i, lease.hits)
    i = _put_key(b, i, "prefetch_hits", 13)
    i = _put_uint(b, i, lease.prefetch_hits)
    i = _put_key(b, i, "misses", 6)
    b[i] = 0
    i += 1
    i = _put_key(b, i, "stall_us", 8)
    b[i] = 0
    i += 1
    return PyBytes_FromStringAndSize(<char *>b, i)


def lease_reply(version, rid, session, lease, gens):
    """The hot path's reply to a hit, as bytes (tests compare it with ``msgpack.packb`` of
    the general path's reply dict)."""
    cdef Py_ssize_t cap = 64
    cdef unsigned char *buf = <unsigned char *>malloc(cap)
    if buf == NULL:
        raise MemoryError()
    try:
        return _lease_reply(&buf, &cap, version, rid, session, lease, list(gens))
    finally:
        free(buf)


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
        leases: dict lease id -> (routing id, lease) of every delivered lease; the hot path
            registers the leases it delivers here and in the client's ``leases`` (what
            ``Server._register`` does while no trace is recorded: while one is, acquires take
            the general path).
        counters: the server's counters (``collections.Counter``); the hot path counts
            ``requests`` and ``rate_limited``.
        limit: the per-client :class:`RateLimit`.
        sock: the server's ROUTER socket (replies go out through its C ``send``).
        hits: the cache's ``moecached.engine._hits.HitPath`` (``ExpertCache.hit_path``):
            resident acquires, releases, no-op prefetches, slot generations.
    Functions (Python; called off the hit path only):
        drain_pins(): the cache's: apply the hits waiting in the pin files' rings (called when
            ``hits.pins_waiting()``).
        release(lease): the cache's general release (when ``hits.release`` declines: acquires
            wait for slots).
        undelivered(client, lease, error): a lease could not be sent (``error`` the
            ``zmq.ZMQError``): roll it back.
    Values:
        version: the protocol version requests carry and replies give
            (``moecached.facts.protocol.PROTOCOL_VERSION``).
        fields: op -> the exact field set of a request of that op the hot path may serve
            (``moecached.facts.protocol.HOT_PATH_FIELDS``; an op naming a field the reader
            does not know is never served).
        session: the session id replies carry (a new session builds new hooks).
        max_message_bytes, max_experts: the request limits (*live*).
        tracing: True while a trace is being recorded; acquires then take the general path
            (*live*).
        more_nb, nb: the zmq flag ints for "more frames follow, don't block" and "don't block".
    """
    cdef public object clients, leases, counters, sock, hits, drain_pins, release, undelivered
    cdef public object version, fields, session
    cdef public RateLimit limit
    cdef public Py_ssize_t max_message_bytes, max_experts
    cdef public bint tracing
    cdef public int more_nb, nb

    def __init__(self, *, clients, leases, counters, RateLimit limit, sock, hits, drain_pins,
                 release, undelivered, version, fields, session, Py_ssize_t max_message_bytes,
                 Py_ssize_t max_experts, bint tracing, int more_nb, int nb):
        self.clients = clients
        self.leases = leases
        self.counters = counters
        self.limit = limit
        self.sock = sock
        self.hits = hits
        self.drain_pins = drain_pins
        self.release = release
        self.undelivered = undelivered
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
    cdef object clients, leases, counters, sock, hits, drain_pins, release
    cdef RateLimit limit
    cdef unsigned long long version, session
    cdef int masks[4]        # op -> the F_* bits of its field set (-1: never served)
    cdef unsigned char *buf  # the reply being written (grown when short)
    cdef Py_ssize_t cap

    def __cinit__(self):
        self.cap = 4096
        self.buf = <unsigned char *>malloc(self.cap)
        if self.buf == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.buf)

    def __init__(self, ServerHooks hooks not None):
        self.h = hooks
        # the hooks that never change, held here for speed
        self.clients = hooks.clients
        self.leases = hooks.leases
        self.counters = hooks.counters
        self.sock = hooks.sock
        self.hits = hooks.hits
        self.drain_pins = hooks.drain_pins
        self.release = hooks.release
        self.limit = hooks.limit
        self.version = hooks.version
        self.session = hooks.session
        cdef int op, m
        for op in range(4):
            self.masks[op] = -1
        for name, fields in hooks.fields.items():
            op = _OPS.get(name, 0)
            if op:
                m = 0
                for f in fields:
                    m = -1 if m < 0 or f not in _FIELD_BITS else m | <int>_FIELD_BITS[f]
                self.masks[op] = m

    cdef inline void _seen_at(self, c, double now) except *:
        c.last_seen = now
        c.requests += 1
        self.counters["requests"] += 1

    def handle(self, list frames):
        """Serve one request frame set ``[routing id, payload]`` if it is a hot-path request.

        Returns True when served (reply sent, lease registered or released), False when the
        caller must run the general path on the same frames.
        """
        cdef Req r
        if self.hits.pins_waiting():
            self.drain_pins()   # hits taken through shared memory count first
        if len(frames) != 2:
            return False
        ident = frames[0]
        payload = frames[1]
        c = self.clients.get(ident)
        if c is None or c.delim:
            return False
        if type(payload) is not bytes or PyBytes_GET_SIZE(payload) > self.h.max_message_bytes:
            return False
        if not _parse(<const unsigned char *>PyBytes_AS_STRING(payload), PyBytes_GET_SIZE(payload), &r):
            return False
        if r.op == 0 or r.fields != self.masks[r.op] or r.v != self.version:
            return False
        if r.op == OP_RELEASE:
            return self._release(c, ident, &r)
        if r.op == OP_ACQUIRE:
            return self._acquire(c, ident, &r)
        return self._prefetch(c, &r)

    cdef list _experts(self, Req *r):
        return [r.experts[i] for i in range(r.n)]

    cdef bint _prefetch(self, c, Req *r) except -1:
        """A noreply prefetch: dropped and counted when the client is over its rate limit (as
        the general path does for any noreply request), served as a no-op when every expert is
        already present; anything else (work to queue, any doubt) goes to the general path."""
        if r.n > self.h.max_experts:
            return False
        cdef double now = monotonic()
        cdef TokenBucket bucket = <TokenBucket?>c.bucket
        if not bucket.ready(now, self.limit):
            self._seen_at(c, now)
            bucket.take(now, self.limit)
            c.rate_limited += 1
            self.counters["rate_limited"] += 1
            return True
        if not self.hits.prefetch_noop(r.layer, self._experts(r)):
            return False
        self._seen_at(c, now)
        bucket.take(now, self.limit)
        return True

    cdef bint _release(self, c, ident, Req *r) except -1:
        lid = r.lease
        owner = self.leases.get(lid)
        if owner is None or (<tuple?>owner)[0] != ident:
            return False
        self._seen_at(c, monotonic())
        del self.leases[lid]
        c.leases.discard(lid)
        lease = (<tuple?>owner)[1]
        if not self.hits.release(lease):
            self.release(lease)   # acquires wait for slots: the general release grants them
        return True

    cdef bint _acquire(self, c, ident, Req *r) except -1:
        if r.n > self.h.max_experts or self.h.tracing:
            return False
        cdef double now = monotonic()
        cdef TokenBucket bucket = <TokenBucket?>c.bucket
        if not bucket.ready(now, self.limit):
            return False   # over its rate limit: the general path refuses it
        lease = self.hits.acquire(r.layer, self._experts(r))
        if lease is None:
            return False
        bucket.take(now, self.limit)
        self._seen_at(c, now)
        c.acquires += 1
        c.hits += lease.hits
        c.prefetch_hits += lease.prefetch_hits
        reply = _lease_reply(&self.buf, &self.cap, self.version, r.id, self.session, lease,
                             self.hits.generations(lease.items))
        try:
            _send(self.sock, ident, self.h.more_nb)
            _send(self.sock, reply, self.h.nb)
        except _ZMQError as e:
            self.h.undelivered(c, lease, e)
            return True
        lid = lease.id
        self.leases[lid] = (ident, lease)
        c.leases.add(lid)
        return True
