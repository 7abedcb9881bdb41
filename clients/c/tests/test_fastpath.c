/* The shared-memory hit path through the library's lease objects, against a fake control block
 * and pin file built in memory (the daemon side driven with moecache_shm.h's own functions). */
#define _GNU_SOURCE
#include "testutil.h"

static const uint64_t SESSION = 0x1234567890abcdefull;

static mc_lease *pin(fake_arena *f, int layer, const int *ex, uint32_t n, int *status) {
    mc_request r = {layer, ex, n};
    mc_lease *l = NULL;
    *status = mc__pin_lease(f->am, &r, 1, &l);
    return l;
}

static uint64_t head(fake_arena *f) { return f->pin[MCSHM_PIN_W_HEAD]; }

static void test_hit_read_release(void) {
    fake_arena *f = fa_new(SESSION);
    fa_load(f, 0, 2, 1);
    fa_load(f, 0, 5, 3);
    int st, ex[] = {5, 2};
    mc_lease *l = pin(f, FA_L0, ex, 2, &st);
    REQUIRE(st == MCSHM_OK && l, "pin of two resident experts: status %d", st);
    CHECK(mc_lease_fast(l) == 1, "fast lease");
    CHECK(mc_lease_n(l) == 2, "2 items");
    const mc_item *it = mc_lease_items(l);
    CHECK(it[0].layer == FA_L0 && it[0].expert == 5 && it[0].cls == 0 && it[0].slot == 3, "item 0 in request order");
    CHECK(it[1].expert == 2 && it[1].slot == 1, "item 1");
    uint32_t slots[4];
    CHECK(mc_lease_slots(l, slots, 4) == 2 && slots[0] == 3 && slots[1] == 1, "slots in request order");
    CHECK(fa_pins(f, 0, 3) == 1 && fa_pins(f, 0, 1) == 1 && fa_pins(f, 0, 0) == 0, "pin counts taken");
    CHECK(head(f) == 2, "two ring entries published, head %llu", (unsigned long long)head(f));
    uint64_t *ring = f->pin + f->am->lay.ring_word;
    CHECK(ring[0] == 5 + 1 && ring[2] == 2 + 1 && ring[1] != 0, "ring entries: key+1 and a time");
    CHECK(mc_lease_valid(l) == 1, "valid");
    for (uint32_t i = 0; i < 2; i++)
        for (uint32_t p = 0; p < 2; p++) {
            uint64_t nb = 0;
            const void *b = mc_lease_part(l, i, FA_PART_NAMES[p], &nb);
            CHECK(b && nb == (p ? FA_DOWN : FA_GATE), "part view");
            CHECK(b && fa_matches(b, nb, 0, it[i].expert, p), "bytes of expert %d part %u", it[i].expert, p);
        }
    CHECK(mc_lease_part(l, 0, "up", NULL) == NULL, "unknown part -> NULL");
    CHECK(mc_lease_part(l, 2, "gate", NULL) == NULL, "index out of range -> NULL");
    /* the daemon may not evict a pinned expert */
    CHECK(mcshm_try_evict(&f->am->lay, f->pins, 1, 0 * FA_E + 5, 0, 3) == 0, "pinned slot not evicted");
    CHECK(mc_lease_valid(l) == 1, "still valid after a refused eviction");
    mc_release(l);
    CHECK(fa_pins(f, 0, 3) == 0 && fa_pins(f, 0, 1) == 0, "release drops the pins");
    CHECK(atomic_load(&f->am->refs) == 1 && atomic_load(&f->am->maprefs) == 1, "lease refs dropped");
    CHECK(mcshm_try_evict(&f->am->lay, f->pins, 1, 5, 0, 3) == 1, "released slot evictable");
    fa_free(f);
}

static void test_miss_and_range(void) {
    fake_arena *f = fa_new(SESSION);
    fa_load(f, 0, 2, 1);
    int st, ex[] = {2, 6};
    mc_lease *l = pin(f, FA_L0, ex, 2, &st);
    CHECK(st == MCSHM_MISS && l == NULL, "one expert not resident: miss (status %d)", st);
    CHECK(fa_pins(f, 0, 1) == 0, "no pin left behind by a miss");
    CHECK(head(f) == 0, "no ring entry for a miss");
    int bad[] = {FA_E};
    l = pin(f, FA_L0, bad, 1, &st);
    CHECK(st == MCSHM_MISS && !l, "expert out of range goes to the socket (status %d)", st);
    int one[] = {2};
    l = pin(f, 2, one, 1, &st);
    CHECK(st == MCSHM_MISS && !l, "layer without experts goes to the socket (status %d)", st);
    l = pin(f, 100, one, 1, &st);
    CHECK(st == MCSHM_MISS && !l, "layer past the model goes to the socket");
    fa_free(f);
}

