/* moecache_shm.h -- the shared-memory hit path of moecached, written once.
 *
 * The daemon's Cython side, the Python client's Cython side and the C client all include this
 * header (header-only: C11 atomics, no other dependency), so the delicate part -- who may
 * write what, and in which order -- exists exactly once. docs/protocol.md, "Shared-memory hit
 * path", describes the same layout for implementers in other languages.
 *
 * Two shared files:
 *
 *   The ARENA (daemon writes, clients map read-only). Its control block at offset 0:
 *     word 0  magic "MOECTL01"        word 3  n_classes
 *     word 1  epoch (= session; 0: void) word 4  n_keys (moe layers x experts)
 *     word 2  state (1 serving)        word 5  byte offset of the resident map
 *     word 6  releases: moves before the daemon gives pages of the arena back (holes punched in
 *             free slots): a registration of the arena's pages (e.g. with a GPU) made before
 *             it may keep pages the file no longer has; register again
 *     generations: one u64 per slot, class by class (descriptor: class gen_off)
 *     resident map: one u64 per key (key = moe layer index * n_experts + expert):
 *                   0 = not resident (absent or loading), else slot + 1
 *
 *   A PIN FILE per fast-path client (the daemon creates it; that client maps it read-write,
 *   the daemon reads it as untrusted input):
 *     word 0  magic "MOEPIN01"         word 4  byte offset of the pin counts
 *     word 1  epoch (session)          word 5  byte offset of the hit ring
 *     word 2  n_slots (all classes)    word 6  pin quota (slots the daemon honours)
 *     word 3  ring entries (2^k)
 *     word 8  ring head (client writes: entries published)      -- own cache line
 *     word 16 ring tail (daemon writes: entries consumed)       -- own cache line
 *     pin counts: one u32 per global slot (class slot base + slot)
 *     hit ring: entries of two u64: key + 1, CLOCK_MONOTONIC ns
 *
 * Rules (the proofs are in docs/protocol.md):
 *   - a client pins a resident expert by: load resident map (slot) and generation, increment
 *     its pin count, full fence, load both again; any change -> undo, fall back to the socket.
 *   - the daemon evicts key k from slot s by: pins(s) == 0, resident map[k] = 0, full fence,
 *     pins(s) again; non-zero -> republish, not evicted; else generation[s] += 1, then reuse.
 *     (Dekker: either the client sees the cleared map or the daemon sees the pin.)
 *   - the daemon honours a pin file's pins on at most `quota` (word 6) slots and may reuse the
 *     others: a client whose live pins would then name more experts than that uses the socket.
 *   - a hit taken without a message goes into the client's ring; the daemon applies the ring
 *     to its LRU, in timestamp order over all clients, before it serves any request and before
 *     it picks a victim, so its eviction order is the one the socket path would produce.
 *   - a lease (fast or socket) is valid while epoch == its session and every generation is
 *     the one it was granted: a seqlock, checked after the bytes are used.
 */
#ifndef MOECACHE_SHM_H
#define MOECACHE_SHM_H

/* C11 only (C++ code uses the public API of moecache.h, which hides this header). */
#if !defined(_POSIX_C_SOURCE) && !defined(_GNU_SOURCE) && !defined(_DEFAULT_SOURCE)
#define _POSIX_C_SOURCE 200809L   /* clock_gettime(CLOCK_MONOTONIC) */
#endif
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define MCSHM_CTL_MAGIC   0x31304c5443454f4dULL /* "MOECTL01" read as a little-endian u64 */
#define MCSHM_PIN_MAGIC   0x31304e4950454f4dULL /* "MOEPIN01" */
#define MCSHM_MAX_CLASSES 32

/* control block words */
enum { MCSHM_CTL_W_MAGIC = 0, MCSHM_CTL_W_EPOCH = 1, MCSHM_CTL_W_STATE = 2,
       MCSHM_CTL_W_NCLASSES = 3, MCSHM_CTL_W_NKEYS = 4, MCSHM_CTL_W_RESMAP_OFF = 5,
       MCSHM_CTL_W_RELEASES = 6, MCSHM_CTL_HEADER_BYTES = 64 };
