// ggml-cpu's MUL_MAT_ID against the expert count of its weight tensor, the experts used the same:
// a served block's weight tensors span every slot of its size class (one per expert of every block
// at a full arena), a decoded token uses top-k of them. Built and run by benchmarks/mmid_slots.py.
//   mmid_slots THREADS ITERS ROWS N_AS...   ->  one line per N_AS: "n_as=N us=U min_us=M"
#include "ggml.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: mmid_slots THREADS ITERS ROWS N_AS...\n");
        return 2;
    }
    const int nth = atoi(argv[1]), iters = atoi(argv[2]), ne1 = atoi(argv[3]);
    const int ne0 = 2048, k = 8;   // Qwen3-30B-A3B's hidden size and top-k
    for (int a = 4; a < argc; ++a) {
        const int n_as = atoi(argv[a]);
        const size_t wbytes = ggml_row_size(GGML_TYPE_Q8_0, ne0) * ne1 * (size_t) n_as;
        ggml_init_params ip = {wbytes + 16u * 1024 * 1024, nullptr, false};
        ggml_context * ctx = ggml_init(ip);
        ggml_tensor * w = ggml_new_tensor_3d(ctx, GGML_TYPE_Q8_0, ne0, ne1, n_as);
        memset(w->data, 0, ggml_nbytes(w));
        ggml_tensor * x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, ne0, 1, 1);
        for (int i = 0; i < ne0; ++i) ((float *) x->data)[i] = 0.01f * (i % 7);
        ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, 1);
        for (int j = 0; j < k; ++j) ((int32_t *) ids->data)[j] = 3 + 13 * j;   // the same 8 experts every time
        ggml_cgraph * gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, ggml_mul_mat_id(ctx, w, x, ids));
        ggml_threadpool_params tpp = ggml_threadpool_params_default(nth);
        ggml_threadpool * tp = ggml_threadpool_new(&tpp);
        ggml_cplan cp = ggml_graph_plan(gf, nth, tp);
        std::vector<uint8_t> work(cp.work_size);
        cp.work_data = work.data();
        for (int i = 0; i < 50; ++i) ggml_graph_compute(gf, &cp);
        std::vector<double> t;
        for (int r = 0; r < 5; ++r) {
            const auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < iters; ++i) ggml_graph_compute(gf, &cp);
            t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters);
        }
        std::sort(t.begin(), t.end());
        printf("n_as=%d us=%.3f min_us=%.3f\n", n_as, t[2], t[0]);
        fflush(stdout);
        ggml_threadpool_free(tp);
        ggml_free(ctx);
    }
    return 0;
}