static void test_revocation_detected(void) {
    fake_arena *f = fa_new(SESSION);
    fa_load(f, 0, 4, 2);
    int st, ex[] = {4};
    mc_lease *l = pin(f, FA_L0, ex, 1, &st);
    REQUIRE(st == MCSHM_OK, "pin");
    const void *b = mc_lease_part(l, 0, "gate", NULL);
    REQUIRE(b != NULL, "view");
    /* a daemon that does not honour this pin (quota exceeded) reuses the slot */
    mcshm_unpublish(&f->am->lay, 4);
    mcshm_bump(&f->am->lay, 0, 2);
    fa_load(f, 0, 7, 2);
    CHECK(!fa_matches(b, FA_GATE, 0, 4, 0), "the bytes under the lease changed");
    CHECK(mc_lease_valid(l) == 0, "the generation tells: invalid");
    CHECK(mc_lease_part(l, 0, "gate", NULL) == NULL, "no views of an invalid lease");
    mc_release(l);
    fa_free(f);
}

static void test_pins_stay_within_the_quota(void) {
    /* the daemon honours pins on at most `quota` slots of a pin file and reuses the others
     * (test_revocation_detected): the library pins no more than that, the rest goes over the
     * socket (MCSHM_MISS), so a lease through shared memory is never revoked for the quota */
    fake_arena *f = fa_new(SESSION);
    f->am->pin_quota = 3;
    for (uint32_t e = 0; e < 4; e++) fa_load(f, 0, e, e);
    int st, four[] = {0, 1, 2, 3}, two[] = {0, 1}, one[] = {2}, other[] = {3};
    mc_lease *l = pin(f, FA_L0, four, 4, &st);
    CHECK(st == MCSHM_MISS && !l, "4 experts, quota 3: socket (status %d)", st);
    CHECK(fa_pins(f, 0, 0) == 0 && head(f) == 0, "nothing pinned, no ring entry");
    mc_lease *a = pin(f, FA_L0, two, 2, &st);
    REQUIRE(st == MCSHM_OK && a, "2 of quota 3: pinned (status %d)", st);
    mc_lease *b = pin(f, FA_L0, one, 1, &st);
    REQUIRE(st == MCSHM_OK && b, "3 of quota 3: pinned (status %d)", st);
    l = pin(f, FA_L0, other, 1, &st);
    CHECK(st == MCSHM_MISS && !l, "a 4th slot past quota 3: socket (status %d)", st);
    CHECK(fa_pins(f, 0, 3) == 0, "no pin past the quota");
    mc_release(a);
    l = pin(f, FA_L0, other, 1, &st);
    CHECK(st == MCSHM_OK && l, "room again after a release (status %d)", st);
    CHECK(atomic_load(&f->am->fast_items) == 2, "2 items held");
    mc_release(l);
    mc_release(b);
    CHECK(atomic_load(&f->am->fast_items) == 0, "none held after the releases");
    fa_free(f);
}

static void test_epoch_state_void(void) {
    fake_arena *f = fa_new(SESSION);
    fa_load(f, 1, 0, 0);
    int st, ex[] = {0};
    mc_lease *l = pin(f, FA_L1, ex, 1, &st);
    REQUIRE(st == MCSHM_OK, "pin in class 1");
    CHECK(mc_lease_items(l)[0].cls == 1 && fa_pins(f, 1, 0) == 1, "class 1 slot base used");
    CHECK(mc_lease_valid(l), "valid");
    f->mem[MCSHM_CTL_W_STATE] = MCSHM_STATE_MODEL_CHANGED;
    mc_lease *l2 = pin(f, FA_L1, ex, 1, &st);
    CHECK(st == MCSHM_STALE && !l2, "state not serving -> stale");
    f->mem[MCSHM_CTL_W_STATE] = MCSHM_STATE_SERVING;
    atomic_store(&f->am->voided, 1);
    CHECK(mc_lease_valid(l) == 0, "voided by the client (daemon gone): invalid");
    atomic_store(&f->am->voided, 0);
    f->mem[MCSHM_CTL_W_EPOCH] = 0;   /* the daemon stopped */
    CHECK(mc_lease_valid(l) == 0, "epoch cleared: invalid");
    l2 = pin(f, FA_L1, ex, 1, &st);
    CHECK(st == MCSHM_STALE && !l2, "epoch cleared -> stale");
    CHECK(fa_pins(f, 1, 0) == 1, "stale pin attempts leave no pin");
    mc_release(l);
    CHECK(fa_pins(f, 1, 0) == 0, "release after a restart still unpins (harmless)");
    fa_free(f);
}