enum { MCSHM_STATE_STOPPED = 0, MCSHM_STATE_SERVING = 1, MCSHM_STATE_MODEL_CHANGED = 2 };

/* pin file words */
enum { MCSHM_PIN_W_MAGIC = 0, MCSHM_PIN_W_EPOCH = 1, MCSHM_PIN_W_NSLOTS = 2, MCSHM_PIN_W_RING_N = 3,
       MCSHM_PIN_W_PINS_OFF = 4, MCSHM_PIN_W_RING_OFF = 5, MCSHM_PIN_W_QUOTA = 6,
       MCSHM_PIN_W_HEAD = 8, MCSHM_PIN_W_TAIL = 16, MCSHM_PIN_HEADER_BYTES = 192 };

/* results */
enum { MCSHM_OK = 0, MCSHM_MISS = 1, MCSHM_STALE = 2, MCSHM_RING_FULL = 3, MCSHM_BAD = 4 };

typedef _Atomic uint64_t mcshm_u64;
typedef _Atomic uint32_t mcshm_u32;

/* Where things are, for one process's view of one daemon session. Filled once after hello
 * (mcshm_layout_init) from the arena descriptor and the pin file header. */
typedef struct mcshm_layout {
    mcshm_u64 *ctl;            /* control block (arena offset 0); read-only mapping on clients */
    mcshm_u64 *pin;            /* pin file (clients: the own one; NULL when none) */
    uint64_t session;
    uint32_t n_experts;
    uint32_t n_keys;
    uint32_t n_classes;
    uint32_t ring_n;           /* power of two */
    const uint32_t *key_class; /* moe layer index -> class id; caller-owned array */
    uint64_t gen_word[MCSHM_MAX_CLASSES];   /* ctl word index of each class's generations */
    uint32_t slot_base[MCSHM_MAX_CLASSES];  /* global slot of each class's slot 0 */
    uint32_t n_slots[MCSHM_MAX_CLASSES];
    uint64_t resmap_word;      /* ctl word index of the resident map */
    uint64_t pins_word32;      /* pin file u32 index of the pin counts */
    uint64_t ring_word;        /* pin file word index of the ring */
} mcshm_layout;

/* One granted expert: where it is and the generation it was granted at. */
typedef struct mcshm_item {
    uint32_t cls;
    uint32_t slot;
    uint64_t gen;
} mcshm_item;

static inline uint64_t mcshm_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t mcshm_epoch(const mcshm_layout *m) {
    return atomic_load_explicit(&m->ctl[MCSHM_CTL_W_EPOCH], memory_order_acquire);
}

static inline mcshm_u64 *mcshm_gen_ptr(const mcshm_layout *m, uint32_t cls, uint32_t slot) {
    return &m->ctl[m->gen_word[cls] + slot];
}

static inline mcshm_u64 *mcshm_res_ptr(const mcshm_layout *m, uint32_t key) {
    return &m->ctl[m->resmap_word + key];
}

static inline mcshm_u32 *mcshm_pins_ptr(const mcshm_layout *m, mcshm_u64 *pinfile, uint32_t gslot) {
    return (mcshm_u32 *)(void *)pinfile + m->pins_word32 + gslot;
}

/* ------------------------------------------------------------------ client side */

/* Is every item still the expert it was granted (epoch == session, generations unchanged)?
 * Call after using the bytes: true means what was read was right. Works for socket leases too
 * (their items come with the generations of the reply's `gens`). */
static inline int mcshm_valid(const mcshm_layout *m, uint64_t session, const mcshm_item *it, uint32_t n) {
    atomic_thread_fence(memory_order_acquire);   /* the bytes were read before these loads */
    for (uint32_t i = 0; i < n; i++) {
        if (it[i].cls >= m->n_classes || it[i].slot >= m->n_slots[it[i].cls])
            return 0;
        if (atomic_load_explicit(mcshm_gen_ptr(m, it[i].cls, it[i].slot), memory_order_acquire) != it[i].gen)
            return 0;
    }
    return mcshm_epoch(m) == session;
}

