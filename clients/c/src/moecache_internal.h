/* moecache_internal.h -- the library's private structures (the tests build fake arenas with
 * them; not installed). */
#ifndef MOECACHE_INTERNAL_H
#define MOECACHE_INTERNAL_H

#include "moecache_shm.h"   /* first: it selects the POSIX feature level it needs */
#include "moecache.h"
#include <stdatomic.h>

/* One hello's arena: the mappings, the layout, the public description. Reference counted:
 * `refs` keeps the metadata (the client's list + one per lease), `maprefs` keeps the mappings
 * (the client while it is current + one per lease). */
typedef struct mc_arena_map {
    _Atomic int refs;
    _Atomic int maprefs;
    _Atomic int voided;        /* the client saw its daemon go: every lease on it is invalid */
    _Atomic int closed;        /* the client was closed: releases send nothing */
    uint64_t session;
    void *base;
    size_t size;
    void *pin;
    size_t pin_size;
    int has_resmap;
    uint64_t pin_quota;        /* slots whose fast-path pins the daemon honours (0: no bound) */
    _Atomic uint64_t fast_items;   /* items of the live fast leases on this pin file */
    mcshm_layout lay;
    uint32_t *key_class;       /* moe layer index -> class */
    int32_t *layer_moe;        /* block -> moe layer index (-1) */
    int32_t *layer_cls;        /* block -> class (-1) */
    int32_t max_layer;
    uint32_t n_expert_layers;
    int32_t *expert_layers;
    uint32_t n_model_files;
    mc_file_id *model_files;
    mc_class *classes;
    mc_part *parts;
    int32_t *ints;
    char **strings;
    uint32_t n_strings;
    mc_arena pub;
    struct mc_arena_map *client_next;
} mc_arena_map;

struct mc_client;

struct mc_lease {
    struct mc_client *c;       /* socket leases: the client that sends the release */
    mc_arena_map *am;
    uint64_t session;
    uint64_t id;               /* the daemon's lease id (socket leases) */
    int fast;
    int released_remote;
    uint32_t n;
    mc_item *items;
    mcshm_item *mi;            /* (class, slot, generation) per item, for mcshm_valid/unpin */
    uint32_t hits, prefetch_hits, misses;
    uint64_t stall_us;
    uint32_t n_subst;
    int32_t *subst;            /* (layer, missing, substitute) per substitution */
};

void mc_arena_unref(mc_arena_map *am);
void mc_arena_unref_map(mc_arena_map *am);

/* The fast path on one arena (caller serialises calls per pin file): MCSHM_OK with *out a
 * new lease, else the mcshm_pin status (MCSHM_MISS also for a layer/expert out of range, and
 * when the live fast leases plus this one would hold more items than pin_quota: the daemon
 * ignores pins past its quota, so those go over the socket). */
int mc__pin_lease(mc_arena_map *am, const mc_request *reqs, uint32_t n, mc_lease **out);
/* mc_peek / mc_peek_valid / mc_note_hits on one arena map (the public ones take the client's
 * current map under its pin lock) */
uint32_t mc__peek(mc_arena_map *am, int layer, const int *experts, uint32_t n, mc_peek_item *out);
int mc__peek_valid(mc_arena_map *am, const mc_peek_item *it);
int mc__note_hits(mc_arena_map *am, int layer, const int *experts, uint32_t n);
uint64_t mc__arena_releases(mc_arena_map *am, uint64_t session);

#endif