static void test_ring_full_and_multi(void) {
    fake_arena *f = fa_new(SESSION);
    for (uint32_t e = 0; e < FA_S0; e++) fa_load(f, 0, e, e);
    for (uint32_t e = 0; e < FA_S1; e++) fa_load(f, 1, e + 4, e);
    int ex0[] = {0, 1, 2}, ex1[] = {6, 4};
    mc_request r[2] = {{FA_L0, ex0, 3}, {FA_L1, ex1, 2}};
    mc_lease *l = NULL;
    int st = mc__pin_lease(f->am, r, 2, &l);
    REQUIRE(st == MCSHM_OK, "two layers in one pin: %d", st);
    const mc_item *it = mc_lease_items(l);
    CHECK(mc_lease_n(l) == 5 && it[3].layer == FA_L1 && it[3].expert == 6 && it[3].cls == 1 && it[3].slot == 2,
          "multi-layer items in request order");
    for (uint32_t i = 0; i < 5; i++) {
        uint64_t nb;
        const void *b = mc_lease_part(l, i, "down", &nb);
        CHECK(b && fa_matches(b, nb, it[i].cls, it[i].expert, 1), "bytes of item %u", i);
    }
    mc_release(l);
    /* fill the ring: head - tail + n > ring_n -> RING_FULL, nothing pinned */
    f->pin[MCSHM_PIN_W_HEAD] = FA_RING - 1;
    f->pin[MCSHM_PIN_W_TAIL] = 0;
    int two[] = {0, 1};
    l = NULL;
    mc_request r2 = {FA_L0, two, 2};
    st = mc__pin_lease(f->am, &r2, 1, &l);
    CHECK(st == MCSHM_RING_FULL && !l, "ring full: status %d", st);
    CHECK(fa_pins(f, 0, 0) == 0 && fa_pins(f, 0, 1) == 0, "ring full leaves no pin");
    /* the daemon drains: room again */
    uint64_t keys[FA_RING], ts[FA_RING];
    CHECK(mcshm_drain(&f->am->lay, (mcshm_u64 *)f->pin, keys, ts, FA_RING) == FA_RING - 1, "drain");
    st = mc__pin_lease(f->am, &r2, 1, &l);
    CHECK(st == MCSHM_OK, "after the drain the pin goes through");
    mc_release(l);
    fa_free(f);
}

/* The socket lease shape: items with the reply's gens, no pin file involved. */
static void test_socket_lease_validity(void) {
    fake_arena *f = fa_new(SESSION);
    f->am->lay.pin = NULL;
    fa_load(f, 0, 3, 0);
    mc_lease *l = calloc(1, sizeof *l);
    l->n = 1;
    l->items = calloc(1, sizeof(mc_item));
    l->mi = calloc(1, sizeof(mcshm_item));
    l->items[0] = (mc_item){FA_L0, 3, 0, 0};
    l->mi[0] = (mcshm_item){0, 0, atomic_load(mcshm_gen_ptr(&f->am->lay, 0, 0))};
    l->am = f->am;
    l->session = SESSION;
    atomic_fetch_add(&f->am->refs, 1);
    atomic_fetch_add(&f->am->maprefs, 1);
    CHECK(mc_lease_valid(l), "socket lease valid");
    int st, ex[] = {3};
    mc_lease *l2 = pin(f, FA_L0, ex, 1, &st);
    CHECK(st == MCSHM_MISS && !l2, "no pin file: every acquire takes the socket");
    mcshm_bump(&f->am->lay, 0, 0);
    CHECK(!mc_lease_valid(l), "generation moved: invalid");
    l->mi[0].slot = FA_S0;   /* a slot the class does not have (bad reply) */
    CHECK(!mc_lease_valid(l), "slot out of range: invalid");
    mc_release(l);   /* l->c is NULL: no message */
    fa_free(f);
}

