# Simulator policies (included by cython_ext/engine/_policy.pyx after lru.pyx).

# =============================================================================================
# Simulator policies.
#
# Every policy below orders the keys of one or more *groups* (a group = one budget of slots:
# a layer for the per-layer policies, a size class for the shared-budget ones). For one
# (step, layer) set the replay loop does what the daemon's cache does with a request
# (``ExpertCache._grant``): first it calls ``access(k, t)`` for every key of the set that is
# resident (``res[k]``) when the set starts -- the hits, in set order -- then for every other
# key -- the misses, in set order; each accessed key becomes pinned; then ``release(k, i)``
# for each key in set order. Pinned keys are never victims, so a miss can evict neither a hit
# of its own set nor an earlier miss of it. ``t`` is the access's timestamp in that processing
# order (``set_start[s]`` + rank in the set's hits-then-misses order: unique, increasing over
# the stream); ``i`` in ``release`` is the key's position in the stream (what ``next_use`` is
# indexed by). No access of a hit evicts anything, so "hit" (resident when the set starts) is
# decided before any key of the set is accessed. The replay guarantees that every set fits its
# group (capacity >= set size), so a full group always has an unpinned victim. Exact
# semantics: docs/policies.md.
# =============================================================================================
cdef i64* _arr(list keep, Py_ssize_t n, i64 fill) except NULL:
    """A numpy int64 array of n (>= 1) values kept alive by ``keep``; returns its data."""
    a = np.full(max(n, 1), fill, dtype=np.int64)
    keep.append(a)
    cdef i64[::1] mv = a
    return &mv[0]


cdef uint8_t* _arr8(list keep, Py_ssize_t n) except NULL:
    a = np.zeros(max(n, 1), dtype=np.uint8)
    keep.append(a)
    cdef uint8_t[::1] mv = a
    return &mv[0]


cdef class _Pol:
    """Base of the simulator policies: groups, capacities, residency and pins."""
    cdef public str name
    cdef public i64 halve_every     # tokens between halvings of frequency counts (0 = never)
    cdef public bint cold           # set by the replay per set: admit its misses cold
    cdef public bint cold_probation # ... at the probation point instead of the cold end
    cdef public bint admits_cold    # the policy honours ``cold`` (else it must stay False)
    cdef i64 n_keys, n_groups
    cdef i64 *group
    cdef i64 *cap
    cdef i64 *gsize
    cdef uint8_t *res
    cdef uint8_t *pins
    cdef list _keep

    def __init__(self, group_of_key, capacity):
        self._keep = []
        g = np.ascontiguousarray(group_of_key, dtype=np.int64)
        c = np.ascontiguousarray(capacity, dtype=np.int64)
        if g.ndim != 1 or c.ndim != 1 or len(g) < 1 or len(c) < 1:
            raise ValueError("policy: group_of_key and capacity must be non-empty 1-D arrays")
        if g.min() < 0 or g.max() >= len(c):
            raise ValueError(f"policy: group_of_key: found {g.min()}..{g.max()}, "
                             f"expected 0..{len(c) - 1}")
        if c.min() < 1:
            raise ValueError(f"policy: capacity: found {c.min()}, expected >= 1 per group")
        self.n_keys = len(g)
        self.n_groups = len(c)
        self.group = _arr(self._keep, self.n_keys, 0)
        self.cap = _arr(self._keep, self.n_groups, 0)
        self.gsize = _arr(self._keep, self.n_groups, 0)
        cdef i64 j
        for j in range(self.n_keys):
            self.group[j] = g[j]
        for j in range(self.n_groups):
            self.cap[j] = c[j]
        self.res = _arr8(self._keep, self.n_keys)
        self.pins = _arr8(self._keep, self.n_keys)

    cdef int access(self, i64 k, i64 i) except -1:
        return 0

    cdef int release(self, i64 k, i64 i) except -1:
        return 0

    cdef int halve(self) except -1:
        return 0

    cdef int credit(self, i64 k) except -1:
        """``k`` was offered as a substitute candidate (only ``replay_subst`` calls it)."""
        return 0

    cdef int hold(self, i64 k, bint on) except -1:
        """Pin (``on``) or unpin resident ``k`` while ``reserve`` picks victims."""
        return 0

    cdef int reserve(self, i64 k) except -1:
        """Make room for the miss ``k`` before the set's hits are accessed (the daemon takes
        every missing expert's slot first). Policies that evict in ``access`` do nothing."""
        return 0

    def resident(self):
        """Sorted resident keys (for tests)."""
        return [j for j in range(self.n_keys) if self.res[j]]


