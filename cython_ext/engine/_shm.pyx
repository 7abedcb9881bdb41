# cython: language_level=3, boundscheck=False, wraparound=False
"""The daemon's side of the shared-memory hit path (Cython core of ``moecached.engine.cache``).

Every rule about who writes what, and in which order, lives once in
``clients/c/include/moecache_shm.h``; this module only calls it: publishing a resident expert
(``mcshm_publish``), evicting one unless a fast-path pin holds it (``mcshm_try_evict``),
reading the hit rings (``mcshm_drain``, ``mcshm_ring_reset``). What it adds is bookkeeping
the header leaves to the daemon: which pin files are open, which of their pins are honoured
(at most ``quota`` distinct slots per file), the merge of all rings by time, and the rings'
budget: at most ``hit_rate`` entries per second are taken from the pin files of one uid
together (:class:`HitBudget`, bursts of one ring), the rest is skipped unread (the tail moves
past it) and counted, so a uid flooding its rings, over as many connections as it likes, costs
the daemon no more than one client within its rate; a drain applies ``DRAIN_MAX`` at most. The
entries taken are applied to the cache's LRUs and hit counters here, in C, one call per drain.

Pin files are untrusted input: the daemon never reads their header words back (the layout is
its own), counts are read as "pinned or not", ring entries are range-checked by the caller.
All methods but :meth:`ShmArena.pending` run under the cache lock; ``pending`` and the
opening/closing of pin files run on the server's loop thread only.
"""
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport malloc, calloc, free
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC
from posix.mman cimport mmap, munmap, PROT_READ, PROT_WRITE, MAP_SHARED, MAP_FAILED

cimport moecache_shm as H
from moecache_shm cimport (MCSHM_MAX_CLASSES, MCSHM_PIN_HEADER_BYTES, mcshm_drain, mcshm_layout,
                           mcshm_pinned_by, mcshm_publish, mcshm_ring_pending, mcshm_ring_reset,
                           mcshm_try_evict, mcshm_u64)

cdef extern from *:
    """
    /* A head no client following the protocol can write (more than ring_n entries ahead of
       the tail): the ring is reset. One load of each word, as mcshm_ring_pending does. */
    static inline int moecached_ring_implausible(const mcshm_layout *m, mcshm_u64 *pf) {
        uint64_t h = atomic_load_explicit(&pf[MCSHM_PIN_W_HEAD], memory_order_acquire);
        uint64_t t = atomic_load_explicit(&pf[MCSHM_PIN_W_TAIL], memory_order_relaxed);
        return h - t > m->ring_n;
    }
    """
    int moecached_ring_implausible(const mcshm_layout *m, mcshm_u64 *pf) nogil

