/* C side of benchmarks/hit_path.py: pin + unpin of one set of resident experts through
 * moecache_shm.h (mcshm_pin, mcshm_unpin), the C clients' shared-memory hit path, timed per pair.
 * The layout comes from a text file written by hit_path.py (see there); prints p50 and p99 in ns.
 *
 *   cc -O2 -std=c11 -I clients/c/include benchmarks/hit_path_c.c -o hit_path_c
 *   ./hit_path_c LAYOUT_FILE ARENA_FILE PIN_FILE ITERS
 */
#define _GNU_SOURCE
#include "moecache_shm.h"
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static void *map(const char *path, int prot) {
    int fd = open(path, (prot & PROT_WRITE) ? O_RDWR : O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) { perror(path); exit(2); }
    void *p = mmap(NULL, (size_t)st.st_size, prot, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) { perror(path); exit(2); }
    return p;
}

static int cmp(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc != 5) { fprintf(stderr, "usage: %s LAYOUT ARENA PINS ITERS\n", argv[0]); return 2; }
    FILE *f = fopen(argv[1], "r");
    if (!f) { perror(argv[1]); return 2; }
    mcshm_layout m = {0};
    unsigned long long session, ne, nk, nc, rw, rn, pw32, ringw, nmoe, nreq, v;
    if (fscanf(f, "%llu %llu %llu %llu %llu %llu %llu %llu %llu", &session, &ne, &nk, &nc, &rw, &rn,
               &pw32, &ringw, &nmoe) != 9 || nc > MCSHM_MAX_CLASSES) { fprintf(stderr, "bad layout\n"); return 2; }
    m.session = session; m.n_experts = ne; m.n_keys = nk; m.n_classes = nc; m.resmap_word = rw;
    m.ring_n = rn; m.pins_word32 = pw32; m.ring_word = ringw;
    for (unsigned i = 0; i < nc; i++) {
        unsigned long long g, n, b;
        if (fscanf(f, "%llu %llu %llu", &g, &n, &b) != 3) return 2;
        m.gen_word[i] = g; m.n_slots[i] = n; m.slot_base[i] = b;
    }
    uint32_t *kc = calloc(nmoe + 1, 4);
    for (unsigned i = 0; i < nmoe; i++) { if (fscanf(f, "%llu", &v) != 1) return 2; kc[i] = v; }
    m.key_class = kc;
    if (fscanf(f, "%llu", &nreq) != 1) return 2;
    uint32_t *keys = calloc(nreq, 4);
    for (unsigned i = 0; i < nreq; i++) { if (fscanf(f, "%llu", &v) != 1) return 2; keys[i] = v; }
    fclose(f);
    m.ctl = map(argv[2], PROT_READ);
    m.pin = map(argv[3], PROT_READ | PROT_WRITE);
    long iters = atol(argv[4]);
    uint64_t *lat = calloc(iters, 8);
    mcshm_item *it = calloc(nreq, sizeof *it);
    long fails = 0;
    for (long i = -1000; i < iters; i++) {
        /* the daemon's part, untimed: consume the ring */
        atomic_store(&m.pin[MCSHM_PIN_W_TAIL], atomic_load(&m.pin[MCSHM_PIN_W_HEAD]));
        uint64_t t0 = mcshm_now_ns();
        int rc = mcshm_pin(&m, keys, nreq, it);
        if (rc == MCSHM_OK) mcshm_unpin(&m, it, nreq); else fails++;
        uint64_t t1 = mcshm_now_ns();
        if (i >= 0) lat[i] = t1 - t0;
    }
    qsort(lat, iters, 8, cmp);
    printf("%llu %llu %ld\n", (unsigned long long)lat[iters / 2], (unsigned long long)lat[(iters * 99) / 100], fails);
    return fails != 0;
}