# ----------------------------------------------------------------------------- LRU (daemon's)

cdef class _LRUPol(_Pol):
    """``lru`` / ``g-lru``: one daemon ``LRU`` per group, driven exactly as the cache drives it
    (``ExpertCache._grant``; the replay accesses a set's hits first, then its misses): hit ->
    touch + pin; miss -> (victim + remove when full) + insert at the hot end + pin; release ->
    unpin. With ``cold`` (scan-resistant admission) a miss is inserted at the cold end, as
    the daemon inserts an unused prefetch, or with ``cold_probation`` at the probation point
    (``insert_probation``). ``make(n_keys)``: the daemon's eviction order
    (``moecached.engine.policy.EVICTIONS``; default ``LRU``), one per group, driven the same way; a
    candidate ``credit`` goes to its ``credit``."""
    cdef list lrus
    cdef i64 *pend          # per group: slots reserved for misses not yet inserted

    def __init__(self, group_of_key, capacity, make=None):
        _Pol.__init__(self, group_of_key, capacity)
        self.admits_cold = True
        if make is None:
            make = LRU
        self.lrus = [make(self.n_keys) for _ in range(self.n_groups)]
        self.pend = _arr(self._keep, self.n_groups, 0)
        if any(not isinstance(x, LRU) for x in self.lrus):
            raise TypeError("policy: make(n_keys) must return an LRU (or LFUDecay)")

    cdef int credit(self, i64 k) except -1:
        (<LRU>self.lrus[self.group[k]]).credit(k)
        return 0

    cdef int hold(self, i64 k, bint on) except -1:
        if on:
            (<LRU>self.lrus[self.group[k]]).pin(k)
        else:
            (<LRU>self.lrus[self.group[k]]).unpin(k)
        return 0

    cdef int reserve(self, i64 k) except -1:
        cdef i64 g = self.group[k]
        cdef LRU lr = <LRU>self.lrus[g]
        cdef long v
        if lr.size + self.pend[g] >= self.cap[g]:
            v = lr.victim()
            if v < 0:
                raise RuntimeError("policy: group full of pinned keys")
            lr.remove(v)
            self.res[v] = 0
        self.pend[g] += 1
        return 0

    cdef int access(self, i64 k, i64 i) except -1:
        cdef LRU lr = <LRU>self.lrus[self.group[k]]
        cdef long v
        if lr.contains(k):
            lr.touch(k)
            lr.pin(k)
            return 1
        if self.pend[self.group[k]] > 0:   # its slot was taken by reserve
            self.pend[self.group[k]] -= 1
        elif lr.size >= self.cap[self.group[k]]:
            v = lr.victim()
            lr.remove(v)
            self.res[v] = 0
        if self.cold and self.cold_probation:
            lr.insert_probation(k)
        else:
            lr.insert(k, self.cold)
        lr.pin(k)
        self.res[k] = 1
        return 0

    cdef int release(self, i64 k, i64 i) except -1:
        (<LRU>self.lrus[self.group[k]]).unpin(k)
        return 0


# ----------------------------------------------------------------------------- heap policies

