# cython: language_level=3
"""The shared-memory hit path of the Python client: a thin binding of moecache_shm.h.

The rules (who writes what, in which order) exist once, in clients/c/include/moecache_shm.h;
this module only fills its ``mcshm_layout`` from the hello reply and calls ``mcshm_pin``,
``mcshm_unpin`` and ``mcshm_valid``. Without this module the client works over the socket only.
"""
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE
from cpython.number cimport PyNumber_Index
from cpython.pythread cimport (PyThread_type_lock, PyThread_allocate_lock, PyThread_free_lock,
                               PyThread_acquire_lock, PyThread_release_lock, WAIT_LOCK)
from libc.stdint cimport uint32_t, uint64_t, int64_t
from libc.stdlib cimport malloc, free, qsort
from libc.string cimport memcpy, memcmp

from moecache_shm cimport (MCSHM_BAD, MCSHM_CTL_HEADER_BYTES, MCSHM_MAX_CLASSES, MCSHM_MISS, MCSHM_OK,
                           MCSHM_PIN_HEADER_BYTES, MCSHM_PIN_MAGIC, MCSHM_RING_FULL, MCSHM_STALE,
                           mcshm_epoch, mcshm_item, mcshm_layout, mcshm_pin, mcshm_u64, mcshm_unpin,
                           mcshm_valid)

OK = MCSHM_OK
MISS = MCSHM_MISS
STALE = MCSHM_STALE
RING_FULL = MCSHM_RING_FULL
BAD = MCSHM_BAD

DEF STACK_KEYS = 256


cdef int _cmp_u32(const void *a, const void *b) noexcept nogil:
    cdef uint32_t x = (<const uint32_t *>a)[0], y = (<const uint32_t *>b)[0]
    return (x > y) - (x < y)


