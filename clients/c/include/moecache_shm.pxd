# Cython declarations of moecache_shm.h, the one implementation of the shared-memory hit
# path's rules; cimported by the daemon (cython_ext/engine/_shm.pyx) and the Python client
# (clients/python/moecache_client/_shm.pyx). Both builds put this directory on Cython's
# include path and the C compiler's (setup.py, clients/python/setup.py).
from libc.stdint cimport uint32_t, uint64_t

cdef extern from "moecache_shm.h" nogil:
    ctypedef uint64_t mcshm_u64        # _Atomic in C; only ever passed through as a pointer here
    ctypedef struct mcshm_layout:
        mcshm_u64 *ctl
        mcshm_u64 *pin
        uint64_t session
        uint32_t n_experts
        uint32_t n_keys
        uint32_t n_classes
        uint32_t ring_n
        const uint32_t *key_class
        uint64_t gen_word[32]
        uint32_t slot_base[32]
        uint32_t n_slots[32]
        uint64_t resmap_word
        uint64_t pins_word32
        uint64_t ring_word
    ctypedef struct mcshm_item:
        uint32_t cls
        uint32_t slot
        uint64_t gen
    enum:
        MCSHM_MAX_CLASSES
        MCSHM_CTL_HEADER_BYTES
        MCSHM_PIN_HEADER_BYTES
        MCSHM_CTL_W_MAGIC
        MCSHM_CTL_W_EPOCH
        MCSHM_CTL_W_STATE
        MCSHM_CTL_W_NCLASSES
        MCSHM_CTL_W_NKEYS
        MCSHM_CTL_W_RESMAP_OFF
        MCSHM_CTL_W_RELEASES
        MCSHM_STATE_STOPPED
        MCSHM_STATE_SERVING
        MCSHM_STATE_MODEL_CHANGED
        MCSHM_PIN_W_MAGIC
        MCSHM_PIN_W_EPOCH
        MCSHM_PIN_W_NSLOTS
        MCSHM_PIN_W_RING_N
        MCSHM_PIN_W_PINS_OFF
        MCSHM_PIN_W_RING_OFF
        MCSHM_PIN_W_QUOTA
        MCSHM_PIN_W_HEAD
        MCSHM_PIN_W_TAIL
        MCSHM_OK
        MCSHM_MISS
        MCSHM_STALE
        MCSHM_RING_FULL
        MCSHM_BAD
    uint64_t MCSHM_PIN_MAGIC
    uint64_t MCSHM_CTL_MAGIC
    # the client's side
    int mcshm_pin(const mcshm_layout *m, const uint32_t *keys, uint32_t n, mcshm_item *out)
    void mcshm_unpin(const mcshm_layout *m, const mcshm_item *it, uint32_t n)
    int mcshm_valid(const mcshm_layout *m, uint64_t session, const mcshm_item *it, uint32_t n)
    uint64_t mcshm_epoch(const mcshm_layout *m)
    # the daemon's side
    void mcshm_publish(const mcshm_layout *m, uint32_t key, uint32_t slot)
    uint32_t mcshm_pinned_by(const mcshm_layout *m, mcshm_u64 **pins, uint32_t n, uint32_t gslot)
    int mcshm_try_evict(const mcshm_layout *m, mcshm_u64 **pins, uint32_t n, uint32_t key,
                        uint32_t cls, uint32_t slot)
    uint32_t mcshm_drain(const mcshm_layout *m, mcshm_u64 *pf, uint64_t *keys, uint64_t *ts, uint32_t max)
    uint64_t mcshm_ring_pending(const mcshm_layout *m, mcshm_u64 *pf)
    void mcshm_ring_reset(mcshm_u64 *pf)