cdef class _HeapPol(_Pol):
    """Victim = the unpinned resident key of the group with the smallest (p1, p2).

    An indexed binary min-heap per group holds exactly the unpinned resident keys (a key
    leaves the heap while pinned and re-enters on release with its updated priority)."""
    cdef i64 *heap
    cdef i64 *hpos
    cdef i64 *gofs
    cdef i64 *gcnt
    cdef i64 *p1
    cdef i64 *p2

    def __init__(self, group_of_key, capacity):
        _Pol.__init__(self, group_of_key, capacity)
        self.gofs = _arr(self._keep, self.n_groups + 1, 0)
        cdef i64 g
        for g in range(self.n_groups):
            self.gofs[g + 1] = self.gofs[g] + self.cap[g]
        self.heap = _arr(self._keep, self.gofs[self.n_groups], -1)
        self.gcnt = _arr(self._keep, self.n_groups, 0)
        self.hpos = _arr(self._keep, self.n_keys, -1)
        self.p1 = _arr(self._keep, self.n_keys, 0)
        self.p2 = _arr(self._keep, self.n_keys, 0)

    cdef inline bint _less(self, i64 a, i64 b) noexcept nogil:
        return self.p1[a] < self.p1[b] or (self.p1[a] == self.p1[b] and self.p2[a] < self.p2[b])

    cdef inline void _set(self, i64 *h, i64 j, i64 k) noexcept nogil:
        h[j] = k
        self.hpos[k] = j

    cdef void _up(self, i64 g, i64 j) noexcept nogil:
        cdef i64 *h = self.heap + self.gofs[g]
        cdef i64 k = h[j], pj
        while j > 0:
            pj = (j - 1) >> 1
            if self._less(k, h[pj]):
                self._set(h, j, h[pj])
                j = pj
            else:
                break
        self._set(h, j, k)

    cdef void _down(self, i64 g, i64 j) noexcept nogil:
        cdef i64 *h = self.heap + self.gofs[g]
        cdef i64 n = self.gcnt[g]
        cdef i64 k = h[j], c
        while True:
            c = 2 * j + 1
            if c >= n:
                break
            if c + 1 < n and self._less(h[c + 1], h[c]):
                c += 1
            if self._less(h[c], k):
                self._set(h, j, h[c])
                j = c
            else:
                break
        self._set(h, j, k)

    cdef void _push(self, i64 k) noexcept nogil:
        cdef i64 g = self.group[k]
        cdef i64 j = self.gcnt[g]
        self.gcnt[g] += 1
        self._set(self.heap + self.gofs[g], j, k)
        self._up(g, j)

    cdef void _remove(self, i64 k) noexcept nogil:
        cdef i64 g = self.group[k]
        cdef i64 *h = self.heap + self.gofs[g]
        cdef i64 j = self.hpos[k]
        cdef i64 last
        self.gcnt[g] -= 1
        last = h[self.gcnt[g]]
        self.hpos[k] = -1
        if last != k:
            self._set(h, j, last)
            self._up(g, j)
            self._down(g, self.hpos[last])

    cdef void _heapify(self, i64 g) noexcept nogil:
        cdef i64 j = self.gcnt[g] // 2 - 1
        while j >= 0:
            self._down(g, j)
            j -= 1

    cdef void upd(self, i64 k, i64 i) noexcept nogil:
        pass

    cdef void rel(self, i64 k, i64 i) noexcept nogil:
        pass

    cdef int access(self, i64 k, i64 i) except -1:
        cdef i64 g = self.group[k], v
        cdef int hit
        if self.res[k]:
            self._remove(k)
            hit = 1
        else:
            if self.gsize[g] >= self.cap[g]:
                if self.gcnt[g] == 0:
                    raise RuntimeError("policy: group full of pinned keys")
                v = self.heap[self.gofs[g]]
                self._remove(v)
                self.res[v] = 0
                self.gsize[g] -= 1
            self.res[k] = 1
            self.gsize[g] += 1
            hit = 0
        self.upd(k, i)
        return hit

    cdef int release(self, i64 k, i64 i) except -1:
        self.rel(k, i)
        self._push(k)
        return 0


cdef class _LFUPol(_HeapPol):
    """``lfu`` / ``g-lfu``: victim = fewest accesses (counted for every key since the start,
    resident or not), ties -> least recently accessed. ``aging``: ``halve()`` halves all
    counts (floor); the replay calls it every 64 tokens for g-lfu."""
    cdef bint aging

    def __init__(self, group_of_key, capacity, aging=False):
        _HeapPol.__init__(self, group_of_key, capacity)
        self.aging = aging

    cdef void upd(self, i64 k, i64 i) noexcept nogil:
        self.p1[k] += 1
        self.p2[k] = i

    cdef int halve(self) except -1:
        cdef i64 j
        if not self.aging:
            return 0
        for j in range(self.n_keys):
            self.p1[j] >>= 1
        for j in range(self.n_groups):
            self._heapify(j)
        return 0


cdef class _LRU2Pol(_HeapPol):
    """``lru-2`` (LRU-K, K=2): victim = oldest second-to-last access (never = -1 first),
    ties -> oldest last access. History is kept for every key (also after eviction)."""

    def __init__(self, group_of_key, capacity):
        _HeapPol.__init__(self, group_of_key, capacity)
        cdef i64 j
        for j in range(self.n_keys):
            self.p1[j] = -1
            self.p2[j] = -1

    cdef void upd(self, i64 k, i64 i) noexcept nogil:
        self.p1[k] = self.p2[k]
        self.p2[k] = i


