# Daemon LRU: the eviction order of moecached.engine.cache (included by cython_ext/engine/_policy.pyx).

cdef class LRU:
    """Least-recently-used order over keys ``0 .. n_keys-1`` with pin counts.

    Doubly linked list over arrays (O(1) touch/insert/remove). ``victim()`` walks from the
    cold end past pinned keys, so it costs O(pinned) in the worst case.

    Args:
        n_keys: number of distinct keys (e.g. layers x experts).
    Raises:
        ValueError: n_keys < 1.
    """

    cdef long n_keys, head, size, n_pinned
    cdef long *prev
    cdef long *next
    cdef char *present
    cdef int *pins

    def __cinit__(self, long n_keys, *args):
        if n_keys < 1:
            raise ValueError(f"LRU n_keys: found {n_keys}, expected >= 1")
        self.n_keys = n_keys
        self.head = n_keys  # sentinel: head.next = MRU, head.prev = LRU (cold end)
        self.prev = <long*>malloc((n_keys + 1) * sizeof(long))
        self.next = <long*>malloc((n_keys + 1) * sizeof(long))
        self.present = <char*>calloc(n_keys + 1, 1)
        self.pins = <int*>calloc(n_keys + 1, sizeof(int))
        if not self.prev or not self.next or not self.present or not self.pins:
            raise MemoryError()
        self.prev[self.head] = self.head
        self.next[self.head] = self.head
        self.size = 0
        self.n_pinned = 0

    def __dealloc__(self):
        free(self.prev); free(self.next); free(self.present); free(self.pins)

    cdef inline void _check(self, long k) except *:
        if k < 0 or k >= self.n_keys:
            raise IndexError(f"LRU key: found {k}, expected 0..{self.n_keys - 1}")

    cdef inline void _unlink(self, long k) noexcept nogil:
        self.next[self.prev[k]] = self.next[k]
        self.prev[self.next[k]] = self.prev[k]

    cdef inline void _link_after(self, long at, long k) noexcept nogil:
        self.next[k] = self.next[at]
        self.prev[k] = at
        self.prev[self.next[at]] = k
        self.next[at] = k

    cdef void _hit(self, long k) noexcept:
        """A demanded use of present key ``k`` (touch, the hit path): move it to the hot end.
        Subclasses add their own bookkeeping (``LFUDecay`` counts it)."""
        self._unlink(k)
        self._link_after(self.head, k)

    cpdef bint contains(self, long k):
        """True when key ``k`` is tracked (resident)."""
        self._check(k)
        return self.present[k] != 0

    cpdef bint touch(self, long k):
        """Move ``k`` to the hot (MRU) end. Returns False when ``k`` is not present."""
        self._check(k)
        if not self.present[k]:
            return False
        self._hit(k)
        return True

    cpdef void insert(self, long k, bint cold=False) except *:
        """Add ``k`` at the hot end, or at the cold end when ``cold`` (unused prefetch).

        Raises ValueError when ``k`` is already present.
        """
        self._check(k)
        if self.present[k]:
            raise ValueError(f"LRU insert: key {k} already present")
        self.present[k] = 1
        self.size += 1
        if cold:
            self._link_after(self.prev[self.head], k)
        else:
            self._link_after(self.head, k)

    cpdef void insert_probation(self, long k) except *:
        """Add ``k`` at the probation point (scan-resistant admission, ``scan_admit =
        "probation"``): ``size // 5`` present keys (a fifth, floor) stay colder than it, so it
        is evicted after them unless used again. Not a use (``LFUDecay`` counts nothing).
        Raises ValueError when ``k`` is already present."""
        self._check(k)
        if self.present[k]:
            raise ValueError(f"LRU insert: key {k} already present")
        cdef long node = self.head, i
        for i in range(self.size // 5):
            node = self.prev[node]
        self.present[k] = 1
        self.size += 1
        self._link_after(self.prev[node], k)

    cpdef bint remove(self, long k) except *:
        """Forget ``k`` (evicted or dropped). Returns False when absent. Pinned keys raise."""
        self._check(k)
        if not self.present[k]:
            return False
        if self.pins[k]:
            raise ValueError(f"LRU remove: key {k} is pinned ({self.pins[k]} pins)")
        self._unlink(k)
        self.present[k] = 0
        self.size -= 1
        return True

    cpdef void pin(self, long k) except *:
        """Add one pin to ``k`` (must be present). Pinned keys are never victims."""
        self._check(k)
        if not self.present[k]:
            raise ValueError(f"LRU pin: key {k} not present")
        if self.pins[k] == 0:
            self.n_pinned += 1
        self.pins[k] += 1

    cpdef void unpin(self, long k) except *:
        """Drop one pin of ``k``. Raises ValueError when ``k`` holds no pin."""
        self._check(k)
        if self.pins[k] <= 0:
            raise ValueError(f"LRU unpin: key {k} holds no pin")
        self.pins[k] -= 1
        if self.pins[k] == 0:
            self.n_pinned -= 1

    cpdef void credit(self, long k) except *:
        """Note that ``k`` was offered as a substitute candidate (``acquire`` candidates). The
        LRU order ignores it; ``LFUDecay`` with a candidate weight counts it."""
        self._check(k)

    cpdef long cold_rank(self, long k, long limit):
        """Present keys colder than ``k`` in the recency order (0: ``k`` is the coldest),
        counting at most ``limit``: returns ``limit`` when ``k`` is not among the ``limit``
        coldest present keys (or absent). O(min(rank, limit)). Every eviction order keeps the
        recency order (a demanded use moves a key to the hot end), so this is what the cache
        asks before a prefetch evicts ``k`` (docs/policies.md, "Prefetch confidence")."""
        self._check(k)
        cdef long node = self.prev[self.head], i = 0
        while node != self.head and i < limit:
            if node == k:
                return i
            node = self.prev[node]
            i += 1
        return limit

    cpdef int pin_count(self, long k):
        self._check(k)
        return self.pins[k]

    cpdef long victim(self):
        """Coldest unpinned present key, or -1 when every present key is pinned."""
        cdef long k = self.prev[self.head]
        while k != self.head:
            if self.pins[k] == 0:
                return k
            k = self.prev[k]
        return -1

    def grant_resident(self, list experts, long base, long ne, list res, bytearray unused,
                       layer, cid):
        """The cache's hit path: pin and touch a request whose experts are all resident.

        Args:
            experts: expert ids of one layer (Python ints), at most 256, no repeats.
            base: key of expert 0 of that layer in this LRU (``key = base + expert``).
            ne: experts in the layer (valid ids are ``0 .. ne-1``).
            res: key -> published slot, or -1 when absent/loading (the pool's ``res`` list).
            unused: key -> 1 when a prefetch brought it in and no demand used it yet; cleared
                here for the experts granted.
            layer, cid: put into each item as given (the layer's GGUF block, its size class).
        Returns:
            ``(keys, items, prefetch_hits)`` -- keys and ``(layer, expert, cid, slot)`` items
            in request order, ``prefetch_hits`` an int -- when every expert is a
            valid, distinct, resident id: each key is then pinned once and moved to the hot
            end. ``None`` when anything is off (absent or loading expert, bad type or range,
            repeat, empty or over 256 ids): nothing is changed and the caller takes the
            general path, which also produces the error message.
        """
        cdef Py_ssize_t n = len(experts), i, j
        cdef long e, k, s, pf = 0
        cdef long ks[256]
        if n == 0 or n > 256 or len(res) < self.n_keys or len(unused) < self.n_keys:
            return None
        for i in range(n):
            x = experts[i]
            if type(x) is not int or x < 0 or x >= ne:   # compared as Python ints: no overflow
                return None
            e = x
            k = base + e
            if k < 0 or k >= self.n_keys or not self.present[k]:
                return None
            for j in range(i):
                if ks[j] == k:
                    return None
            ks[i] = k
        items = [None] * n
        for i in range(n):
            slot = res[ks[i]]
            s = slot
            if s < 0:
                return None
            items[i] = (layer, experts[i], cid, slot)
        keys = [None] * n
        for i in range(n):
            k = ks[i]
            if self.pins[k] == 0:
                self.n_pinned += 1
            self.pins[k] += 1
            self._hit(k)
            if unused[k]:
                unused[k] = 0
                pf += 1
            keys[i] = k
        return keys, items, pf

    def all_present(self, list experts, long base, long ne):
        """The cache's no-op prefetch check: True when ``experts`` are valid, distinct ids
        (at most 256) whose keys ``base + expert`` are all present (resident or loading), so a
        prefetch of them has nothing to do. False otherwise (the caller takes the general
        path, which also produces any error message). Changes nothing."""
        cdef Py_ssize_t n = len(experts), i, j
        cdef long e, k
        cdef long ks[256]
        if n == 0 or n > 256:
            return False
        for i in range(n):
            x = experts[i]
            if type(x) is not int or x < 0 or x >= ne:   # compared as Python ints: no overflow
                return False
            e = x
            k = base + e
            if k < 0 or k >= self.n_keys or not self.present[k]:
                return False
            for j in range(i):
                if ks[j] == k:
                    return False
            ks[i] = k
        return True

    def unpin_keys(self, list keys):
        """Drop one pin of every key in ``keys`` (a lease's release), all or nothing.

        Raises ValueError (and changes nothing) when a key is out of range or holds no pin.
        """
        cdef Py_ssize_t i, j, n = len(keys)
        cdef long k, same
        for i in range(n):
            k = keys[i]
            self._check(k)
            same = 0
            for j in range(i):
                if <long>keys[j] == k:
                    same += 1
            if self.pins[k] <= same:
                raise ValueError(f"LRU unpin: key {k} holds no pin")
        for i in range(n):
            k = keys[i]
            self.pins[k] -= 1
            if self.pins[k] == 0:
                self.n_pinned -= 1

    def keys(self):
        """Present keys from hot (MRU) to cold (LRU), as a list."""
        out = []
        cdef long k = self.next[self.head]
        while k != self.head:
            out.append(k)
            k = self.next[k]
        return out

    def __len__(self):
        return self.size

    property pinned:
        """Number of distinct pinned keys."""
        def __get__(self):
            return self.n_pinned


cdef class LFUDecay(LRU):
    """Decayed LFU with the ``LRU``'s interface (the daemon's ``eviction = "lfu-decay"``).

    Every demanded use of a key -- a ``touch`` (hit) or a hot ``insert`` (demanded load) --
    adds ``use_weight`` to its count; a cold ``insert`` (unused prefetch, cold admission) adds
    nothing; a ``credit`` (the key offered as a substitute candidate) adds ``cand_weight``.
    Counts outlive eviction. Once the weights added since the last halving reach
    ``halve_after``, all counts are halved (floor). ``victim()`` is the unpinned present key
    with the lowest count, ties -> the least recently used (the ``LRU`` order is kept as well).
    O(present keys) per victim.

    Args:
        n_keys: as ``LRU``; halve_after: added weight between halvings (>= 1); use_weight
            (>= 1), cand_weight (>= 0): what a use and a candidate credit add.
    """
    cdef long *cnt
    cdef long halve_after, n_acc, use_w, cand_w

    def __cinit__(self, long n_keys, long halve_after=1024, long use_weight=1,
                  long cand_weight=0):
        if halve_after < 1:
            raise ValueError(f"LFUDecay halve_after: found {halve_after}, expected >= 1")
        if use_weight < 1 or cand_weight < 0:
            raise ValueError(f"LFUDecay weights: found use {use_weight}, candidate "
                             f"{cand_weight}, expected use >= 1 and candidate >= 0")
        self.cnt = <long*>calloc(n_keys + 1, sizeof(long))
        if not self.cnt:
            raise MemoryError()
        self.halve_after = halve_after
        self.use_w = use_weight
        self.cand_w = cand_weight
        self.n_acc = 0

    def __dealloc__(self):
        free(self.cnt)

    cdef inline void _count(self, long k, long w) noexcept:
        cdef long j
        self.cnt[k] += w
        self.n_acc += w
        if self.n_acc >= self.halve_after:
            for j in range(self.n_keys):
                self.cnt[j] >>= 1
            self.n_acc = 0

    cdef void _hit(self, long k) noexcept:
        self._count(k, self.use_w)
        LRU._hit(self, k)

    cpdef void insert(self, long k, bint cold=False) except *:
        LRU.insert(self, k, cold)
        if not cold:
            self._count(k, self.use_w)

    cpdef void credit(self, long k) except *:
        self._check(k)
        if self.cand_w:
            self._count(k, self.cand_w)

    cpdef long victim(self):
        """Unpinned present key with the lowest count (ties: least recent), or -1."""
        cdef long k = self.prev[self.head], best = -1
        while k != self.head:
            if self.pins[k] == 0 and (best < 0 or self.cnt[k] < self.cnt[best]):
                best = k
            k = self.prev[k]
        return best

    cpdef long count(self, long k):
        """The decayed use count of ``k`` (present or not)."""
        self._check(k)
        return self.cnt[k]


cdef class SLRU(LRU):
    """Segmented LRU with the ``LRU``'s interface (the daemon's ``eviction = "slru"``).

    Keys are *probation* or *protected*. An ``insert`` (hot, cold or at the probation point)
    enters probation; a use (``touch``) of a probation key moves it to protected, of a
    protected key keeps it there, and makes it the most recent of its segment; when protected
    then holds more than ``size - max(1, round_half_up(size / 5))`` keys (``size`` = keys
    present now, so the split follows ``set_budget``), its least recent key goes back to
    probation as that segment's most recent. ``victim()``: the least recent unpinned probation
    key, else the least recent unpinned protected key. One recency list holds both segments
    (each segment's order is the order of its keys in it); O(present keys) per victim and per
    demotion. ``insert_probation`` is a plain insert here (every miss enters probation).

    Args:
        n_keys: as ``LRU``.
    """
    cdef char *prot
    cdef long n_prot

    def __cinit__(self, long n_keys, *args):
        self.prot = <char*>calloc(n_keys + 1, 1)
        if not self.prot:
            raise MemoryError()
        self.n_prot = 0

    def __dealloc__(self):
        free(self.prot)

    cdef void _hit(self, long k) noexcept:
        cdef long d
        LRU._hit(self, k)
        if self.prot[k]:
            return
        self.prot[k] = 1
        self.n_prot += 1
        if self.n_prot > self.size - max(1, (2 * self.size + 5) // 10):
            d = self.prev[self.head]          # least recent protected key
            while d != self.head and not self.prot[d]:
                d = self.prev[d]
            if d != self.head:
                self.prot[d] = 0
                self.n_prot -= 1
                LRU._hit(self, d)             # probation's most recent

    cpdef void insert_probation(self, long k) except *:
        self.insert(k, False)

    cpdef bint remove(self, long k) except *:
        cdef bint was = LRU.remove(self, k)
        if was and self.prot[k]:
            self.prot[k] = 0
            self.n_prot -= 1
        return was

    cpdef long victim(self):
        """Least recent unpinned probation key, else least recent unpinned protected key, or
        -1 when every present key is pinned."""
        cdef long k = self.prev[self.head], best = -1
        while k != self.head:
            if self.pins[k] == 0:
                if not self.prot[k]:
                    return k
                if best < 0:
                    best = k
            k = self.prev[k]
        return best

    cpdef bint protected(self, long k):
        """True when ``k`` is present and in the protected segment."""
        self._check(k)
        return self.prot[k] != 0
