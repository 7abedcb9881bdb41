/* hit_bench -- acquire + release of resident experts through libmoecache, timed.
 *
 *   hit_bench ENDPOINT LAYER ITERS EXPERT...
 *
 * Connects (hello, fast path when the daemon offers it), makes the experts resident with one
 * acquire, then times ITERS pairs of mc_acquire + mc_release (the library's whole hit path:
 * shared-memory pin, lease bookkeeping, release store) and prints "p50_ns p99_ns fast" where
 * fast is 1 when the pairs went through shared memory. Used by benchmarks/hit_path.py. */
#define _GNU_SOURCE
#include "moecache.h"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: hit_bench ENDPOINT LAYER ITERS EXPERT...\n");
        return 2;
    }
    int layer = atoi(argv[2]), iters = atoi(argv[3]), n = argc - 4;
    int *ex = malloc(sizeof(int) * (size_t)n);
    for (int i = 0; i < n; i++) ex[i] = atoi(argv[4 + i]);
    mc_error err;
    mc_options opt;
    mc_options_init(&opt);
    mc_client *c = mc_connect(argv[1], "hit-bench-c", &opt, &err);
    if (!c) { fprintf(stderr, "connect: %s\n", err.message); return 1; }
    mc_lease *l;
    if (mc_acquire(c, layer, ex, (uint32_t)n, 0, -1, &l, &err) != MC_OK) {
        fprintf(stderr, "acquire: %s\n", err.message);
        return 1;
    }
    mc_release(l);
    long long *t = malloc(sizeof(long long) * (size_t)iters);
    int fast = 1;
    for (int i = 0; i < iters; i++) {
        long long t0 = now_ns();
        if (mc_acquire(c, layer, ex, (uint32_t)n, 0, -1, &l, &err) != MC_OK) {
            fprintf(stderr, "acquire: %s\n", err.message);
            return 1;
        }
        fast &= mc_lease_fast(l);
        mc_release(l);
        t[i] = now_ns() - t0;
    }
    qsort(t, (size_t)iters, sizeof *t, cmp);
    printf("%lld %lld %d\n", t[iters / 2], t[(size_t)(iters * 0.99)], fast);
    mc_close(c);
    free(t);
    free(ex);
    return 0;
}
