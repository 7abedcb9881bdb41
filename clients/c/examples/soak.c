/* soak -- a client that acquires random experts until SIGTERM and checks every byte it reads.
 *
 *   soak ENDPOINT EXPECT OUT SEED
 *
 * EXPECT: the table of clients/c/tests/dump_expect.py. Per round: a random layer, 1-4 random
 * experts, acquire (shared-memory fast path first, then the socket), copy every part, then
 * mc_lease_valid(): when valid, the copies are compared with the model file and each
 * mismatch is appended to OUT at once ("WRONG layer expert part"), so a SIGKILLed worker's
 * findings survive it; when not valid the round counts as an invalid lease seen. Errors
 * (daemon restarted or gone, timeouts) are counted and the worker carries on, reconnecting
 * when needed. On SIGTERM: "DONE {json}" to OUT, exit 0. Used by tests/test_soak.py. */
#define _GNU_SOURCE
#include "moecache.h"
#include "expect.h"
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t stop;
static void on_term(int sig) { (void)sig; stop = 1; }

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: soak ENDPOINT EXPECT OUT SEED\n");
        return 2;
    }
    ex_table *ex = ex_load(argv[2]);
    if (!ex) return 2;
    FILE *out = fopen(argv[3], "a");
    if (!out) { perror(argv[3]); return 2; }
    setvbuf(out, NULL, _IOLBF, 0);
    unsigned seed = (unsigned)strtoul(argv[4], NULL, 10);
    struct sigaction sa = {0};
    sa.sa_handler = on_term;
    sigaction(SIGTERM, &sa, NULL);
    long acquires = 0, verified = 0, wrong = 0, invalid = 0, errors = 0, fast = 0;
    unsigned char *copy = NULL;
    size_t copy_cap = 0;
    mc_client *c = NULL;
    char name[32];
    snprintf(name, sizeof name, "csoak%u", seed);
    while (!stop) {
        mc_error err;
        if (c == NULL) {
            mc_options opt;
            mc_options_init(&opt);
            c = mc_connect(argv[1], name, &opt, &err);
            if (c == NULL) { errors++; usleep(50000); continue; }
        }
        const mc_arena *a = mc_arena_get(c, &err);
        if (a == NULL) { errors++; mc_close(c); c = NULL; usleep(50000); continue; }
        int layer = a->expert_layers[rand_r(&seed) % a->n_expert_layers];
        int n = 1 + (int)(rand_r(&seed) % 4), ex_ids[4];
        for (int i = 0; i < n; i++) {
            int e, dup;
            do {
                e = (int)(rand_r(&seed) % (unsigned)a->n_experts);
                dup = 0;
                for (int j = 0; j < i; j++) dup |= ex_ids[j] == e;
            } while (dup);
            ex_ids[i] = e;
        }
        mc_lease *l = NULL;
        if (mc_acquire(c, layer, ex_ids, (uint32_t)n, MC_ACQ_DECODE, 5000, &l, &err) != MC_OK) {
            errors++;
            if (err.code == MC_ERR_CLOSED) { mc_close(c); c = NULL; }
            usleep(20000);
            continue;
        }
        acquires++;
        fast += mc_lease_fast(l);
        const mc_class *cls = NULL;
        int cid = mc_layer_class(a, layer);
        for (uint32_t k = 0; k < a->n_classes; k++)
            if ((int)a->classes[k].id == cid) cls = &a->classes[k];
        /* copy first, check validity after: the seqlock order */
        size_t need = 0;
        for (int i = 0; cls && i < n; i++)
            for (uint32_t p = 0; p < cls->n_parts; p++) need += cls->parts[p].part_bytes;
        if (need > copy_cap) { free(copy); copy = malloc(need); copy_cap = need; }
        size_t off = 0;
        for (int i = 0; cls && i < n; i++)
            for (uint32_t p = 0; p < cls->n_parts; p++) {
                uint64_t bytes = 0;
                const void *src = mc_lease_part(l, (uint32_t)i, cls->parts[p].name, &bytes);
                if (src) memcpy(copy + off, src, bytes);
                off += cls->parts[p].part_bytes;
            }
        if (rand_r(&seed) % 5 == 0) usleep(rand_r(&seed) % 50000);   /* hold it a while */
        if (mc_lease_valid(l)) {
            off = 0;
            for (int i = 0; cls && i < n; i++)
                for (uint32_t p = 0; p < cls->n_parts; p++) {
                    verified++;
                    if (!ex_check(ex, layer, ex_ids[i], cls->parts[p].name, copy + off, cls->parts[p].part_bytes)) {
                        wrong++;
                        fprintf(out, "WRONG %d %d %s\n", layer, ex_ids[i], cls->parts[p].name);
                    }
                    off += cls->parts[p].part_bytes;
                }
        } else {
            invalid++;
        }
        mc_release(l);
    }
    fprintf(out, "DONE {\"acquires\": %ld, \"fast\": %ld, \"verified_parts\": %ld, \"wrong\": %ld, "
                 "\"invalid_seen\": %ld, \"errors\": %ld}\n", acquires, fast, verified, wrong, invalid, errors);
    fclose(out);
    if (c) mc_close(c);
    ex_free(ex);
    free(copy);
    return 0;
}