cdef class _OptPol(_HeapPol):
    """``opt`` / ``g-opt`` (Belady MIN): victim = unpinned resident whose next access is
    farthest (never again = ``n_accesses``), ties -> larger key. ``next_use[i]``: index of the
    next access of the key accessed at i."""
    cdef i64 *nu

    def __init__(self, group_of_key, capacity, next_use):
        _HeapPol.__init__(self, group_of_key, capacity)
        a = np.ascontiguousarray(next_use, dtype=np.int64)
        self._keep.append(a)
        cdef i64[::1] mv = a
        self.nu = &mv[0] if len(a) else NULL

    cdef void rel(self, i64 k, i64 i) noexcept nogil:
        self.p1[k] = -self.nu[i]
        self.p2[k] = -k


# ----------------------------------------------------------------------------- list policies

cdef class _ListPol(_Pol):
    """Several doubly linked lists over keys sharing one prev/next array (a key is in at most
    one list). List ``j`` has sentinel node ``n_keys + j``; next = towards cold (back)."""
    cdef i64 n_lists
    cdef i64 *prv
    cdef i64 *nxt
    cdef i64 *owner
    cdef i64 *lsize

    def __init__(self, group_of_key, capacity, lists_per_group):
        _Pol.__init__(self, group_of_key, capacity)
        self.n_lists = self.n_groups * lists_per_group
        cdef i64 n = self.n_keys + self.n_lists, j
        self.prv = _arr(self._keep, n, 0)
        self.nxt = _arr(self._keep, n, 0)
        self.owner = _arr(self._keep, self.n_keys, -1)
        self.lsize = _arr(self._keep, self.n_lists, 0)
        for j in range(self.n_keys, n):
            self.prv[j] = j
            self.nxt[j] = j

    cdef inline void push_front(self, i64 lst, i64 k) noexcept nogil:
        cdef i64 s = self.n_keys + lst
        self.nxt[k] = self.nxt[s]
        self.prv[k] = s
        self.prv[self.nxt[s]] = k
        self.nxt[s] = k
        self.owner[k] = lst
        self.lsize[lst] += 1

    cdef inline void unlink(self, i64 k) noexcept nogil:
        self.nxt[self.prv[k]] = self.nxt[k]
        self.prv[self.nxt[k]] = self.prv[k]
        self.lsize[self.owner[k]] -= 1
        self.owner[k] = -1

    cdef inline i64 back(self, i64 lst) noexcept nogil:
        cdef i64 s = self.n_keys + lst
        cdef i64 k = self.prv[s]
        return -1 if k == s else k

    cdef inline i64 cold_unpinned(self, i64 lst) noexcept nogil:
        """Coldest key of ``lst`` that is not pinned, or -1."""
        cdef i64 s = self.n_keys + lst
        cdef i64 k = self.prv[s]
        while k != s:
            if not self.pins[k]:
                return k
            k = self.prv[k]
        return -1

    cdef inline void evict(self, i64 k) noexcept nogil:
        self.unlink(k)
        self.res[k] = 0
        self.gsize[self.group[k]] -= 1

    cdef int release(self, i64 k, i64 i) except -1:
        self.pins[k] = 0
        return 0


cdef inline i64 _pct(i64 pct, i64 c) noexcept nogil:
    """round_half_up(pct% of c) in integers."""
    return (2 * pct * c + 100) // 200


cdef class _SLRUPol(_ListPol):
    """``slru``: probation (list 2g) + protected (list 2g+1); protected holds at most
    ``C - max(1, round(20% C))``. Miss -> probation front; probation hit -> protected front
    (overflow: protected's coldest -> probation front); protected hit -> protected front.
    Victim: coldest unpinned of probation, else of protected."""
    cdef i64 *pmax

    def __init__(self, group_of_key, capacity, prob_pct=20):
        _ListPol.__init__(self, group_of_key, capacity, 2)
        self.pmax = _arr(self._keep, self.n_groups, 0)
        cdef i64 g
        for g in range(self.n_groups):
            self.pmax[g] = max(0, self.cap[g] - max(1, _pct(prob_pct, self.cap[g])))

    cdef int access(self, i64 k, i64 i) except -1:
        cdef i64 g = self.group[k], v, d
        cdef int hit = 0
        self.pins[k] = 1
        if self.owner[k] == 2 * g + 1:
            self.unlink(k)
            self.push_front(2 * g + 1, k)
            return 1
        if self.owner[k] == 2 * g:
            self.unlink(k)
            self.push_front(2 * g + 1, k)
            if self.lsize[2 * g + 1] > self.pmax[g]:
                d = self.back(2 * g + 1)
                self.unlink(d)
                self.push_front(2 * g, d)
            return 1
        if self.gsize[g] >= self.cap[g]:
            v = self.cold_unpinned(2 * g)
            if v < 0:
                v = self.cold_unpinned(2 * g + 1)
            if v < 0:
                raise RuntimeError("slru: group full of pinned keys")
            self.evict(v)
        self.push_front(2 * g, k)
        self.res[k] = 1
        self.gsize[g] += 1
        return 0