cdef extern from *:
    """
    #include <setjmp.h>
    #include <signal.h>
    #include <string.h>

    /* A pin file belongs to its client, who can truncate it: the daemon's next access to it
       would raise SIGBUS. Every access to pin-file memory runs under a guard: a SIGBUS taken
       while the guard of this thread is set jumps back and the call returns -1 (the caller
       then drops that file); any other SIGBUS gets the previous disposition. The guard
       pointer is volatile and fenced, so the compiler cannot move its stores across the
       accesses it guards. */
    static __thread sigjmp_buf *volatile moecached_bus_jb = NULL;
    static struct sigaction moecached_bus_old;
    static int moecached_bus_installed = 0;
    static void moecached_bus(int sig, siginfo_t *si, void *uc) {
        sigjmp_buf *jb = moecached_bus_jb;
        (void)sig; (void)si; (void)uc;
        if (jb != NULL) {
            moecached_bus_jb = NULL;
            siglongjmp(*jb, 1);
        }
        sigaction(SIGBUS, &moecached_bus_old, NULL);   /* not ours: fault again, as before */
    }
    static int moecached_bus_install(void) {
        struct sigaction sa;
        if (moecached_bus_installed)
            return 0;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = moecached_bus;
        sa.sa_flags = SA_SIGINFO | SA_NODEFER;   /* NODEFER: the jump leaves SIGBUS unblocked */
        sigemptyset(&sa.sa_mask);
        if (sigaction(SIGBUS, &sa, &moecached_bus_old) != 0)
            return -1;
        moecached_bus_installed = 1;
        return 0;
    }
    #define MOECACHED_GUARD(fail) sigjmp_buf jb; \
        if (sigsetjmp(jb, 0)) { fail; } \
        moecached_bus_jb = &jb; atomic_signal_fence(memory_order_seq_cst);
    #define MOECACHED_UNGUARD() atomic_signal_fence(memory_order_seq_cst); moecached_bus_jb = NULL;

    static int g_try_evict(const mcshm_layout *m, mcshm_u64 **pins, uint32_t n, uint32_t key,
                           uint32_t cls, uint32_t slot) {
        /* a fault can only come from reading pin counts, before the generation moves: the
           map is put back as it was and nothing was evicted */
        MOECACHED_GUARD(mcshm_publish(m, key, slot); return -1)
        int r = mcshm_try_evict(m, pins, n, key, cls, slot);
        MOECACHED_UNGUARD()
        return r;
    }
    static int g_pinned(const mcshm_layout *m, mcshm_u64 *pf, uint32_t gslot) {
        MOECACHED_GUARD(return -1)
        int r = mcshm_pinned_by(m, &pf, 1, gslot) != 0;
        MOECACHED_UNGUARD()
        return r;
    }
    /* slots of [0, n_slots) the pin file pins now; -1 on a fault */
    static long g_count_pinned(const mcshm_layout *m, mcshm_u64 *pf, uint32_t n_slots) {
        MOECACHED_GUARD(return -1)
        long c = 0;
        for (uint32_t g = 0; g < n_slots; g++)
            c += mcshm_pinned_by(m, &pf, 1, g) != 0;
        MOECACHED_UNGUARD()
        return c;
    }
    /* Entries in the ring now; -1 fault, -2 implausible head (the ring is reset if `reset`). */
    static long g_count(const mcshm_layout *m, mcshm_u64 *pf, int reset) {
        MOECACHED_GUARD(return -1)
        long r = moecached_ring_implausible(m, pf) ? -2 : (long)mcshm_ring_pending(m, pf);
        if (r == -2 && reset)
            mcshm_ring_reset(pf);
        MOECACHED_UNGUARD()
        return r;
    }
    /* Keep the newest `allow` entries: older ones are skipped unread, the tail moves past them
       first (*skipped). Then copy the oldest `take` (<= allow) of those kept; the rest stays in
       the ring. -1 fault, -2 implausible head (ring reset), else entries copied. */
    static long g_drain(const mcshm_layout *m, mcshm_u64 *pf, uint64_t *keys, uint64_t *ts,
                        uint32_t allow, uint32_t take, uint64_t *skipped) {
        MOECACHED_GUARD(return -1)
        long r;
        *skipped = 0;
        if (moecached_ring_implausible(m, pf)) {
            mcshm_ring_reset(pf);
            r = -2;
        } else {
            uint64_t n = mcshm_ring_pending(m, pf);
            if (n > allow) {
                uint64_t t = atomic_load_explicit(&pf[MCSHM_PIN_W_TAIL], memory_order_relaxed);
                atomic_store_explicit(&pf[MCSHM_PIN_W_TAIL], t + (n - allow), memory_order_release);
                *skipped = n - allow;
            }
            r = take ? mcshm_drain(m, pf, keys, ts, take) : 0;
        }
        MOECACHED_UNGUARD()
        return r;
    }
    /* The drain's merge, a heap of parts (files) by their next entry's time ts[pos[part]],
       then part: sift heap[i] down. */
    #define G_BEFORE(a, b) (ts[pos[a]] < ts[pos[b]] || (ts[pos[a]] == ts[pos[b]] && (a) < (b)))
    static void g_sift(long *heap, long n, long i, const uint64_t *ts, const long *pos) {
        long x = heap[i], c;
        while ((c = 2 * i + 1) < n) {
            if (c + 1 < n && G_BEFORE(heap[c + 1], heap[c]))
                c++;
            if (!G_BEFORE(heap[c], x))
                break;
            heap[i] = heap[c];
            i = c;
        }
        heap[i] = x;
    }
    /* 0 when every page of the mapping is there (the file was not truncated), -1 if not */
    static int g_probe(mcshm_u64 *pf, size_t size) {
        MOECACHED_GUARD(return -1)
        volatile const char *b = (volatile const char *)pf;
        for (size_t off = 0; off < size; off += 4096)
            (void)b[off];
        (void)b[size - 1];
        MOECACHED_UNGUARD()
        return 0;
    }
    """
    int moecached_bus_install() nogil
    int g_try_evict(const mcshm_layout *m, mcshm_u64 **pins, uint32_t n, uint32_t key,
                    uint32_t cls, uint32_t slot) nogil
    int g_pinned(const mcshm_layout *m, mcshm_u64 *pf, uint32_t gslot) nogil
    long g_count_pinned(const mcshm_layout *m, mcshm_u64 *pf, uint32_t n_slots) nogil
    long g_count(const mcshm_layout *m, mcshm_u64 *pf, int reset) nogil
    long g_drain(const mcshm_layout *m, mcshm_u64 *pf, uint64_t *keys, uint64_t *ts,
                 uint32_t allow, uint32_t take, uint64_t *skipped) nogil
    void g_sift(long *heap, long n, long i, const uint64_t *ts, const long *pos) nogil
    int g_probe(mcshm_u64 *pf, size_t size) nogil