static inline void mcshm_unpin(const mcshm_layout *m, const mcshm_item *it, uint32_t n) {
    for (uint32_t i = 0; i < n; i++)
        atomic_fetch_sub_explicit(mcshm_pins_ptr(m, m->pin, m->slot_base[it[i].cls] + it[i].slot), 1,
                                  memory_order_release);
}

/* One hit ring entry per key at head.. (room checked by the caller), then head published. */
static inline void mcshm_ring_put(const mcshm_layout *m, mcshm_u64 *pf, uint64_t head, const uint32_t *keys, uint32_t n) {
    uint64_t now = mcshm_now_ns();
    mcshm_u64 *ring = &pf[m->ring_word];
    for (uint32_t j = 0; j < n; j++) {
        uint64_t e = (head + j) & (m->ring_n - 1);
        atomic_store_explicit(&ring[2 * e], (uint64_t)keys[j] + 1, memory_order_relaxed);
        atomic_store_explicit(&ring[2 * e + 1], now, memory_order_relaxed);
    }
    atomic_store_explicit(&pf[MCSHM_PIN_W_HEAD], head + n, memory_order_release);
}

/* Pin the experts `keys[0..n)` (all resident) without a message: all or nothing.
 * Fills out[i] and appends one hit per key to the ring. Returns MCSHM_OK; MCSHM_MISS when
 * some key is not resident (nothing pinned: send the request over the socket);
 * MCSHM_STALE when the arena's epoch is not m->session (say hello again); MCSHM_RING_FULL
 * when the ring has no room for n entries (nothing pinned: use the socket, which drains it);
 * MCSHM_BAD for a key out of range.
 * The ring has one producer: callers that share a pin file between threads serialise calls
 * to mcshm_pin (the pin counts themselves are atomic; mcshm_unpin needs no lock). */
static inline int mcshm_pin(const mcshm_layout *m, const uint32_t *keys, uint32_t n, mcshm_item *out) {
    mcshm_u64 *pf = m->pin;
    if (pf == NULL)
        return MCSHM_MISS;
    if (mcshm_epoch(m) != m->session ||
        atomic_load_explicit(&m->ctl[MCSHM_CTL_W_STATE], memory_order_relaxed) != MCSHM_STATE_SERVING)
        return MCSHM_STALE;
    uint64_t head = atomic_load_explicit(&pf[MCSHM_PIN_W_HEAD], memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&pf[MCSHM_PIN_W_TAIL], memory_order_acquire);
    if (head - tail + n > m->ring_n)
        return MCSHM_RING_FULL;
    uint32_t i;
    for (i = 0; i < n; i++) {
        uint32_t key = keys[i];
        if (key >= m->n_keys)
            goto bad;
        uint64_t r = atomic_load_explicit(mcshm_res_ptr(m, key), memory_order_acquire);
        uint32_t cls = m->key_class[key / m->n_experts];
        if (r == 0 || cls >= m->n_classes || r - 1 >= m->n_slots[cls])
            goto miss;
        out[i].cls = cls;
        out[i].slot = (uint32_t)(r - 1);
        out[i].gen = atomic_load_explicit(mcshm_gen_ptr(m, cls, out[i].slot), memory_order_acquire);
        atomic_fetch_add_explicit(mcshm_pins_ptr(m, pf, m->slot_base[cls] + out[i].slot), 1,
                                  memory_order_relaxed);
    }
    atomic_thread_fence(memory_order_seq_cst);   /* pins visible before the map is re-read */
    for (uint32_t j = 0; j < n; j++) {
        if (atomic_load_explicit(mcshm_res_ptr(m, keys[j]), memory_order_acquire) != (uint64_t)out[j].slot + 1 ||
            atomic_load_explicit(mcshm_gen_ptr(m, out[j].cls, out[j].slot), memory_order_acquire) != out[j].gen) {
            mcshm_unpin(m, out, n);
            return MCSHM_MISS;
        }
    }
    if (mcshm_epoch(m) != m->session) {
        mcshm_unpin(m, out, n);
        return MCSHM_STALE;
    }
    mcshm_ring_put(m, pf, head, keys, n);
    return MCSHM_OK;
miss:
    mcshm_unpin(m, out, i);
    return MCSHM_MISS;
bad:
    mcshm_unpin(m, out, i);
    return MCSHM_BAD;
}