cdef class _ARCPol(_ListPol):
    """``arc`` (Megiddo & Modha 2003): T1 = 4g, T2 = 4g+1, ghosts B1 = 4g+2, B2 = 4g+3,
    target p per group. REPLACE takes the coldest *unpinned* key of the list ARC picks,
    falling back to the other list when that one has none unpinned."""
    cdef double *p

    def __init__(self, group_of_key, capacity):
        _ListPol.__init__(self, group_of_key, capacity, 4)
        a = np.zeros(self.n_groups, dtype=np.float64)
        self._keep.append(a)
        cdef double[::1] mv = a
        self.p = &mv[0]

    cdef int _replace(self, i64 g, bint in_b2) except -1:
        cdef i64 t1 = self.lsize[4 * g]
        cdef i64 v
        if t1 >= 1 and ((in_b2 and <double>t1 == self.p[g]) or <double>t1 > self.p[g]):
            v = self.cold_unpinned(4 * g)
            if v >= 0:
                self.evict(v)
                self.push_front(4 * g + 2, v)
                return 0
            v = self.cold_unpinned(4 * g + 1)
            if v < 0:
                raise RuntimeError("arc: group full of pinned keys")
            self.evict(v)
            self.push_front(4 * g + 3, v)
        else:
            v = self.cold_unpinned(4 * g + 1)
            if v >= 0:
                self.evict(v)
                self.push_front(4 * g + 3, v)
                return 0
            v = self.cold_unpinned(4 * g)
            if v < 0:
                raise RuntimeError("arc: group full of pinned keys")
            self.evict(v)
            self.push_front(4 * g + 2, v)
        return 0

    cdef int access(self, i64 k, i64 i) except -1:
        cdef i64 g = self.group[k], o = self.owner[k], c = self.cap[g], v
        cdef i64 b1, b2, t1, t2
        cdef double d
        self.pins[k] = 1
        if o == 4 * g or o == 4 * g + 1:          # hit in T1 or T2
            self.unlink(k)
            self.push_front(4 * g + 1, k)
            return 1
        b1 = self.lsize[4 * g + 2]
        b2 = self.lsize[4 * g + 3]
        if o == 4 * g + 2:                        # ghost hit in B1
            d = 1.0 if b2 <= b1 else (<double>b2) / b1
            self.p[g] = min(<double>c, self.p[g] + d)
            self._replace(g, False)
            self.unlink(k)
        elif o == 4 * g + 3:                      # ghost hit in B2
            d = 1.0 if b1 <= b2 else (<double>b1) / b2
            self.p[g] = max(0.0, self.p[g] - d)
            self._replace(g, True)
            self.unlink(k)
        else:                                     # complete miss
            t1 = self.lsize[4 * g]
            t2 = self.lsize[4 * g + 1]
            if t1 + b1 == c:
                if t1 < c:
                    v = self.back(4 * g + 2)
                    self.unlink(v)
                    self._replace(g, False)
                else:
                    v = self.cold_unpinned(4 * g)
                    if v < 0:
                        raise RuntimeError("arc: group full of pinned keys")
                    self.evict(v)
            elif t1 + t2 + b1 + b2 >= c:
                if t1 + t2 + b1 + b2 == 2 * c:
                    v = self.back(4 * g + 3)
                    self.unlink(v)
                self._replace(g, False)
            self.push_front(4 * g, k)
            self.res[k] = 1
            self.gsize[g] += 1
            return 0
        self.push_front(4 * g + 1, k)
        self.res[k] = 1
        self.gsize[g] += 1
        return 0


cdef inline uint64_t _mix64(uint64_t z) noexcept nogil:
    """splitmix64 finaliser of z + golden gamma (the sketch's hash; see docs/policies.md)."""
    z = z + <uint64_t>0x9E3779B97F4A7C15ULL
    z = (z ^ (z >> 30)) * <uint64_t>0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * <uint64_t>0x94D049BB133111EBULL
    return z ^ (z >> 31)


