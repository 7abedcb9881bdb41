/* Concurrency of the shared-memory hit path (run it under ThreadSanitizer: make test-tsan).
 *
 * One "daemon" thread evicts (mcshm_try_evict: honours pins), revokes (bumps a generation
 * regardless of pins, as for a client over its quota), refills slots with other experts'
 * bytes, publishes them, and drains the hit ring; client threads pin sets of experts through
 * the library's lease objects (serialised per pin file, as the header requires), read every
 * byte, and then ask mc_lease_valid(). Whenever it says valid, the bytes read must be the
 * expert's own; a lease taken while the daemon honours pins must stay valid until released
 * unless it was revoked. */
#define _GNU_SOURCE
#include "testutil.h"
#include <pthread.h>
#include <sched.h>

enum { N_CLIENTS = 3 };

static fake_arena *F;
static pthread_mutex_t pin_mu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int stop_flag;
static _Atomic long n_status[5];
static _Atomic long n_pins, n_valid, n_invalid, n_wrong_valid, n_wrong_seen, n_miss;
static long iters = 20000;

static uint64_t rnd(uint64_t *s) {
    *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17;
    return *s;
}

/* the daemon's view: which key sits in each slot (-1: none); class c = moe layer c */
static int slot_key[2][FA_S0 > FA_S1 ? FA_S0 : FA_S1];

static void *daemon_main(void *arg) {
    uint64_t s = 0x9e3779b97f4a7c15ull;
    mcshm_layout *lay = &F->am->lay;
    uint64_t keys[FA_RING], ts[FA_RING];
    long rounds = 0;
    while (!atomic_load(&stop_flag)) {
        rounds++;
        mcshm_drain(lay, F->pins[0], keys, ts, FA_RING);
        uint32_t c = rnd(&s) & 1, ns = c ? FA_S1 : FA_S0;
        uint32_t slot = rnd(&s) % ns;
        int k = slot_key[c][slot];
        int revoke = rnd(&s) % 16 == 0;
        if (k >= 0) {
            if (revoke) {   /* ignores pins: the generation tells the holder */
                mcshm_unpublish(lay, c * FA_E + k);
                mcshm_bump(lay, c, slot);
            } else if (!mcshm_try_evict(lay, F->pins, 1, c * FA_E + k, c, slot)) {
                continue;   /* pinned */
            }
            slot_key[c][slot] = -1;
        }
        /* refill with an expert not resident now */
        int e;
        for (;;) {
            e = (int)(rnd(&s) % FA_E);
            int used = 0;
            for (uint32_t j = 0; j < ns; j++) used |= slot_key[c][j] == e;
            if (!used) break;
        }
        fa_load(F, c, (uint32_t)e, slot);
        slot_key[c][slot] = e;
        if ((rounds & 63) == 0) sched_yield();
    }
    return NULL;
}

/* mostly experts resident now (peeking at the resident map, as a router would not), so that
 * most attempts pin; sometimes any expert */
static int pick(uint64_t *s, uint32_t m) {
    for (int tries = 0; tries < 8 && rnd(s) % 4; tries++) {
        uint32_t e = (uint32_t)(rnd(s) % FA_E);
        if (atomic_load_explicit(mcshm_res_ptr(&F->am->lay, m * FA_E + e), memory_order_relaxed))
            return (int)e;
    }
    return (int)(rnd(s) % FA_E);
}

static void *client_main(void *arg) {
    uint64_t s = 0x1234567ull + (uintptr_t)arg * 7919;
    long mine = 0;
    for (long it = 0; mine < iters && it < 50 * iters; it++) {
        int ex0[3], ex1[2];
        uint32_t n0 = 1 + rnd(&s) % 3, n1 = rnd(&s) % 3;
        for (uint32_t i = 0; i < n0; i++) {
        again0:
            ex0[i] = pick(&s, 0);
            for (uint32_t j = 0; j < i; j++) if (ex0[j] == ex0[i]) goto again0;
        }
        if (n1 > 2) n1 = 2;
        for (uint32_t i = 0; i < n1; i++) {
        again1:
            ex1[i] = pick(&s, 1);
            for (uint32_t j = 0; j < i; j++) if (ex1[j] == ex1[i]) goto again1;
        }
        mc_request r[2] = {{FA_L0, ex0, n0}, {FA_L1, ex1, n1}};
        mc_lease *l = NULL;
        pthread_mutex_lock(&pin_mu);
        int st = mc__pin_lease(F->am, r, n1 ? 2 : 1, &l);
        pthread_mutex_unlock(&pin_mu);
        atomic_fetch_add(&n_status[st], 1);
        if (st != MCSHM_OK) {
            if (st == MCSHM_RING_FULL) sched_yield();   /* the daemon drains it */
            atomic_fetch_add(&n_miss, 1);
            continue;
        }
        atomic_fetch_add(&n_pins, 1);
        mine++;
        const mc_item *items = mc_lease_items(l);
        int all_ok = 1;
        for (uint32_t i = 0; i < mc_lease_n(l); i++)
            for (uint32_t p = 0; p < 2; p++) {
                uint64_t nb;
                const void *b = mc_lease_part(l, i, FA_PART_NAMES[p], &nb);
                if (!b) { all_ok = -1; continue; }   /* already invalid: no view handed out */
                if (!fa_matches(b, nb, items[i].cls, (uint32_t)items[i].expert, p)) all_ok = 0;
            }
        if (mc_lease_valid(l)) {
            atomic_fetch_add(&n_valid, 1);
            if (all_ok != 1) atomic_fetch_add(&n_wrong_valid, 1);
        } else {
            atomic_fetch_add(&n_invalid, 1);
            if (all_ok == 0) atomic_fetch_add(&n_wrong_seen, 1);
        }
        mc_release(l);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc > 1) iters = atol(argv[1]);
    F = fa_new(77);
    memset(slot_key, -1, sizeof slot_key);
    pthread_t d, cl[N_CLIENTS];
    pthread_create(&d, NULL, daemon_main, NULL);
    for (uintptr_t i = 0; i < N_CLIENTS; i++) pthread_create(&cl[i], NULL, client_main, (void *)i);
    for (int i = 0; i < N_CLIENTS; i++) pthread_join(cl[i], NULL);
    atomic_store(&stop_flag, 1);
    pthread_join(d, NULL);
    long pinned_left = 0;
    for (uint32_t sl = 0; sl < FA_S0; sl++) pinned_left += fa_pins(F, 0, sl);
    for (uint32_t sl = 0; sl < FA_S1; sl++) pinned_left += fa_pins(F, 1, sl);
    printf("test_concurrency: %ld pins, %ld misses, %ld valid, %ld invalid (%ld of them with changed bytes), "
           "%ld wrong bytes under a valid lease\n", (long)n_pins, (long)n_miss, (long)n_valid, (long)n_invalid,
           (long)n_wrong_seen, (long)n_wrong_valid);
    printf("test_concurrency: pin results: ok %ld, miss %ld, stale %ld, ring full %ld, bad %ld\n", (long)n_status[0],
           (long)n_status[1], (long)n_status[2], (long)n_status[3], (long)n_status[4]);
    CHECK(n_wrong_valid == 0, "%ld leases said valid over wrong bytes", (long)n_wrong_valid);
    CHECK(pinned_left == 0, "%ld pins left after every lease was released", pinned_left);
    CHECK(n_valid > 0, "no lease was ever checked valid (the test exercised nothing)");
    fa_free(F);
    if (g_failures) return 1;
    printf("test_concurrency: ok\n");
    return 0;
}
