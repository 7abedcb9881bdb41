/* Test helpers: CHECK macros and a fake arena (control block + slot bytes + pin file) built in
 * memory, laid out as a daemon lays them out (docs/protocol.md), driven with the daemon-side
 * functions of moecache_shm.h. */
#ifndef MC_TESTUTIL_H
#define MC_TESTUTIL_H
#include "moecache_internal.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_failures;
#define CHECK(cond, ...) do { if (!(cond)) { g_failures++; fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
    fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); } } while (0)
#define REQUIRE(cond, ...) do { if (!(cond)) { fprintf(stderr, "FATAL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
    fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); exit(1); } } while (0)

/* Fake model: blocks FA_L0 and FA_L1 have routed experts (moe layers 0 and 1), FA_E experts
 * each; class 0 (block FA_L0) has FA_S0 slots, class 1 (block FA_L1) FA_S1 slots; parts
 * "gate" (FA_GATE bytes) and "down" (FA_DOWN bytes). */
enum { FA_L0 = 1, FA_L1 = 3, FA_E = 8, FA_S0 = 4, FA_S1 = 3, FA_GATE = 256, FA_DOWN = 128,
       FA_CTL = 4096, FA_RING = 64 };

typedef struct fake_arena {
    mc_arena_map *am;
    uint64_t *mem;        /* control block + slot data (the "arena file") */
    size_t mem_bytes;
    uint64_t *pin;        /* the pin file */
    size_t pin_bytes;
    mcshm_u64 *pins[1];   /* the daemon's list of honoured pin files */
} fake_arena;

static const char *FA_PART_NAMES[2] = {"gate", "down"};

/* The expected 8-byte word w of part p of (moe layer m, expert e). */
static inline uint64_t fa_word(uint32_t m, uint32_t e, uint32_t p, uint64_t w) {
    return ((uint64_t)(m + 1) << 56) ^ ((uint64_t)(e + 1) << 44) ^ ((uint64_t)(p + 1) << 40) ^
           (w * 0x9E3779B97F4A7C15ull >> 24);
}

static fake_arena *fa_new(uint64_t session) {
    fake_arena *f = calloc(1, sizeof *f);
    mc_arena_map *am = calloc(1, sizeof *am);
    f->am = am;
    size_t slot_bytes = FA_GATE + FA_DOWN;
    f->mem_bytes = FA_CTL + slot_bytes * (FA_S0 + FA_S1);
    f->mem = aligned_alloc(64, f->mem_bytes);
    memset(f->mem, 0, f->mem_bytes);
    memcpy(f->mem, "MOECTL01", 8);
    f->mem[MCSHM_CTL_W_EPOCH] = session;
    f->mem[MCSHM_CTL_W_STATE] = MCSHM_STATE_SERVING;
    f->mem[MCSHM_CTL_W_NCLASSES] = 2;
    f->mem[MCSHM_CTL_W_NKEYS] = 2 * FA_E;
    uint64_t gen0 = 64, gen1 = gen0 + 8 * FA_S0, resmap = gen1 + 8 * FA_S1;
    f->mem[MCSHM_CTL_W_RESMAP_OFF] = resmap;
    for (int i = 0; i < FA_S0 + FA_S1; i++)   /* generations start anywhere */
        f->mem[(i < FA_S0 ? gen0 / 8 + i : gen1 / 8 + i - FA_S0)] = 1000 + 7 * i;

    size_t pins_off = MCSHM_PIN_HEADER_BYTES, ring_off = pins_off + 4 * 8;   /* 7 slots, padded */
    f->pin_bytes = ring_off + 16 * FA_RING;
    f->pin = aligned_alloc(64, (f->pin_bytes + 63) / 64 * 64);
    memset(f->pin, 0, f->pin_bytes);
    f->pin[MCSHM_PIN_W_MAGIC] = MCSHM_PIN_MAGIC;
    f->pin[MCSHM_PIN_W_EPOCH] = session;
    f->pin[MCSHM_PIN_W_NSLOTS] = FA_S0 + FA_S1;
    f->pin[MCSHM_PIN_W_RING_N] = FA_RING;
    f->pin[MCSHM_PIN_W_PINS_OFF] = pins_off;
    f->pin[MCSHM_PIN_W_RING_OFF] = ring_off;
    f->pin[MCSHM_PIN_W_QUOTA] = 64;
    f->pins[0] = (mcshm_u64 *)f->pin;

    atomic_init(&am->refs, 1);
    atomic_init(&am->maprefs, 1);
    atomic_init(&am->voided, 0);
    atomic_init(&am->closed, 0);
    am->session = session;
    am->base = NULL;      /* not an mmap: never unmapped (the map ref of "current" is kept) */
    am->size = f->mem_bytes;
    am->has_resmap = 1;
    am->max_layer = FA_L1;
    am->n_expert_layers = 2;
    am->expert_layers = calloc(2, sizeof(int32_t));
    am->expert_layers[0] = FA_L0;
    am->expert_layers[1] = FA_L1;
    am->layer_moe = malloc(sizeof(int32_t) * (FA_L1 + 1));
    am->layer_cls = malloc(sizeof(int32_t) * (FA_L1 + 1));
    for (int i = 0; i <= FA_L1; i++) am->layer_moe[i] = am->layer_cls[i] = -1;
    am->layer_moe[FA_L0] = 0; am->layer_cls[FA_L0] = 0;
    am->layer_moe[FA_L1] = 1; am->layer_cls[FA_L1] = 1;
    am->key_class = calloc(2, sizeof(uint32_t));
    am->key_class[0] = 0;
    am->key_class[1] = 1;
    am->classes = calloc(2, sizeof(mc_class));
    am->parts = calloc(4, sizeof(mc_part));
    am->ints = calloc(2, sizeof(int32_t));
    am->ints[0] = FA_L0;
    am->ints[1] = FA_L1;
    uint64_t off = FA_CTL;
    for (int c = 0; c < 2; c++) {
        uint32_t ns = c == 0 ? FA_S0 : FA_S1;
        mc_class *k = &am->classes[c];
        k->id = c; k->n_layers = 1; k->layers = &am->ints[c]; k->n_parts = 2; k->parts = &am->parts[2 * c];
        k->n_slots = ns; k->slot_bytes = slot_bytes;
        am->parts[2 * c] = (mc_part){"gate", off, FA_GATE, "Q4_K"};
        off += (uint64_t)FA_GATE * ns;
        am->parts[2 * c + 1] = (mc_part){"down", off, FA_DOWN, "Q6_K"};
        off += (uint64_t)FA_DOWN * ns;
    }
    am->strings = calloc(1, sizeof(char *));
    mcshm_layout *lay = &am->lay;
    lay->ctl = (mcshm_u64 *)f->mem;
    lay->pin = (mcshm_u64 *)f->pin;
    lay->session = session;
    lay->n_experts = FA_E;
    lay->n_keys = 2 * FA_E;
    lay->n_classes = 2;
    lay->ring_n = FA_RING;
    lay->key_class = am->key_class;
    lay->gen_word[0] = gen0 / 8; lay->gen_word[1] = gen1 / 8;
    lay->slot_base[0] = 0; lay->slot_base[1] = FA_S0;
    lay->n_slots[0] = FA_S0; lay->n_slots[1] = FA_S1;
    lay->resmap_word = resmap / 8;
    lay->pins_word32 = pins_off / 4;
    lay->ring_word = ring_off / 8;
    am->pub.base = f->mem;
    am->base = f->mem;
    return f;
}