cdef class _WTinyLFUPol(_ListPol):
    """``w-tinylfu``: window LRU (3g) of ``max(1, round(w% C))`` slots, main SLRU with
    probation (3g+1) and protected (3g+2, at most ``round(80% of C - window)``), admission of
    window evictees into main by a count-min sketch (4 rows x next_pow2(max(C,16)) 4-bit
    counters, halved after 10*C increments). Details: docs/policies.md."""
    cdef i64 *wmax
    cdef i64 *pmax
    cdef i64 *width
    cdef i64 *sofs
    cdef i64 *adds
    cdef uint8_t *sk

    def __init__(self, group_of_key, capacity, window_pct=1):
        _ListPol.__init__(self, group_of_key, capacity, 3)
        self.wmax = _arr(self._keep, self.n_groups, 0)
        self.pmax = _arr(self._keep, self.n_groups, 0)
        self.width = _arr(self._keep, self.n_groups, 0)
        self.sofs = _arr(self._keep, self.n_groups + 1, 0)
        self.adds = _arr(self._keep, self.n_groups, 0)
        cdef i64 g, w
        for g in range(self.n_groups):
            self.wmax[g] = max(1, _pct(window_pct, self.cap[g]))
            self.pmax[g] = _pct(80, max(0, self.cap[g] - self.wmax[g]))
            w = 16
            while w < self.cap[g]:
                w *= 2
            self.width[g] = w
            self.sofs[g + 1] = self.sofs[g] + 4 * w
        self.sk = _arr8(self._keep, self.sofs[self.n_groups])

    cdef void _incr(self, i64 k) noexcept nogil:
        cdef i64 g = self.group[k], w = self.width[g], r, j
        cdef uint8_t *row
        for r in range(4):
            row = self.sk + self.sofs[g] + r * w
            j = <i64>(_mix64((<uint64_t>k << 2) | <uint64_t>r) & <uint64_t>(w - 1))
            if row[j] < 15:
                row[j] += 1
        self.adds[g] += 1
        if self.adds[g] >= 10 * self.cap[g]:
            for j in range(4 * w):
                self.sk[self.sofs[g] + j] >>= 1
            self.adds[g] //= 2

    cdef i64 freq(self, i64 k) noexcept nogil:
        cdef i64 g = self.group[k], w = self.width[g], r, j, f = 15
        for r in range(4):
            j = <i64>(_mix64((<uint64_t>k << 2) | <uint64_t>r) & <uint64_t>(w - 1))
            f = min(f, <i64>self.sk[self.sofs[g] + r * w + j])
        return f

    cdef i64 _main_victim(self, i64 g) noexcept nogil:
        cdef i64 v = self.cold_unpinned(3 * g + 1)
        if v < 0:
            v = self.cold_unpinned(3 * g + 2)
        return v

    cdef int access(self, i64 k, i64 i) except -1:
        cdef i64 g = self.group[k], o = self.owner[k], c, v, d
        self._incr(k)
        self.pins[k] = 1
        if o == 3 * g:                              # window hit
            self.unlink(k)
            self.push_front(3 * g, k)
            return 1
        if o == 3 * g + 2:                          # protected hit
            self.unlink(k)
            self.push_front(3 * g + 2, k)
            return 1
        if o == 3 * g + 1:                          # probation hit -> protected
            self.unlink(k)
            self.push_front(3 * g + 2, k)
            if self.lsize[3 * g + 2] > self.pmax[g]:
                d = self.back(3 * g + 2)
                self.unlink(d)
                self.push_front(3 * g + 1, d)
            return 1
        # miss: into the window, then shed the window's overflow into main
        self.push_front(3 * g, k)
        self.res[k] = 1
        self.gsize[g] += 1
        while self.lsize[3 * g] > self.wmax[g]:
            c = self.cold_unpinned(3 * g)
            if c < 0:
                break
            self.unlink(c)
            if self.gsize[g] <= self.cap[g]:
                self.push_front(3 * g + 1, c)
                continue
            v = self._main_victim(g)
            if v >= 0 and self.freq(c) > self.freq(v):
                self.evict(v)
                self.push_front(3 * g + 1, c)
            else:
                self.res[c] = 0
                self.gsize[g] -= 1
        if self.gsize[g] > self.cap[g]:
            v = self._main_victim(g)
            if v < 0:
                v = self.cold_unpinned(3 * g)
            if v < 0:
                raise RuntimeError("w-tinylfu: group full of pinned keys")
            self.evict(v)
        return 0