/* Where the experts keys[0..n) lie now, without a pin (an optimistic read, for a reader that
 * cannot hold a lease while it reads, e.g. a GPU kernel): out[i] gets the class, slot and
 * generation of keys[i], or slot = UINT32_MAX when it is not resident (or the key is out of
 * range). Nothing stops the daemon from evicting a peeked expert: the reader checks mcshm_valid
 * on the items it used after reading, the same seqlock as a lease's. The map is read again
 * after the generation: a slot whose expert left and came back between the two reads is the
 * expert's only if the map still names it. Returns the number found (0 when the epoch is not
 * m->session). Writes nothing. */
static inline uint32_t mcshm_peek(const mcshm_layout *m, const uint32_t *keys, uint32_t n, mcshm_item *out) {
    uint32_t found = 0;
    for (uint32_t i = 0; i < n; i++) {
        out[i].cls = 0;
        out[i].slot = UINT32_MAX;
        out[i].gen = 0;
    }
    if (mcshm_epoch(m) != m->session ||
        atomic_load_explicit(&m->ctl[MCSHM_CTL_W_STATE], memory_order_relaxed) != MCSHM_STATE_SERVING)
        return 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t key = keys[i];
        if (key >= m->n_keys)
            continue;
        uint64_t r = atomic_load_explicit(mcshm_res_ptr(m, key), memory_order_acquire);
        uint32_t cls = m->key_class[key / m->n_experts];
        if (r == 0 || cls >= m->n_classes || r - 1 >= m->n_slots[cls])
            continue;
        uint64_t gen = atomic_load_explicit(mcshm_gen_ptr(m, cls, (uint32_t)(r - 1)), memory_order_acquire);
        atomic_thread_fence(memory_order_seq_cst);
        if (atomic_load_explicit(mcshm_res_ptr(m, key), memory_order_acquire) != r)
            continue;
        out[i].cls = cls;
        out[i].slot = (uint32_t)(r - 1);
        out[i].gen = gen;
        found++;
    }
    if (mcshm_epoch(m) != m->session) {   /* a restart meanwhile: nothing found */
        for (uint32_t i = 0; i < n; i++)
            out[i].slot = UINT32_MAX;
        return 0;
    }
    return found;
}

/* Tell the daemon's LRU about uses of keys[0..n) without pinning them: one hit ring entry each,
 * as a pin writes (the daemon drops entries for keys that are not resident). False (nothing
 * written) without a pin file or when the ring has no room for n entries. One producer, as for
 * mcshm_pin. */
static inline int mcshm_note_hits(const mcshm_layout *m, const uint32_t *keys, uint32_t n) {
    mcshm_u64 *pf = m->pin;
    if (pf == NULL || n == 0)
        return 0;
    uint64_t head = atomic_load_explicit(&pf[MCSHM_PIN_W_HEAD], memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&pf[MCSHM_PIN_W_TAIL], memory_order_acquire);
    if (head - tail + n > m->ring_n)
        return 0;
    mcshm_ring_put(m, pf, head, keys, n);
    return 1;
}

/* ------------------------------------------------------------------ daemon side */

static inline void mcshm_publish(const mcshm_layout *m, uint32_t key, uint32_t slot) {
    atomic_store_explicit(mcshm_res_ptr(m, key), (uint64_t)slot + 1, memory_order_release);
}

static inline void mcshm_unpublish(const mcshm_layout *m, uint32_t key) {
    atomic_store_explicit(mcshm_res_ptr(m, key), 0, memory_order_release);
}

/* The expert leaves the slot: every lease granted on it reads as invalid from now on. */
static inline void mcshm_bump(const mcshm_layout *m, uint32_t cls, uint32_t slot) {
    mcshm_u64 *g = mcshm_gen_ptr(m, cls, slot);
    atomic_store_explicit(g, atomic_load_explicit(g, memory_order_relaxed) + 1, memory_order_release);
    atomic_thread_fence(memory_order_seq_cst);   /* before any byte of the slot is rewritten */
}

