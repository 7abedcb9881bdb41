// What one more node of a ggml-cpu graph costs a decoded token: a served block adds host ops to the
// graph (the acquire before its expert matmuls, the release after them), each a node that one thread
// runs while the others wait at the barrier that ends every node. Built and run by
// benchmarks/node_cost.py.
//   node_cost THREADS ITERS PAIRS  ->  "base_us=B with_us=W per_node_us=P alone_per_node_us=A"
// base: PAIRS pairs of matrix-vector products (2048 x 128 Q8_0 and back: small, so
// that a node's barrier is a visible part of them)
// in a chain; with: the same with an empty one-thread custom op after each pair's first; per node:
// (with - base) / PAIRS, medians of 11 alternating rounds; alone: a chain of PAIRS empty ops, per op.
#include "ggml.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

static void nothing(ggml_tensor *, const ggml_tensor *, int, int, void *) {}

struct timed_graph {
    ggml_cgraph * gf;
    ggml_cplan cp;
    std::vector<uint8_t> work;
    std::vector<double> us;
};

static void plan(timed_graph & g, int nth, ggml_threadpool * tp) {
    g.cp = ggml_graph_plan(g.gf, nth, tp);
    g.work.resize(g.cp.work_size + 1);
    g.cp.work_data = g.work.data();
    for (int i = 0; i < 20; ++i) ggml_graph_compute(g.gf, &g.cp);
}

static void run(timed_graph & g, int iters) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) ggml_graph_compute(g.gf, &g.cp);
    g.us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters);
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char ** argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: node_cost THREADS ITERS PAIRS\n");
        return 2;
    }
    const int nth = atoi(argv[1]), iters = atoi(argv[2]), pairs = atoi(argv[3]);
    const int ne0 = 2048, ne1 = 128;   // small products: a node's barrier is a visible part of them
    const size_t wbytes = ggml_row_size(GGML_TYPE_Q8_0, ne0) * ne1 * 2;
    ggml_init_params ip = {wbytes + (size_t) pairs * 4 * 2 * (ne0 + ne1) * 8 + 64u * 1024 * 1024, nullptr, false};
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * w = ggml_new_tensor_2d(ctx, GGML_TYPE_Q8_0, ne0, ne1);
    memset(w->data, 0, ggml_nbytes(w));
    ggml_tensor * w2 = ggml_new_tensor_2d(ctx, GGML_TYPE_Q8_0, ne1, ne0);   // back to ne0 for the chain
    memset(w2->data, 0, ggml_nbytes(w2));
    ggml_threadpool_params tpp = ggml_threadpool_params_default(nth);
    ggml_threadpool * tp = ggml_threadpool_new(&tpp);
    // base and with in alternation (11 rounds of ITERS computes each), and a chain of empty nodes alone
    timed_graph g[3];
    for (int kind = 0; kind < 3; ++kind) {
        ggml_tensor * x = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, ne0);
        for (int i = 0; i < ne0; ++i) ((float *) x->data)[i] = 0.01f * (i % 7);
        g[kind].gf = ggml_new_graph_custom(ctx, 8 * pairs + 16, false);
        ggml_tensor * cur = x;
        for (int p = 0; p < pairs; ++p) {
            if (kind == 2) {
                cur = ggml_map_custom1_inplace(ctx, cur, nothing, 1, nullptr);
                continue;
            }
            cur = ggml_mul_mat(ctx, w, cur);        // [768]
            if (kind == 1) cur = ggml_map_custom1_inplace(ctx, cur, nothing, 1, nullptr);
            cur = ggml_mul_mat(ctx, w2, cur);       // [2048]
        }
        ggml_build_forward_expand(g[kind].gf, cur);
        plan(g[kind], nth, tp);
    }
    for (int r = 0; r < 11; ++r) {
        run(g[r % 2], iters);
        run(g[1 - r % 2], iters);
        run(g[2], iters);
    }
    const double base = median(g[0].us), with = median(g[1].us), alone = median(g[2].us);
    printf("base_us=%.3f with_us=%.3f per_node_us=%.3f alone_per_node_us=%.3f\n", base, with, (with - base) / pairs,
           alone / pairs);
    ggml_threadpool_free(tp);
    ggml_free(ctx);
    return 0;
}
