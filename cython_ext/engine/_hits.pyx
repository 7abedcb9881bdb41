# cython: language_level=3, boundscheck=False, wraparound=False
"""The lease table and the resident-hit path of ``moecached.engine.cache`` (Cython).

A request whose experts are all resident needs no read, no slot and no waiting: it is a
*hit*. :class:`HitPath` serves hits -- an acquire of one layer's resident experts, the
release of a lease when no acquire waits for slots, a prefetch with nothing to do, the slot
generations of a lease -- in one call each, with no Python-level code on the way (the cache's
lock is taken through its C methods; the per-expert work is ``LRU.grant_resident``,
``LRU.unpin_keys`` and ``LRU.all_present`` of ``moecached.engine._policy``). Anything else
returns None / False, having changed nothing, and the caller takes the general path
(``moecached.engine.requests``), which also produces every error. The server's hot path
(``moecached.service._serve.FastPath``) and the cache's ``acquire_resident``, ``release``,
``prefetch_noop`` and ``lease_generations`` are this.

It also owns the lease table: lease ids (unique and increasing from a random 63-bit base per
cache instance), lease id -> the keys the lease pins (``[(pool, [keys])]``), and the count of
leases granted; the general path registers its leases here (:meth:`HitPath.add`).

Lock discipline: the table, the pools' arrays and LRUs, the per-layer hit counters and
``closed`` are the cache's, under the cache's lock: :meth:`HitPath.acquire`,
:meth:`HitPath.release` and :meth:`HitPath.prefetch_noop` take it themselves; every other
method runs under it (the caller holds it), except :meth:`HitPath.generations` (reads the
arena's control block, as a lease holder does) and :meth:`HitPath.pins_waiting` (reads the pin
files' rings, which belong to their clients).
"""
from itertools import count

cdef object _new = object.__new__


cdef class HitPath:
    """The hit path over one cache's ``layout`` (``moecached.engine.slots.Layout``) and
    ``tally``, under the cache's ``lock``. ``waitq``: the list of queued acquires (a release
    while one waits takes the general path, which grants them); ``lease_cls``: the class of
    the leases it returns (``moecached.engine.pins.Lease``); ``id_base``: the first lease id.

    Attributes: ``table`` (lease id -> pins), ``granted`` (leases granted), ``closed`` (set
    when the cache closes: then nothing is served), ``gens`` (class id -> the slot
    generations), ``id_base``.
    """
    cdef object _lock_acquire, _lock_release
    cdef dict layers
    cdef public dict table
    cdef object ids
    cdef public object id_base
    cdef public long long granted
    cdef public bint closed
    cdef list l_hits, l_pf
    cdef object lease_cls
    cdef public dict gens
    cdef list waitq
    cdef object shm

    def __init__(self, lock, layout, tally, list waitq not None, lease_cls, id_base):
        self._lock_acquire = lock.acquire
        self._lock_release = lock.release
        self.layers = {layer: (L.pool, L.pool.lru, L.base, L.ne, L.pool.res, L.pool.unused, L.cid)
                       for layer, L in layout.layers.items()}
        self.table = {}
        self.id_base = id_base
        self.ids = count(id_base)
        self.granted = 0
        self.closed = False
        self.l_hits = tally.hits
        self.l_pf = tally.pf
        self.lease_cls = lease_cls
        self.gens = layout.gens
        self.waitq = waitq
        self.shm = layout.shm

    # ---- the lease table (under the cache's lock) --------------------------------------------
    def new_id(self):
        """The next lease id (also an acquire's ticket)."""
        return next(self.ids)

    def add(self, lid, list pins not None):
        """Register a lease granted by the general path: ``pins`` ``[(pool, [keys])]``."""
        self.table[lid] = pins
        self.granted += 1

    def own(self, lid) -> bool:
        """True when ``lid`` lies in this cache instance's id range (issued here, or one it
        could issue); False marks a lease id from another instance."""
        return self.id_base <= lid < self.id_base + (1 << 40)

    # ---- hits (each takes the cache's lock) ---------------------------------------------------
    def acquire(self, layer, experts):
        """Pin ``experts`` (a list of Python ints, at most 256) of ``layer`` when every one of
        them is resident: a lease (stall 0.0, misses 0), counted exactly as the general path
        would count it. None, changing nothing, when the request needs the general path: any
        expert absent or still loading, an unknown layer, a bad, repeated or out-of-range id,
        an empty list, or the cache closed."""
        L = self.layers.get(layer)
        if L is None:
            return None
        t = <tuple?>L
        pool = t[0]
        cdef long n, pf
        self._lock_acquire()
        try:
            if self.closed:
                return None
            got = t[1].grant_resident(experts, t[2], t[3], t[4], t[5], layer, t[6])
            if got is None:
                return None
            keys, items, pf = <tuple?>got
            lid = next(self.ids)
            self.table[lid] = [(pool, keys)]
            self.granted += 1
            n = len(<list?>keys)
            self.l_hits[layer] += n - pf
            if pf:
                self.l_pf[layer] += pf
        finally:
            self._lock_release()
        lease = _new(self.lease_cls)
        lease.id = lid
        lease.items = items
        lease.hits = n - pf
        lease.prefetch_hits = pf
        lease.misses = 0
        lease.stall_s = 0.0
        lease.swaps = []
        return lease

    def release(self, lease_or_id):
        """Unpin a lease (one of ours, or its id) when no acquire waits for slots: True. False,
        changing nothing, when one waits (the general release then grants it) or the id is not
        in the table (the general release raises the precise error)."""
        lid = lease_or_id.id if isinstance(lease_or_id, self.lease_cls) else lease_or_id
        self._lock_acquire()
        try:
            if self.waitq:
                return False
            pins = self.table.pop(lid, None)
            if pins is None:
                return False
            for pk in <list?>pins:
                (<tuple?>pk)[0].lru.unpin_keys((<tuple?>pk)[1])
            return True
        finally:
            self._lock_release()

    def prefetch_noop(self, layer, experts):
        """True when a prefetch of ``experts`` of ``layer`` has nothing to do: every one is a
        valid, distinct id already resident or loading (a list of Python ints, at most 256).
        False when it may have work or the request is bad (the general path then runs it).
        Changes and counts nothing."""
        L = self.layers.get(layer)
        if L is None:
            return False
        t = <tuple?>L
        self._lock_acquire()
        try:
            if self.closed:
                return False
            return t[1].all_present(experts, t[2], t[3])
        finally:
            self._lock_release()

    # ---- without the lock ---------------------------------------------------------------------
    def generations(self, items):
        """Generation of each item's slot (``(layer, expert, class_id, slot)`` items of a lease
        still pinned): what a holder compares against the arena's control block to know its
        lease is still valid (docs/protocol.md, "Lease validity")."""
        g = self.gens
        return [g[it[2]][it[3]] for it in items]

    def pins_waiting(self) -> bool:
        """True when hits taken through shared memory wait in the pin files' rings (the
        caller drains them first: they count before the request at hand)."""
        return bool(self.shm.files) and self.shm.pending()

    def release_views(self):
        """Drop the views of the arena's mapping (the cache closes: let it be unmapped)."""
        self.gens = {}