/* Pins of global slot `gslot` over the pin files `pins[0..n)` (NULL entries skipped). A count
 * is untrusted: it is clamped to 1 per file (a pin is a pin), so the sum is the number of
 * clients that hold it. */
static inline uint32_t mcshm_pinned_by(const mcshm_layout *m, mcshm_u64 *const *pins, uint32_t n,
                                       uint32_t gslot) {
    uint32_t c = 0;
    for (uint32_t i = 0; i < n; i++)
        if (pins[i] != NULL && atomic_load_explicit(mcshm_pins_ptr(m, pins[i], gslot), memory_order_acquire) != 0)
            c++;
    return c;
}

/* Take `key` out of `slot` (class `cls`) unless a fast-path pin holds it. Returns 1 when
 * evicted (the map is cleared and the generation moved: the slot may be refilled), 0 when a
 * pin holds it (nothing changed). `pins` are the pin files whose pins the daemon honours. */
static inline int mcshm_try_evict(const mcshm_layout *m, mcshm_u64 *const *pins, uint32_t n,
                                  uint32_t key, uint32_t cls, uint32_t slot) {
    uint32_t gslot = m->slot_base[cls] + slot;
    if (mcshm_pinned_by(m, pins, n, gslot))
        return 0;
    mcshm_unpublish(m, key);
    atomic_thread_fence(memory_order_seq_cst);   /* cleared map visible before pins are read */
    if (mcshm_pinned_by(m, pins, n, gslot)) {
        mcshm_publish(m, key, slot);             /* a pin came in meanwhile: it wins */
        return 0;
    }
    mcshm_bump(m, cls, slot);
    return 1;
}

/* Hits published in a pin file's ring and not consumed yet: copies up to `max` of them into
 * keys/ts (key + 1 as written; 0 or out-of-range values are the caller's to ignore) and marks
 * them consumed. A head that is not plausible (past the ring size) counts as nothing; the
 * caller may then reset the ring (mcshm_ring_reset). Returns the number copied. */
static inline uint32_t mcshm_drain(const mcshm_layout *m, mcshm_u64 *pf, uint64_t *keys, uint64_t *ts,
                                   uint32_t max) {
    uint64_t tail = atomic_load_explicit(&pf[MCSHM_PIN_W_TAIL], memory_order_relaxed);
    uint64_t head = atomic_load_explicit(&pf[MCSHM_PIN_W_HEAD], memory_order_acquire);
    uint64_t avail = head - tail;
    if (avail == 0 || avail > m->ring_n)
        return 0;
    if (avail > max)
        avail = max;
    mcshm_u64 *ring = &pf[m->ring_word];
    for (uint64_t j = 0; j < avail; j++) {
        uint64_t e = (tail + j) & (m->ring_n - 1);
        keys[j] = atomic_load_explicit(&ring[2 * e], memory_order_relaxed);
        ts[j] = atomic_load_explicit(&ring[2 * e + 1], memory_order_relaxed);
    }
    atomic_store_explicit(&pf[MCSHM_PIN_W_TAIL], tail + avail, memory_order_release);
    return (uint32_t)avail;
}

/* Unconsumed ring entries (0 when the head is not plausible). */
static inline uint64_t mcshm_ring_pending(const mcshm_layout *m, mcshm_u64 *pf) {
    uint64_t d = atomic_load_explicit(&pf[MCSHM_PIN_W_HEAD], memory_order_acquire) -
                 atomic_load_explicit(&pf[MCSHM_PIN_W_TAIL], memory_order_relaxed);
    return d > m->ring_n ? 0 : d;
}

/* A client wrote a head that makes no sense: drop what is in the ring. */
static inline void mcshm_ring_reset(mcshm_u64 *pf) {
    atomic_store_explicit(&pf[MCSHM_PIN_W_TAIL], atomic_load_explicit(&pf[MCSHM_PIN_W_HEAD], memory_order_acquire),
                          memory_order_release);
}

#endif /* MOECACHE_SHM_H */
