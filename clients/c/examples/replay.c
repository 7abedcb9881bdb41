/* replay -- an engine loop over a routing trace, through libmoecache.
 *
 *   replay [--no-fast] ENDPOINT TRACE [EXPECT]
 *
 * TRACE: text, one line per token per MoE layer: "<token> <moe layer> <expert> <expert> ...";
 * moe layer i is the model's i-th block with routed experts (as in moecached's .npz traces;
 * convert one with
 *   python -c "import numpy as np,sys; e=np.load(sys.argv[1])['experts'];
 *     [print(t,l,*[x for x in e[t,l] if x>=0]) for t in range(e.shape[0]) for l in range(e.shape[1])]" T.npz
 * ). Per token and layer: prefetch the next layer's experts, acquire this layer's, read every
 * byte of every part (and, with EXPECT from clients/c/tests/dump_expect.py, compare it with the
 * model file), check the lease is still valid, release. --no-fast sends every acquire over
 * the socket (MC_ACQ_NO_FAST), for comparison. Prints hits/misses/time per token and
 * a summary; exit status 1 when any byte was wrong or a lease went invalid. */
#define _GNU_SOURCE
#include "moecache.h"
#include "expect.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct row { int token, layer, n, ex[64]; } row;

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

int main(int argc, char **argv) {
    int acq_flags = MC_ACQ_DECODE;
    if (argc > 1 && strcmp(argv[1], "--no-fast") == 0) {
        acq_flags |= MC_ACQ_NO_FAST;
        argv++;
        argc--;
    }
    if (argc < 3) {
        fprintf(stderr, "usage: replay [--no-fast] ENDPOINT TRACE [EXPECT]\n");
        return 2;
    }
    FILE *f = fopen(argv[2], "r");
    if (!f) { perror(argv[2]); return 2; }
    size_t n = 0, cap = 1024;
    row *rows = malloc(cap * sizeof *rows);
    char line[4096];
    while (fgets(line, sizeof line, f)) {
        row r = {0};
        char *p = line, *e;
        r.token = (int)strtol(p, &e, 10);
        if (e == p) continue;
        p = e;
        r.layer = (int)strtol(p, &e, 10);
        p = e;
        for (;;) {
            long v = strtol(p, &e, 10);
            if (e == p || r.n == 64) break;
            r.ex[r.n++] = (int)v;
            p = e;
        }
        if (n == cap) rows = realloc(rows, (cap *= 2) * sizeof *rows);
        rows[n++] = r;
    }
    fclose(f);
    ex_table *ex = argc > 3 ? ex_load(argv[3]) : NULL;
    if (argc > 3 && !ex) return 2;

    mc_options o;
    mc_options_init(&o);
    o.connect_timeout_ms = 30000;
    mc_error err;
    mc_client *c = mc_connect(argv[1], "replay", &o, &err);
    if (!c) { fprintf(stderr, "replay: %s\n", err.message); return 2; }
    const mc_arena *a = mc_arena_get(c, &err);
    printf("replay: %zu rows, %u moe layers, %u experts, fast path %s\n", n, a->n_expert_layers, a->n_experts,
           mc_fast_path(c) ? "on" : "off (daemon offers no pin file)");
    long hits = 0, misses = 0, fast = 0, wrong = 0, invalid = 0, errors = 0, tokens = 0;
    double t_all = 0, sink = 0;
    for (size_t i = 0; i < n;) {
        int tok = rows[i].token;
        long th = 0, tm = 0;
        double t0 = now_us();
        for (; i < n && rows[i].token == tok; i++) {
            row *r = &rows[i];
            if (r->layer < 0 || (uint32_t)r->layer >= a->n_expert_layers) {
                fprintf(stderr, "replay: token %d: moe layer %d out of range (0..%u)\n", tok, r->layer,
                        a->n_expert_layers - 1);
                errors++;
                continue;
            }
            int block = a->expert_layers[r->layer];
            if (i + 1 < n && rows[i + 1].token == tok && rows[i + 1].layer >= 0 &&
                (uint32_t)rows[i + 1].layer < a->n_expert_layers)
                mc_prefetch(c, a->expert_layers[rows[i + 1].layer], rows[i + 1].ex, (uint32_t)rows[i + 1].n, NULL);
            mc_lease *l;
            int rc = mc_acquire(c, block, r->ex, (uint32_t)r->n, acq_flags, -1, &l, &err);
            if (rc != MC_OK) {
                fprintf(stderr, "replay: token %d block %d: %s\n", tok, block, err.message);
                errors++;
                if (rc == MC_ERR_RESTARTED) a = mc_arena_get(c, &err);
                continue;
            }
            uint32_t h, ph, m;
            mc_lease_counts(l, &h, &ph, &m, NULL);
            th += h + ph;
            tm += m;
            fast += mc_lease_fast(l);
            const mc_item *it = mc_lease_items(l);
            const mc_class *k = &a->classes[it[0].cls];
            for (uint32_t j = 0; j < mc_lease_n(l); j++)
                for (uint32_t p = 0; p < k->n_parts; p++) {
                    uint64_t nb;
                    const unsigned char *b = mc_lease_part(l, j, k->parts[p].name, &nb);
                    if (!b) { wrong++; continue; }
                    sink += b[0] + b[nb - 1];   /* "compute" */
                    if (ex && !ex_check(ex, it[j].layer, it[j].expert, k->parts[p].name, b, nb)) wrong++;
                }
            if (!mc_lease_valid(l)) invalid++;
            mc_release(l);
        }
        double dt = now_us() - t0;
        t_all += dt;
        tokens++;
        hits += th;
        misses += tm;
        printf("token %4d  hits %3ld  misses %3ld  %9.1f us\n", tok, th, tm, dt);
    }
    printf("replay: %ld tokens, %ld hits, %ld misses (%.1f%% hit rate), %ld fast-path leases, %.1f us/token, "
           "%ld wrong parts, %ld invalid leases, %ld errors%s\n", tokens, hits, misses,
           hits + misses ? 100.0 * hits / (hits + misses) : 0.0, fast, tokens ? t_all / tokens : 0.0, wrong, invalid,
           errors, ex ? "" : " (bytes not compared: no EXPECT)");
    mc_close(c);
    if (ex) ex_free(ex);
    (void)sink;
    free(rows);
    return wrong || invalid || errors ? 1 : 0;
}