/* peeks: where resident experts lie, without pins; a slot reused after the peek is told by the
 * generation; hits noted in the ring without pins */
static void test_peek(void) {
    fake_arena *f = fa_new(SESSION);
    fa_load(f, 0, 4, 2);
    fa_load(f, 0, 6, 0);
    int ex[] = {4, 5, 6};
    mc_peek_item it[3];
    CHECK(mc__peek(f->am, FA_L0, ex, 3, it) == 2, "two of three resident");
    CHECK(it[0].slot == 2 && it[0].cls == 0 && it[0].session == SESSION, "expert 4 in slot 2");
    CHECK(it[1].slot == UINT32_MAX && it[1].session == 0, "expert 5 not resident");
    CHECK(it[2].slot == 0, "expert 6 in slot 0");
    CHECK(fa_pins(f, 0, 2) == 0 && fa_pins(f, 0, 0) == 0 && head(f) == 0, "a peek pins nothing and writes no hit");
    CHECK(mc__peek_valid(f->am, &it[0]) == 1 && mc__peek_valid(f->am, &it[2]) == 1, "peeks valid");
    CHECK(mc__peek_valid(f->am, &it[1]) == 0, "a miss is never valid");
    /* nothing pins a peeked slot: the daemon evicts it and loads another expert there */
    CHECK(mcshm_try_evict(&f->am->lay, f->pins, 1, 4, 0, 2) == 1, "a peeked slot is evictable");
    fa_load(f, 0, 7, 2);
    CHECK(mc__peek_valid(f->am, &it[0]) == 0, "the generation tells: the peek is stale");
    CHECK(mc__peek_valid(f->am, &it[2]) == 1, "the other slot still holds its expert");
    mc_peek_item again;
    int e7 = 7;
    CHECK(mc__peek(f->am, FA_L0, &e7, 1, &again) == 1 && again.slot == 2 && again.gen != it[0].gen, "the new expert, a new generation");
    int bad[] = {4, 99};
    CHECK(mc__peek(f->am, FA_L0, bad, 2, it) == 0 && it[0].slot == UINT32_MAX, "an expert out of range: nothing found");
    CHECK(mc__peek(f->am, FA_L0 + 1000, ex, 1, it) == 0, "a layer past the model: nothing found");
    /* hits without pins */
    CHECK(mc__note_hits(f->am, FA_L0, &e7, 1) == 1 && head(f) == 1 && fa_pins(f, 0, 2) == 0, "a noted hit: one ring entry, no pin");
    uint64_t *ring = (uint64_t *)f->pin + f->am->lay.ring_word;
    CHECK(ring[0] == 7 + 1 && ring[1] != 0, "ring entry: key+1 and a time");
    /* a ring without room for all of them: nothing written */
    f->pin[MCSHM_PIN_W_HEAD] = FA_RING;   /* head - tail == ring_n: full */
    CHECK(mc__note_hits(f->am, FA_L0, &e7, 1) == 0 && f->pin[MCSHM_PIN_W_HEAD] == FA_RING, "full ring: no hit noted");
    f->pin[MCSHM_PIN_W_HEAD] = 1;
    /* the releases word: what the daemon moves before it punches holes in the arena */
    CHECK(mc__arena_releases(f->am, SESSION) == 0, "no pages given back yet");
    f->am->lay.ctl[MCSHM_CTL_W_RELEASES] = 3;
    CHECK(mc__arena_releases(f->am, SESSION) == 3, "the releases word read");
    CHECK(mc__arena_releases(f->am, SESSION + 1) == 0, "another session's arena: unknown (0)");
    /* a restart voids every peek */
    f->am->lay.ctl[MCSHM_CTL_W_EPOCH] = SESSION + 1;
    CHECK(mc__peek_valid(f->am, &again) == 0, "another epoch: invalid");
    CHECK(mc__peek(f->am, FA_L0, &e7, 1, &again) == 0, "another epoch: nothing found");
    fa_free(f);
}

int main(void) {
    test_hit_read_release();
    test_miss_and_range();
    test_revocation_detected();
    test_pins_stay_within_the_quota();
    test_epoch_state_void();
    test_ring_full_and_multi();
    test_socket_lease_validity();
    test_peek();
    if (g_failures) {
        fprintf(stderr, "test_fastpath: %d failure(s)\n", g_failures);
        return 1;
    }
    printf("test_fastpath: ok\n");
    return 0;
}