cdef class Shm:
    """One session's view of the arena control block and (when the daemon gave one) the pin
    file. Holds both mappings exported (so neither is unmapped under a lease) until freed."""
    cdef mcshm_layout lay
    cdef Py_buffer arena_buf
    cdef Py_buffer pin_buf
    cdef bint have_arena, have_pin
    cdef uint32_t *key_class
    cdef dict moe          # GGUF layer -> moe layer index
    cdef PyThread_type_lock lock
    cdef readonly object session
    cdef public Py_ssize_t max_experts   # the daemon's max_request_experts (more: the socket says no)
    cdef readonly Py_ssize_t quota       # slots whose pins the daemon honours (0: no bound)
    cdef readonly Py_ssize_t held        # items of the live pins (released: Items.release)

    def __cinit__(self):
        self.have_arena = self.have_pin = False
        self.key_class = NULL
        self.max_experts = 1 << 20
        self.quota = self.held = 0
        self.lock = PyThread_allocate_lock()
        if self.lock == NULL:
            raise MemoryError()

    def __init__(self, arena_mm, dict desc, list expert_layers, int n_experts, session,
                 pin_mm=None, dict pins=None):
        """``arena_mm``: the read-only arena mapping; ``desc``: its descriptor (hello
        ``arena``); ``pin_mm``/``pins``: the read-write pin file mapping and hello ``pins``."""
        cdef int i, nc
        cdef uint32_t base = 0
        classes = desc["classes"]
        nc = len(classes)
        if nc > MCSHM_MAX_CLASSES:
            raise ValueError(f"arena descriptor: {nc} size classes, this client handles at most "
                             f"{MCSHM_MAX_CLASSES}; upgrade the client")
        PyObject_GetBuffer(arena_mm, &self.arena_buf, PyBUF_SIMPLE)
        self.have_arena = True
        ctl = desc["control"]
        ctl_bytes = int(ctl["bytes"])
        if int(ctl["off"]) != 0 or ctl_bytes < MCSHM_CTL_HEADER_BYTES or ctl_bytes > self.arena_buf.len:
            raise ValueError(f"arena descriptor: control block at {ctl['off']} ({ctl_bytes} bytes): "
                             "this client expects it at offset 0, inside the arena")
        self.session = session
        self.lay.ctl = <mcshm_u64 *>self.arena_buf.buf
        self.lay.pin = NULL
        self.lay.session = <uint64_t>session
        self.lay.n_experts = n_experts
        self.lay.n_classes = nc
        self.lay.ring_n = 0
        for i in range(nc):
            c = classes[i]
            ns, go = int(c["n_slots"]), int(c["gen_off"])
            if int(c["id"]) != i or ns < 0 or go < 0 or go % 8 or go + 8 * ns > ctl_bytes:
                raise ValueError(f"arena descriptor: class {i}: id must be {i} and n_slots/gen_off "
                                 "inside the control block")
            self.lay.gen_word[i] = go // 8
            self.lay.n_slots[i] = ns
            self.lay.slot_base[i] = base
            base += ns
        # keys: moe layer index (position in expert_layers) * n_experts + expert
        self.moe = {int(l): m for m, l in enumerate(expert_layers)}
        layer_class = desc.get("layer_class")
        if layer_class is None:
            layer_class = {str(l): c["id"] for c in classes for l in c["layers"]}
        self.key_class = <uint32_t *>malloc((len(expert_layers) + 1) * sizeof(uint32_t))
        if self.key_class == NULL:
            raise MemoryError()
        for m, l in enumerate(expert_layers):
            cid = layer_class.get(str(l))
            if cid is None or not 0 <= int(cid) < nc:
                raise ValueError(f"arena descriptor: expert layer {l} is in no size class")
            self.key_class[m] = int(cid)
        self.lay.key_class = self.key_class
        n_keys = len(expert_layers) * n_experts
        self.lay.n_keys = n_keys
        rmo, dnk = ctl.get("resmap_off"), ctl.get("n_keys")
        has_resmap = (dnk == n_keys and rmo is not None and rmo >= MCSHM_CTL_HEADER_BYTES and rmo % 8 == 0
                      and rmo + 8 * n_keys <= ctl_bytes)
        self.lay.resmap_word = rmo // 8 if has_resmap else 0
        if pin_mm is None or pins is None or not has_resmap:
            return
        psize, ring_n = int(pins["size"]), int(pins["ring_n"])
        pins_off, ring_off = int(pins["pins_off"]), int(pins["ring_off"])
        if (ring_n <= 0 or ring_n & (ring_n - 1) or pins_off < MCSHM_PIN_HEADER_BYTES or pins_off % 4
                or ring_off % 8 or pins_off + 4 * base > psize or ring_off + 16 * ring_n > psize
                or psize > len(pin_mm)):
            raise ValueError("hello reply: 'pins' descriptor incomplete or inconsistent "
                             f"(size {psize}, ring_n {ring_n}, pins_off {pins_off}, ring_off {ring_off})")
        PyObject_GetBuffer(pin_mm, &self.pin_buf, PyBUF_SIMPLE | PyBUF_WRITABLE)
        self.have_pin = True
        cdef const uint64_t *pw = <const uint64_t *>self.pin_buf.buf
        if pw[0] != MCSHM_PIN_MAGIC or pw[2] != base:
            raise ValueError(f"pin file {pins.get('path')}: bad magic or slot count "
                             f"({pw[2]} slots, the arena has {base})")
        self.lay.pin = <mcshm_u64 *>self.pin_buf.buf
        # the daemon honours pins on at most `quota` slots: more go over the socket
        self.quota = int(pins.get("quota") or 0) or <Py_ssize_t>pw[6]
        self.lay.ring_n = ring_n
        self.lay.pins_word32 = pins_off // 4
        self.lay.ring_word = ring_off // 8

    def __dealloc__(self):
        if self.have_pin:
            PyBuffer_Release(&self.pin_buf)
        if self.have_arena:
            PyBuffer_Release(&self.arena_buf)
        free(self.key_class)
        if self.lock != NULL:
            PyThread_free_lock(self.lock)

    @property
    def fast(self):
        """True when experts can be pinned without a message (a pin file is mapped)."""
        return self.lay.pin != NULL

    @property
    def address(self):
        """Base address of the arena mapping."""
        return <size_t>self.arena_buf.buf

    def epoch(self):
        return mcshm_epoch(&self.lay)

    def pin(self, layer, experts, groups=None):
        """Pin ``experts`` of ``layer`` -- or, with ``groups`` = [(layer, [expert, ...]), ...],
        every group's -- without a message. Returns :class:`Items` on success, else the
        mcshm result code: MISS also for anything the socket path must judge (a layer without
        experts, an expert out of range or not an integer, a repeated expert, more experts
        than ``max_experts``), so the socket gives the daemon's answer; and when the live pins
        and these would name more experts than ``quota`` (the daemon ignores pins past it:
        a lease on them could go invalid)."""
        cdef uint32_t stack_keys[STACK_KEYS]
        cdef uint32_t stack_sorted[STACK_KEYS]
        cdef uint32_t *keys = stack_keys
        cdef uint32_t *srt = stack_sorted
        cdef Py_ssize_t n = 0, j = 0, i
        cdef int64_t e
        cdef uint32_t m, ne = self.lay.n_experts
        cdef int rc
        cdef Items it
        if self.lay.pin == NULL:
            return MCSHM_MISS
        if groups is None:
            groups = ((layer, experts),)
        for g in groups:
            n += len(g[1])
        if n == 0 or n > self.max_experts:
            return MCSHM_MISS
        if n > STACK_KEYS:
            keys = <uint32_t *>malloc(2 * n * sizeof(uint32_t))
            if keys == NULL:
                raise MemoryError()
            srt = keys + n
        try:
            for g in groups:
                try:
                    lk = g[0] if type(g[0]) is int else PyNumber_Index(g[0])
                except TypeError:
                    return MCSHM_MISS
                mo = self.moe.get(lk)
                if mo is None:
                    return MCSHM_MISS
                m = mo
                for x in g[1]:
                    try:
                        e = x if type(x) is int else PyNumber_Index(x)   # no floats, as the socket path
                    except (OverflowError, TypeError):
                        return MCSHM_MISS
                    if e < 0 or e >= ne:
                        return MCSHM_MISS
                    keys[j] = m * ne + <uint32_t>e
                    j += 1
            if n <= 16:                       # a top-k set: compare pairs
                for j in range(1, n):
                    for i in range(j):
                        if keys[i] == keys[j]:
                            return MCSHM_MISS
            else:
                memcpy(srt, keys, n * sizeof(uint32_t))
                qsort(srt, n, sizeof(uint32_t), _cmp_u32)
                for j in range(1, n):
                    if srt[j] == srt[j - 1]:
                        return MCSHM_MISS
            it = Items.__new__(Items)
            it.alloc(self, n)
            PyThread_acquire_lock(self.lock, WAIT_LOCK)   # one ring producer per pin file
            if self.quota > 0 and self.held + n > self.quota:
                rc = MCSHM_MISS
            else:
                rc = mcshm_pin(&self.lay, keys, <uint32_t>n, it.items)
                if rc == MCSHM_OK:
                    self.held += n
            PyThread_release_lock(self.lock)
            if rc != MCSHM_OK:
                return rc
            it.pinned = True
            it.rows = []
            j = 0
            for g in groups:
                l = g[0] if type(g[0]) is int else PyNumber_Index(g[0])
                for i in range(len(g[1])):
                    it.rows.append([l, keys[j] % ne, it.items[j].cls, it.items[j].slot])
                    j += 1
            return it
        finally:
            if keys != stack_keys:
                free(keys)

    def items(self, list items, list gens):
        """:class:`Items` for a socket lease: ``items`` [[layer, expert, class, slot], ...] and
        the reply's ``gens`` (checked by :meth:`Items.valid`, never unpinned here)."""
        cdef Py_ssize_t i, n = len(items)
        cdef Items it = Items.__new__(Items)
        if len(gens) != n:
            raise ValueError(f"acquire reply: {n} items but {len(gens)} gens")
        it.alloc(self, n)
        for i in range(n):
            row = items[i]
            it.items[i].cls = row[2]
            it.items[i].slot = row[3]
            it.items[i].gen = gens[i]
        return it


cdef class Items:
    """The (class, slot, generation) of each expert of one lease."""
    cdef Shm shm
    cdef mcshm_item *items
    cdef uint32_t n
    cdef bint pinned      # taken by mcshm_pin: release() unpins
    cdef public list rows  # pinned: [[layer, expert, class, slot], ...] in request order

    def __dealloc__(self):
        free(self.items)

    cdef alloc(self, Shm shm, Py_ssize_t n):
        self.shm = shm
        self.n = <uint32_t>n
        self.items = <mcshm_item *>malloc((n if n > 0 else 1) * sizeof(mcshm_item))
        if self.items == NULL:
            raise MemoryError()

    def valid(self):
        """epoch == session and every generation as granted (mcshm_valid)."""
        return bool(mcshm_valid(&self.shm.lay, self.shm.lay.session, self.items, self.n))

    def release(self):
        """Unpin (a store per expert; idempotent). Nothing for a socket lease's items."""
        if self.pinned:
            self.pinned = False
            mcshm_unpin(&self.shm.lay, self.items, self.n)
            self.shm.held -= self.n

    def gens(self):
        return [self.items[j].gen for j in range(self.n)]
