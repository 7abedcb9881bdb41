# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Eviction policies (Cython core of ``moecached.policy``).

One module per concept: the daemon's cache and the trace simulator use the *same* policy
classes from here, so a simulated hit rate is the hit rate the daemon gets.

Keys are non-negative ints < n_keys (the cache uses ``layer_slot * n_experts + expert``).
Policies only order keys; the cache owns slots and decides when to evict (when no slot is
free it asks ``victim()``), so pinned keys (leased or loading) are skipped, never evicted.
"""
from libc.stdlib cimport malloc, calloc, free


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

    def __cinit__(self, long n_keys):
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

    cpdef bint contains(self, long k):
        """True when key ``k`` is tracked (resident)."""
        self._check(k)
        return self.present[k] != 0

    cpdef bint touch(self, long k):
        """Move ``k`` to the hot (MRU) end. Returns False when ``k`` is not present."""
        self._check(k)
        if not self.present[k]:
            return False
        self._unlink(k)
        self._link_after(self.head, k)
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