#: Ring entries per pin file (a power of two): 16384 entries of 16 bytes, 256 KiB.
RING_N = 16384
#: Ring entries one drain applies at most, over all pin files (about 1 ms of work); the rest
#: waits in the rings for the next drain, shared out evenly between uids.
DRAIN_MAX = RING_N

cdef inline double _now() noexcept nogil:
    """``CLOCK_MONOTONIC`` in seconds (Python's ``time.monotonic``)."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9
# The shared-memory facts of moecache_shm.h, as Python values (the daemon's one source of them).
MAX_CLASSES = MCSHM_MAX_CLASSES
PIN_HEADER_BYTES = MCSHM_PIN_HEADER_BYTES
CTL_HEADER_BYTES = H.MCSHM_CTL_HEADER_BYTES
CTL_MAGIC = (<uint64_t> H.MCSHM_CTL_MAGIC).to_bytes(8, "little")
PIN_MAGIC = (<uint64_t> H.MCSHM_PIN_MAGIC).to_bytes(8, "little")
#: control block word indices
CTL_W_EPOCH, CTL_W_STATE, CTL_W_NCLASSES, CTL_W_NKEYS, CTL_W_RESMAP_OFF, CTL_W_RELEASES = (
    H.MCSHM_CTL_W_EPOCH, H.MCSHM_CTL_W_STATE, H.MCSHM_CTL_W_NCLASSES, H.MCSHM_CTL_W_NKEYS,
    H.MCSHM_CTL_W_RESMAP_OFF, H.MCSHM_CTL_W_RELEASES)
STATE_STOPPED, STATE_SERVING, STATE_MODEL_CHANGED = (
    H.MCSHM_STATE_STOPPED, H.MCSHM_STATE_SERVING, H.MCSHM_STATE_MODEL_CHANGED)
#: pin file word indices
PIN_WORDS = {"magic": H.MCSHM_PIN_W_MAGIC, "epoch": H.MCSHM_PIN_W_EPOCH,
             "n_slots": H.MCSHM_PIN_W_NSLOTS, "ring_n": H.MCSHM_PIN_W_RING_N,
             "pins_off": H.MCSHM_PIN_W_PINS_OFF, "ring_off": H.MCSHM_PIN_W_RING_OFF,
             "quota": H.MCSHM_PIN_W_QUOTA, "head": H.MCSHM_PIN_W_HEAD, "tail": H.MCSHM_PIN_W_TAIL}


cdef class HitBudget:
    """The hit-ring budget of one uid's pin files together (:meth:`ShmArena.add`; a file with
    no uid has its own): ``tokens``, the entries it allows now (``ShmArena.hit_rate`` a second,
    at most one ring); ``skipped``, the entries of its files skipped over it (closed files
    too); ``skip_rate``, the rate in force at the last skip. ``warn_until``, ``warned``: the
    server's bookkeeping for its warning (``moecached.service.clients``)."""
    cdef public double tokens, t_last, skip_rate, warn_until
    cdef public long skipped, warned
    cdef long seq, left, want, grant   # the current drain's share out (ShmArena._share)

    def __init__(self):
        self.tokens, self.t_last = RING_N, _now()