/* The fake is not an mmap: drop the "current" map ref only after the base pointer is cleared. */
static void fa_free(fake_arena *f) {
    mc_arena_map *am = f->am;
    am->base = NULL;
    am->pin = NULL;
    free(am->key_class); free(am->layer_moe); free(am->layer_cls); free(am->classes);
    free(am->parts); free(am->ints); free(am->expert_layers); free(am->strings);
    free(am);
    free(f->mem);
    free(f->pin);
    free(f);
}

/* Daemon side: write the bytes of (moe layer m, expert e) into slot s of class m (relaxed
 * atomic word stores: readers may look at the slot concurrently, as in the seqlock). */
static void fa_fill(fake_arena *f, uint32_t m, uint32_t e, uint32_t slot) {
    const mc_class *k = &f->am->classes[m];
    for (uint32_t p = 0; p < 2; p++) {
        uint64_t *w = (uint64_t *)((char *)f->mem + k->parts[p].part_off + slot * k->parts[p].part_bytes);
        for (uint64_t i = 0; i < k->parts[p].part_bytes / 8; i++)
            __atomic_store_n(&w[i], fa_word(m, e, p, i), __ATOMIC_RELAXED);
    }
}

/* Daemon side: load (m, e) into slot and publish it. */
static void fa_load(fake_arena *f, uint32_t m, uint32_t e, uint32_t slot) {
    fa_fill(f, m, e, slot);
    mcshm_publish(&f->am->lay, m * FA_E + e, slot);
}

/* Compare the bytes at p (relaxed atomic loads) with (m, e, part); returns 1 when equal. */
static int fa_matches(const void *p, uint64_t bytes, uint32_t m, uint32_t e, uint32_t part) {
    const uint64_t *w = p;
    int ok = 1;
    for (uint64_t i = 0; i < bytes / 8; i++)
        if (__atomic_load_n(&w[i], __ATOMIC_RELAXED) != fa_word(m, e, part, i))
            ok = 0;
    return ok;
}

static uint32_t fa_pins(fake_arena *f, uint32_t cls, uint32_t slot) {
    return atomic_load(mcshm_pins_ptr(&f->am->lay, (mcshm_u64 *)f->pin, f->am->lay.slot_base[cls] + slot));
}
#endif