cdef class PinFile:
    """One fast-path client's pin file, mapped read-write by the daemon.

    Attributes: ``path``, ``size``, ``quota`` (distinct slots whose pins are honoured),
    ``honoured`` (set of global slots whose pins the daemon honours now), counters ``hits``,
    ``prefetch_hits`` (ring entries applied), ``drops`` (ring entries dropped: key out of range
    or not resident), ``resets`` (implausible heads), ``ignored`` (pins found past the quota),
    ``skipped`` (ring entries skipped unread: over its uid's budget, ``ShmArena.hit_rate``);
    ``budget``, that :class:`HitBudget` (set by :meth:`ShmArena.add`).
    """
    cdef mcshm_u64 *p
    cdef public size_t size
    cdef public object path, fd
    cdef public long quota
    cdef public set honoured
    cdef public long hits, prefetch_hits, drops, resets, ignored, skipped
    cdef public bint broken
    cdef public HitBudget budget
    cdef long allow   # the current drain: entries its budget allows it

    def __cinit__(self):
        self.p = NULL

    def __init__(self, path, int fd, size_t size, long quota):
        cdef void *a = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        if a == MAP_FAILED:
            raise OSError(f"cannot map pin file {path}")
        self.p = <mcshm_u64 *>a
        self.path = path
        self.fd = fd
        self.size = size
        self.quota = quota
        self.honoured = set()
        self.hits = self.prefetch_hits = self.drops = self.resets = self.ignored = self.skipped = 0
        self.broken = False
        self.budget = HitBudget()

    cpdef void unmap(self):
        if self.p != NULL:
            munmap(<void *>self.p, self.size)
            self.p = NULL

    def __dealloc__(self):
        if self.p != NULL:
            munmap(<void *>self.p, self.size)

    def info(self) -> dict:
        return {"fast_hits": self.hits + self.prefetch_hits, "ring_drops": self.drops,
                "ring_resets": self.resets, "ring_skipped": self.skipped,
                "pins_honoured": len(self.honoured), "pins_ignored": self.ignored}


cdef class ShmArena:
    """The daemon's view of its arena's control block plus the open pin files.

    Args:
        ctl_address: address of the arena's control block (the daemon's writable mapping).
        n_experts, n_keys: as in the control block header.
        classes: ``[(gen_off_bytes, n_slots), ...]`` in class-id order (ids 0..n-1).
        resmap_off: byte offset of the resident map.
    Raises ValueError for more than ``MAX_CLASSES`` classes.

    Attributes (besides the counters): ``hit_rate``, the ring entries per second taken from the
    pin files of one uid together (bursts of one ring; 0: no limit; config
    ``fast_path_hit_rate``); ``budgets``, uid -> its :class:`HitBudget` (kept while the arena
    lives, so a uid that reconnects finds its budget where it left it).
    """
    cdef mcshm_layout L
    cdef mcshm_u64 **ptrs
    cdef public dict budgets
    cdef uint64_t *kbuf   # a drain's entries (keys + 1, times), DRAIN_MAX at most
    cdef uint64_t *tbuf
    cdef long *mrg        # the drain's merge: 3 longs per file
    cdef long seq
    cdef public list files
    cdef public uint32_t n_slots_total
    cdef public uint64_t pins_off, ring_off, file_size
    cdef public long evictions_held, resets, drops_closed, ignored_closed, fast_hits, skipped_closed
    cdef public list broken
    cdef public double hit_rate
    # where a drained key goes (set_targets), per MoE layer index m: the layer, the LRU's touch,
    # the key of expert 0 in the pool, the pool's res list and unused bytearray
    cdef long n_moe
    cdef long *t_base
    cdef long *c_hits
    cdef long *c_pf
    cdef list t_layer, t_touch, t_res, t_unused

    def __cinit__(self):
        self.ptrs = NULL
        self.mrg = NULL
        self.t_base = self.c_hits = self.c_pf = NULL
        self.n_moe = self.seq = 0
        self.kbuf = <uint64_t *>malloc(DRAIN_MAX * sizeof(uint64_t))
        self.tbuf = <uint64_t *>malloc(DRAIN_MAX * sizeof(uint64_t))
        if self.kbuf == NULL or self.tbuf == NULL:
            raise MemoryError()

    def __init__(self, size_t ctl_address, uint32_t n_experts, uint32_t n_keys, list classes,
                 uint64_t resmap_off):
        cdef uint32_t i, base = 0
        if len(classes) > MCSHM_MAX_CLASSES:
            raise ValueError(f"{len(classes)} size classes, the shared-memory hit path handles "
                             f"at most {MCSHM_MAX_CLASSES}")
        self.L.ctl = <mcshm_u64 *>ctl_address
        self.L.pin = NULL
        self.L.session = 0
        self.L.n_experts = n_experts
        self.L.n_keys = n_keys
        self.L.n_classes = len(classes)
        self.L.ring_n = RING_N
        self.L.key_class = NULL
        for i in range(len(classes)):
            gen_off, n = classes[i]
            self.L.gen_word[i] = gen_off // 8
            self.L.slot_base[i] = base
            self.L.n_slots[i] = n
            base += n
        self.n_slots_total = base
        self.L.resmap_word = resmap_off // 8
        self.pins_off = PIN_HEADER_BYTES
        self.ring_off = (self.pins_off + 4 * base + 63) // 64 * 64
        self.L.pins_word32 = self.pins_off // 4
        self.L.ring_word = self.ring_off // 8
        self.file_size = (self.ring_off + 16 * RING_N + 4095) // 4096 * 4096
        self.files = []
        self.broken = []   # pin files found truncated (unmapped; their clients are to be dropped)
        if moecached_bus_install() != 0:
            raise OSError("cannot install the SIGBUS guard of the pin files")
        # counts of pin files already closed (open ones keep their own)
        self.evictions_held = self.resets = self.drops_closed = self.ignored_closed = 0
        self.fast_hits = self.skipped_closed = 0
        self.hit_rate = 0.0
        self.budgets = {}
        self.t_layer = self.t_touch = self.t_res = self.t_unused = []

    def __dealloc__(self):
        free(self.ptrs); free(self.mrg)
        free(self.kbuf); free(self.tbuf)
        free(self.t_base)
        free(self.c_hits)
        free(self.c_pf)

    def set_targets(self, list moe not None):
        """Where the hits of the rings go: ``moe[m] = (layer, lru, base, res, unused)`` for MoE
        layer index ``m`` (a key ``m * n_experts + e`` is expert ``e`` of ``layer``, key
        ``base + e`` of the pool whose LRU, ``res`` list and ``unused`` bytearray follow). The
        pool objects must live as long as this (they do: the cache's layout)."""
        cdef long m, n = len(moe)
        if n * self.L.n_experts != self.L.n_keys:
            raise ValueError(f"{n} MoE layers x {self.L.n_experts} experts != {self.L.n_keys} keys")
        free(self.t_base); free(self.c_hits); free(self.c_pf)
        self.t_base = <long *>malloc((n + 1) * sizeof(long))
        self.c_hits = <long *>calloc(n + 1, sizeof(long))
        self.c_pf = <long *>calloc(n + 1, sizeof(long))
        if self.t_base == NULL or self.c_hits == NULL or self.c_pf == NULL:
            raise MemoryError()
        self.t_layer, self.t_touch, self.t_res, self.t_unused = [], [], [], []
        for m in range(n):
            layer, lru, base, res, unused = moe[m]
            if len(<list?>res) < base + self.L.n_experts or len(<bytearray?>unused) < base + self.L.n_experts:
                raise ValueError(f"MoE layer {m}: the pool has fewer keys than base + n_experts")
            self.t_base[m] = base
            self.t_layer.append(layer)
            self.t_touch.append(lru.touch)
            self.t_res.append(res)
            self.t_unused.append(unused)
        self.n_moe = n

    cdef void _refresh(self) except *:
        free(self.ptrs); free(self.mrg)
        self.ptrs = <mcshm_u64 **>malloc((len(self.files) + 1) * sizeof(mcshm_u64 *))
        self.mrg = <long *>malloc(3 * (len(self.files) + 1) * sizeof(long))
        if self.ptrs == NULL or self.mrg == NULL:
            raise MemoryError()

    def header(self, uint64_t epoch, long quota) -> bytes:
        """The header words of a new pin file (written before any client sees it)."""
        words = [0x31304e4950454f4d, epoch, self.n_slots_total, RING_N, self.pins_off,
                 self.ring_off, quota]
        return b"".join(w.to_bytes(8, "little") for w in words)

    def add(self, PinFile f, uid=None):
        """Honour ``f`` from now on; its ring shares the budget of ``uid``'s other pin files
        (None: a budget of its own)."""
        if uid is not None:
            f.budget = self.budgets.setdefault(uid, HitBudget())
        self.files.append(f)
        self._refresh()

    def remove(self, PinFile f):
        """Stop honouring ``f``'s pins (its honoured slots go) and unmap it."""
        if f in self.files:
            self.files.remove(f)
            self._refresh()
            self.fast_hits += f.hits + f.prefetch_hits
            self.drops_closed += f.drops
            self.ignored_closed += f.ignored
            self.skipped_closed += f.skipped
        f.honoured = set()
        f.unmap()

    def close(self):
        """Unmap every pin file and forget the control block (the arena goes next)."""
        for f in self.files:
            (<PinFile>f).unmap()
        self.files = []
        self.L.ctl = NULL

    cdef void _drop_broken(self) except *:
        """Some access faulted: unmap and forget every pin file that is no longer whole."""
        cdef PinFile f
        for f in list(self.files):
            if f.p != NULL and g_probe(f.p, f.size) != 0:
                f.broken = True
                self.broken.append(f)
                self.remove(f)

    # ---- resident map / eviction ----------------------------------------------------------
    cpdef void publish(self, uint32_t key, uint32_t slot):
        """``resmap[key] = slot + 1``: the expert is resident (its load completed)."""
        if self.L.ctl != NULL and key < self.L.n_keys:
            mcshm_publish(&self.L, key, slot)

    cpdef bint try_evict(self, uint32_t key, uint32_t cls, uint32_t slot):
        """Take ``key`` out of ``slot`` of class ``cls`` unless an honoured pin holds it.

        True: the map is cleared and the generation moved (the slot may be refilled). False:
        a pin holds it (nothing changed); the slot is recorded as honoured for each file that
        pins it. A file already honouring ``quota`` other slots is not asked (its pins there
        are ignored and counted); slots it released since the last sweep are not counted
        (forgotten first), so a client within its quota is always asked."""
        cdef uint32_t n, gslot = self.L.slot_base[cls] + slot
        cdef PinFile f
        cdef int r
        if self.L.ctl == NULL:
            return False
        while True:
            n = 0
            r = 0
            for f in self.files:
                if f.p == NULL:
                    continue
                if gslot not in f.honoured and len(f.honoured) >= f.quota:
                    r = self._forget_released(f)
                    if r < 0:
                        break
                if gslot in f.honoured or len(f.honoured) < f.quota:
                    self.ptrs[n] = f.p
                    n += 1
                elif g_pinned(&self.L, f.p, gslot) == 1:
                    f.ignored += 1
            if r >= 0:
                r = g_try_evict(&self.L, self.ptrs, n, key, cls, slot)
                if r >= 0:
                    break
            self._drop_broken()
        if r:
            return True
        for f in self.files:
            if f.p != NULL and (gslot in f.honoured or len(f.honoured) < f.quota) and \
                    g_pinned(&self.L, f.p, gslot) == 1:
                f.honoured.add(gslot)
        self.evictions_held += 1
        return False

    cdef int _forget_released(self, PinFile f) except -2:
        """Drop from ``f.honoured`` the slots ``f`` pins no more (released since the last
        sweep): they may not fill its quota. -1 on a fault (the caller drops broken files)."""
        cdef uint32_t g
        cdef int r
        keep = set()
        for g in f.honoured:
            r = g_pinned(&self.L, f.p, g)
            if r < 0:
                return -1
            if r:
                keep.add(g)
        f.honoured = keep
        return 0

    cpdef uint32_t global_slot(self, uint32_t cls, uint32_t slot):
        return self.L.slot_base[cls] + slot

    def pinned_now(self) -> int:
        """Slots pinned now, summed over the open pin files, honoured or not (a removal of the
        model waits for them). One pass over every slot of every file: for periodic checks."""
        cdef PinFile f
        cdef long r, n = 0
        if self.L.ctl == NULL:
            return 0
        for f in list(self.files):
            if f.p == NULL:
                continue
            r = g_count_pinned(&self.L, f.p, self.n_slots_total)
            if r < 0:
                self._drop_broken()
                continue
            n += r
        return n

    def sweep(self) -> set:
        """Forget honoured slots whose pin count went back to 0; returns the global slots some
        file still holds (an honoured pin)."""
        cdef PinFile f
        cdef uint32_t g
        cdef int r
        held = set()
        for f in list(self.files):
            if f.p == NULL or not f.honoured:
                continue
            keep = set()
            for g in f.honoured:
                r = g_pinned(&self.L, f.p, g)
                if r < 0:
                    self._drop_broken()
                    break
                if r:
                    keep.add(g)
            else:
                f.honoured = keep
                held |= keep
        return held

    # ---- hit rings ------------------------------------------------------------------------
    cpdef bint pending(self):
        """True when some ring holds entries not drained yet, or an implausible head."""
        cdef PinFile f
        if self.L.ctl == NULL:
            return False
        for f in self.files:
            if f.p != NULL and g_count(&self.L, f.p, 0) != 0:
                return True   # entries, or a fault (the drain then finds the broken file)
        return False

    cdef list _share(self, double now):
        """The files with entries (in an order rotated each drain), each with ``allow`` (what its uid's budget, refilled,
        lets it keep: what the files before it left), each budget with ``grant`` (what it may
        apply now: what its files want of it, budgets sharing ``DRAIN_MAX`` evenly)."""
        cdef PinFile f
        cdef HitBudget b
        cdef long n, room = DRAIN_MAX, k
        cdef double rate = self.hit_rate
        cdef list parts = [], budgets = []
        self.seq += 1
        fl = list(self.files)   # rotated each drain: no file of a uid always first in its budget
        for f in (fl[self.seq % len(fl):] + fl[:self.seq % len(fl)]) if fl else fl:
            if f.p == NULL:
                continue
            n = g_count(&self.L, f.p, 1)
            if n == -1:
                self._drop_broken()
            elif n == -2:
                f.resets += 1
                self.resets += 1
            if n <= 0:
                continue
            b = f.budget
            if b.seq != self.seq:
                b.seq, b.want = self.seq, 0
                if rate > 0:
                    b.tokens = min(b.tokens + rate * (now - b.t_last), <double> RING_N)
                    b.left = <long> b.tokens
                else:
                    b.tokens = RING_N    # no limit: a rate set later starts with a full burst
                    b.left = RING_N * len(self.files)
                b.t_last = now
                budgets.append(b)
            f.allow = b.left
            b.left -= min(n, b.left)
            b.want += min(n, f.allow)
            parts.append(f)
        budgets.sort(key=lambda x: (<HitBudget> x).want)   # the smaller wants first
        k = len(budgets)
        for b in budgets:
            b.grant = min(b.want, room // k)
            room -= b.grant
            k -= 1
        return parts

    def drain(self, log=None):
        """Apply the rings' new entries, merged by time over all files (a file's entries in
        ring order; a heap), to the pools of :meth:`set_targets` as a socket hit counts: touch
        the key, count a prefetch hit (clearing ``unused``) or a hit, per file and per layer.
        Entries naming a key out of range or not resident are dropped (counted per file); a
        ring with an implausible head is reset (counted); entries over their uid's budget are
        skipped unread (the oldest; counted per file and budget); past ``DRAIN_MAX`` in all,
        the newest wait in their rings. ``log``: a list to append ``(file, t, layer, expert)``
        to per entry applied, or None. None when no ring held anything, else ``(applied, hits,
        prefetch_hits)``, the last two ``{layer: count}``."""
        cdef PinFile f
        cdef HitBudget b
        cdef long got, m, e, k, r, i, top, applied = 0, n = 0, off = 0, nf
        cdef long *p_end, *p_pos, *heap
        cdef uint64_t k1, t, skipped, nk = self.L.n_keys, ne = self.L.n_experts
        cdef bint broken = False
        cdef char *unused
        cdef list taken = [], parts
        if self.L.ctl == NULL or self.n_moe == 0:
            return None
        parts = self._share(_now())
        # per file taken: its next entry and its end in kbuf/tbuf; the merge's heap (self.mrg:
        # no _refresh until the merge is done, broken files are dropped after it)
        nf = len(self.files) + 1
        p_pos, p_end, heap = self.mrg, self.mrg + nf, self.mrg + 2 * nf
        for f in parts:
            if f.p == NULL:
                continue
            b = f.budget
            got = g_drain(&self.L, f.p, self.kbuf + off, self.tbuf + off, f.allow,
                          min(f.allow, b.grant), &skipped)
            if got == -1:
                broken = True
                continue
            if got == -2:
                f.resets += 1
                self.resets += 1
                continue
            if skipped:
                f.skipped += <long> skipped
                b.skipped += <long> skipped
                b.skip_rate = self.hit_rate
            b.grant -= got
            if self.hit_rate > 0:
                b.tokens -= got
            if got > 0:
                p_pos[n], p_end[n], heap[n] = off, off + got, n
                taken.append(f)
                n += 1
                off += got
        for i in range(n // 2 - 1, -1, -1):
            g_sift(heap, n, i, self.tbuf, p_pos)
        while n > 0:
            # the next entry: the earliest head over the files (ties: the earlier file); a
            # file's entries in ring order (one client's times only grow)
            top = heap[0]
            f = <PinFile> taken[top]
            i = p_pos[top]
            k1, t = self.kbuf[i], self.tbuf[i]
            p_pos[top] = i + 1
            if i + 1 == p_end[top]:
                n -= 1
                heap[0] = heap[n]
            g_sift(heap, n, 0, self.tbuf, p_pos)
            if k1 == 0 or k1 > nk:
                f.drops += 1
                continue
            m = (k1 - 1) // ne
            e = (k1 - 1) % ne
            k = self.t_base[m] + e
            r = (<list> self.t_res[m])[k]
            if r < 0:
                f.drops += 1
                continue
            if log is not None:
                log.append((f, t, self.t_layer[m], e))
            self.t_touch[m](k)
            unused = <bytearray> self.t_unused[m]
            if unused[k]:
                unused[k] = 0
                self.c_pf[m] += 1
                f.prefetch_hits += 1
            else:
                self.c_hits[m] += 1
                f.hits += 1
            applied += 1
        if broken:
            self._drop_broken()
        if off == 0:
            return None
        hits, pf = {}, {}
        for m in range(self.n_moe):
            if self.c_hits[m]:
                hits[self.t_layer[m]] = self.c_hits[m]
                self.c_hits[m] = 0
            if self.c_pf[m]:
                pf[self.t_layer[m]] = self.c_pf[m]
                self.c_pf[m] = 0
        return applied, hits, pf
