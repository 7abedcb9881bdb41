// mc-decode: greedy decode with llama.cpp, dumping every logits row, for checking a decode
// through moecached against the resident model (bit-identical) and for timing both.
//
//   mc-decode -m MODEL [--moecached ENDPOINT] [-p PROMPT] [-n STEPS] [-t THREADS]
//             [--ubatch N] [--dump FILE] [--step-delay-ms MS] [--retries N] [--rounds N]
//             [--moecached-subst R] [--moecached-subst-cap N] [--dump-moe FILE] [--cpu-moe]
//             [--moecached-gpu cpu|zerocopy] [--moecached-prefetch off|next|two] [--moecached-vram SIZE]
//             [--moecached-vram-lookup auto|device|host|arena]
//   mc-decode --help      (-h) prints the options and exits 0
//
// Prints one line per step ("step I token T"), one line per round and a final "timing" line (the
// times include the wait for the logits: on a GPU llama_decode returns before they are computed):
//   round R prompt_s=S decode_tokens=N decode_s=S graphs_reused=G (graphs llama.cpp did not build again)
//   timing prompt_tokens=P prompt_s=S decode_tokens=N decode_s=S step_us_p10=U step_us_p50=U step_us_p90=U
// (step_us_*: the decode steps' times, lower decile, median and upper decile, in microseconds)
// --dump writes the float32 logits of the prompt's last token and of each step, in order.
// --dump-moe writes, per MoE block of every ubatch, the router's probabilities, its top-k ids,
// the ids after substitution and the normalised routing weights, one tensor a line:
//   NAME-BLOCK NE0 NE1 v...   (NAME: ffn_moe_probs, ffn_moe_topk, ffn_moe_topk_subst,
//                              ffn_moe_weights_norm; values row by row)
// A decode that fails on the daemon's side (restart, invalid lease) prints
//   "moecached error: ... ; retry N of M in 500 ms" and is retried up to --retries times (default 0:
// exit 3, the line without the retry); one that no
// retry mends (llama_decode returns -3: the daemon serves another model file) is not retried.
// Expert tensors are never repacked (use_extra_bufts = false), with and without --moecached,
// so both runs use the same kernels over the same bytes.
// --cpu-moe keeps the model's routed expert tensors in CPU buffers (llama.cpp's --cpu-moe, i.e.
// -ot exps=CPU): on a GPU build the expert matmuls then run on the CPU, as they do over the
// daemon's arena, so `--cpu-moe` and `--moecached` runs compare bit for bit there too.
// --moecached-gpu zerocopy (LLAMA_MOECACHED_GPU) registers the arena with CUDA instead: the expert
// matmuls run on the GPU, reading the slots over the host link (a CUDA build only).
// --moecached-prefetch next|two (LLAMA_MOECACHED_PREFETCH): while block l runs, block l+1's (and
// l+2's) router guesses their experts from block l's FFN input and the guesses go to the daemon
// as prefetches; a last line says how good the guesses were:
//   prefetch mode=M width=K calls=N sent=N useful=N errors=N recall_hits=N recall_n=N recall=R
//            recall2_hits=N recall2_n=N recall2=R pf_hits=N
// (recall: of block l+1's routed experts, the share block l's guess named; recall2 two ahead;
// useful: sent experts the block then routed to; pf_hits: experts the daemon said a prefetch
// brought in, over the socket only: shared-memory hits are not told apart).
// --moecached-vram SIZE|N% (LLAMA_MOECACHED_VRAM): a tier of the served experts in the memory of the
// device that runs the MoE blocks (a CPU buffer on a CPU build), filled from the arena; a last line:
//   vram slots=N vram_bytes=N hits=N misses=N copied_bytes=N evictions=N fallbacks=N invalidations=N
//        lookup=M device_ubatches=N reruns=N reads=N fill_syncs=N switches=N spec_copies=N
//        copy_syncs=N pinned_parts=N arena_reads=N arena_read_bytes=N stale_peeks=N registration_ends=N
//        fill=later|now|off host_us=N wait_us=N fill_us=N admit=freq|all admit_refused=N
//        stage=off|next stage_width=N stage_copies=N stage_hits=N stage_bytes=N
//        decode_hits=N decode_misses=N decode_copied_bytes=N decode_spec_copies=N decode_reruns=N
//        decode_copy_syncs=N decode_arena_reads=N decode_arena_read_bytes=N decode_host_us=N decode_wait_us=N
//        decode_fill_us=N decode_stage_copies=N decode_stage_hits=N decode_stage_bytes=N
// (misses: experts copied into the tier; fallbacks: block calls run on the arena because their
// ubatch could need more experts than the tier holds; copy_syncs: the host lookup's waits for its
// copies, one per block that copied; pinned_parts: arena parts registered with CUDA for the copies;
// host_us: the host's time in the tier's lookup, wait_us: its waits for the routing record (the
// graph's end), fill_us: issuing the in-place reads' copies into the tier; admit_refused: experts
// read in place not copied into the tier, used no more often than the one they would evict;
// stage_copies / stage_bytes: experts and bytes LLAMA_MOECACHED_VRAM_STAGE=next copied ahead into the
// tier's staging slots, stage_hits: routed experts found there (read from the arena by those copies,
// not in place: arena_reads and arena_read_bytes leave them out);
// decode_*: over the decode steps only).
// --moecached-vram-lookup auto|device|host (LLAMA_MOECACHED_VRAM_LOOKUP): a decoded token's blocks look
// their experts up in a table in the tier (device: no host op in the graph; the host reads every
// block's routed ids once after the graph, copies in what was missing and computes the graph again:
// reruns; reads: those reads; fill_syncs: waits for such copies; spec_copies: experts copied for a
// routing the final pass did not have), or per block on the host (host, the tier's acquire op); auto:
// device, host for a while when tokens ran again often (switches); arena (CUDA): device, with what the
// tier lacks read from the arena in place (arena_reads, arena_read_bytes: experts and bytes read so;
// stale_peeks: arena slots found reused after a read, the pass run again) and copied into the tier after;
// registration_ends: the arena's registration with CUDA ended or renewed after the daemon gave pages back.
#include "llama.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

static bool dump_moe(struct ggml_tensor * t, bool ask, void * ud) {
    static const char * names[] = {"ffn_moe_probs-", "ffn_moe_topk-", "ffn_moe_topk_subst-", "ffn_moe_weights_norm-"};
    bool want = false;   // NAME-BLOCK exactly
    for (const char * n : names) {
        const size_t l = strlen(n);
        want = want || (strncmp(t->name, n, l) == 0 && t->name[l] && strspn(t->name + l, "0123456789") == strlen(t->name + l));
    }
    if (ask || !want) return want;
    FILE * f = (FILE *) ud;
    // weights_norm is [n_used, n_tokens] (reshaped back to 3-d after); the others are 2-d
    fprintf(f, "%s %lld %lld", t->name, (long long) t->ne[0], (long long) (ggml_nelements(t) / t->ne[0]));
    for (int64_t r = 0; r < ggml_nelements(t) / t->ne[0]; ++r) {
        for (int64_t i = 0; i < t->ne[0]; ++i) {
            const char * p = (const char *) t->data + i * t->nb[0] + (r % t->ne[1]) * t->nb[1] + (r / t->ne[1]) * t->nb[2];
            if (t->type == GGML_TYPE_I32) fprintf(f, " %d", *(const int32_t *) p);
            else fprintf(f, " %.9g", *(const float *) p);
        }
    }
    fputc('\n', f);
    return true;
}

static const char * USAGE =
    "usage: mc-decode -m MODEL [--moecached ENDPOINT] [-p PROMPT] [-n STEPS] [-t THREADS]\n"
    "                 [--ubatch N] [--dump FILE] [--step-delay-ms MS] [--retries N] [--rounds N]\n"
    "                 [--moecached-subst R] [--moecached-subst-cap N] [--dump-moe FILE] [--cpu-moe]\n"
    "                 [--moecached-gpu cpu|zerocopy] [--moecached-prefetch off|next|two] [--moecached-vram SIZE]\n"
    "                 [--moecached-vram-lookup auto|device|host|arena]\n"
    "Greedy decode with llama.cpp, every step's logits dumped, through moecached or not.\n"
    "  -m MODEL                  GGUF model (required)\n"
    "  --moecached ENDPOINT      take the routed experts from the daemon at ENDPOINT\n"
    "  -p PROMPT                 prompt (default: \"The quick brown fox jumps over the lazy dog.\")\n"
    "  -n STEPS                  tokens to decode (default 32)\n"
    "  -t THREADS                threads (default 2)\n"
    "  --ubatch N                physical batch size of the prompt (default 512)\n"
    "  --dump FILE               float32 logits of the prompt's last token and of each step\n"
    "  --step-delay-ms MS        sleep between steps (default 0)\n"
    "  --retries N               retries of a decode the daemon failed (default 0: exit 3)\n"
    "  --rounds N                decode the prompt N times, in new contexts (default 1)\n"
    "  --moecached-subst R       let the daemon substitute a resident expert scoring >= R x a missing one\n"
    "  --moecached-subst-cap N   at most N substitutions per layer\n"
    "  --dump-moe FILE           the router's probabilities, top-k, substituted ids and weights per MoE block\n"
    "  --cpu-moe                 keep the routed expert tensors on the CPU (llama.cpp's --cpu-moe, -ot exps=CPU)\n"
    "  --moecached-gpu MODE      CUDA build: served experts computed on the CPU (cpu, default) or on the GPU\n"
    "                            reading the arena over the host link (zerocopy)\n"
    "  --moecached-prefetch MODE guess the next block's experts (next) or the next two blocks' (two) with\n"
    "                            their routers on this block's FFN input and prefetch them (default off)\n"
    "  --moecached-vram SIZE     a tier of the served experts in the memory of the device running the MoE blocks\n"
    "                            (8GiB, 512MiB, or 25% of the served experts), filled from the arena\n"
    "  --moecached-vram-lookup M where a decoded token's experts are looked up in the tier: device (a table in\n"
    "                            the tier, the token computed again after a miss), host (per block), auto (default),\n"
    "                            arena (CUDA: device, what the tier lacks read from the arena in place)\n"
    "  -h, --help                print this and exit\n";

static double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char ** argv) {
    std::string model_path, endpoint, prompt = "The quick brown fox jumps over the lazy dog.", dump, dump_moe_path;
    int n_steps = 32, n_threads = 2, n_ubatch = 512, delay_ms = 0, retries = 0, rounds = 1;
    bool cpu_moe = false;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        auto next = [&]() -> const char * {
            if (i + 1 >= argc) { fprintf(stderr, "mc-decode: %s needs a value\n", a.c_str()); exit(2); }
            return argv[++i];
        };
        if (a == "-h" || a == "--help") { fputs(USAGE, stdout); return 0; }
        else if (a == "-m") model_path = next();
        else if (a == "--moecached") endpoint = next();
        else if (a == "-p") prompt = next();
        else if (a == "-n") n_steps = atoi(next());
        else if (a == "-t") n_threads = atoi(next());
        else if (a == "--ubatch") n_ubatch = atoi(next());
        else if (a == "--dump") dump = next();
        else if (a == "--step-delay-ms") delay_ms = atoi(next());
        else if (a == "--retries") retries = atoi(next());
        else if (a == "--rounds") rounds = atoi(next());
        else if (a == "--moecached-subst") setenv("LLAMA_MOECACHED_SUBST", next(), 1);   // read at load
        else if (a == "--moecached-subst-cap") setenv("LLAMA_MOECACHED_SUBST_CAP", next(), 1);
        else if (a == "--dump-moe") dump_moe_path = next();
        else if (a == "--cpu-moe") cpu_moe = true;
        else if (a == "--moecached-gpu") setenv("LLAMA_MOECACHED_GPU", next(), 1);   // read at load
        else if (a == "--moecached-prefetch") setenv("LLAMA_MOECACHED_PREFETCH", next(), 1);   // read at load
        else if (a == "--moecached-vram") setenv("LLAMA_MOECACHED_VRAM", next(), 1);   // read at load
        else if (a == "--moecached-vram-lookup") setenv("LLAMA_MOECACHED_VRAM_LOOKUP", next(), 1);   // read at load
        else { fprintf(stderr, "mc-decode: unknown argument %s\n%s", a.c_str(), USAGE); return 2; }
    }
    if (model_path.empty()) { fprintf(stderr, "mc-decode: -m MODEL is required\n%s", USAGE); return 2; }

    // warnings, errors and moecached's lines; everything with GGML_SCHED_DEBUG (the graph splits)
    static const bool all_logs = getenv("GGML_SCHED_DEBUG") != nullptr;
    llama_log_set([](ggml_log_level level, const char * text, void *) {
        if (all_logs || level >= GGML_LOG_LEVEL_WARN || strstr(text, "moecached")) fputs(text, stderr);
    }, nullptr);
    llama_backend_init();
    if (!endpoint.empty() && llama_moecached_set_endpoint(endpoint.c_str()) != 0) {
        fprintf(stderr, "mc-decode: this llama.cpp has no libmoecache\n");
        return 2;
    }
    llama_model_params mp = llama_model_default_params();
    mp.use_extra_bufts = false;
    // --cpu-moe: as common/arg.cpp's (llm_ffn_exps_cpu_override: LLM_FFN_EXPS_REGEX to the CPU
    // buffer type); with --moecached the file's experts are not read either way, and this keeps a
    // GPU build from copying them to the device
    const llama_model_tensor_buft_override cpu_moe_ovr[] = {
        {"\\.ffn_(up|down|gate|gate_up)_(ch|)exps", ggml_backend_cpu_buffer_type()},
        {nullptr, nullptr},
    };
    if (cpu_moe) mp.tensor_buft_overrides = cpu_moe_ovr;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mp);
    if (!model) { fprintf(stderr, "mc-decode: cannot load %s\n", model_path.c_str()); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    const int n_prompt = -llama_tokenize(vocab, prompt.c_str(), prompt.size(), NULL, 0, true, true);
    std::vector<llama_token> toks(n_prompt);
    llama_tokenize(vocab, prompt.c_str(), prompt.size(), toks.data(), toks.size(), true, true);

    FILE * fd = dump.empty() ? nullptr : fopen(dump.c_str(), "wb");
    if (!dump.empty() && !fd) { fprintf(stderr, "mc-decode: cannot write %s\n", dump.c_str()); return 1; }

    FILE * fmoe = dump_moe_path.empty() ? nullptr : fopen(dump_moe_path.c_str(), "w");
    if (!dump_moe_path.empty() && !fmoe) { fprintf(stderr, "mc-decode: cannot write %s\n", dump_moe_path.c_str()); return 1; }

    double t_prompt = 0, t_decode = 0;
    int n_decoded = 0;
    // the tier's counters over the decode steps only (the prompts' are the rest): one snapshot of the
    // vram line before and one after each step, the differences summed per key and printed as decode_KEY
    static const char * const DECODE_KEYS[] = {"hits", "misses", "copied_bytes", "spec_copies", "reruns", "copy_syncs",
                                               "arena_reads", "arena_read_bytes", "host_us", "wait_us", "fill_us",
                                               "stage_copies", "stage_hits", "stage_bytes"};
    const size_t n_keys = sizeof DECODE_KEYS / sizeof DECODE_KEYS[0];
    // and the served blocks' host ops over the decode steps, from the moecached line the same way
    static const char * const DECODE_OP_KEYS[] = {"acquires", "acquire_us", "ops", "op_us"};
    const size_t n_op_keys = sizeof DECODE_OP_KEYS / sizeof DECODE_OP_KEYS[0];
    auto values = [](const char * line, const char * const * keys, size_t n, unsigned long long * out) {
        for (size_t i = 0; i < n; ++i) {
            const std::string key = std::string(" ") + keys[i] + "=";
            const char * p = strstr(line, key.c_str());
            out[i] = p ? strtoull(p + key.size(), nullptr, 10) : 0;
        }
    };
    auto snapshot = [&](std::vector<unsigned long long> & out) {
        char b[2048] = " ";
        llama_moecached_vram_stats(b + 1, sizeof b - 1);
        values(b, DECODE_KEYS, n_keys, out.data());
        llama_moecached_stats(b + 1, sizeof b - 1);
        values(b, DECODE_OP_KEYS, n_op_keys, out.data() + n_keys);
    };
    std::vector<unsigned long long> dec(n_keys + n_op_keys, 0), before(dec.size()), after(dec.size());
    std::vector<double> step_s;   // every decode step's time, for the quantiles on the timing line
    for (int round = 0; round < rounds; ++round) {
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = n_prompt + n_steps + 8;
        cp.n_batch = n_prompt;
        cp.n_ubatch = std::min(n_ubatch, n_prompt);
        cp.n_threads = n_threads;
        cp.n_threads_batch = n_threads;
        cp.no_perf = true;
        if (fmoe && round == 0) {
            cp.cb_eval = dump_moe;
            cp.cb_eval_user_data = fmoe;
        }
        llama_context * ctx = llama_init_from_model(model, cp);
        if (!ctx) { fprintf(stderr, "mc-decode: cannot create a context\n"); return 1; }

        auto decode = [&](llama_batch b) -> bool {
            for (int attempt = 0;; ++attempt) {
                const int rc = llama_decode(ctx, b);
                if (rc == 0) return true;
                const char * e = llama_moecached_error();
                // (-3: a failure no retry mends, e.g. the daemon now serves another model file)
                const bool again = e && rc == 2 && attempt < retries;
                if (again) {
                    fprintf(stderr, "moecached error: %s (llama_decode returned %d); retry %d of %d in 500 ms\n", e, rc,
                            attempt + 1, retries);
                } else {
                    fprintf(stderr, "moecached error: %s (llama_decode returned %d)\n", e ? e : "none", rc);
                }
                if (!again) return false;
                std::this_thread::sleep_for(std::chrono::milliseconds(500));
            }
        };
        auto emit = [&](int step, const float * logits) -> llama_token {
            llama_token best = 0;
            for (int v = 1; v < n_vocab; ++v) if (logits[v] > logits[best]) best = v;
            if (fd && round == 0) fwrite(logits, sizeof(float), n_vocab, fd);
            if (round == 0) printf("step %d token %d\n", step, best);
            return best;
        };

        const double tp0 = t_prompt, td0 = t_decode;
        const int nd0 = n_decoded;
        double t0 = now_s();
        if (!decode(llama_batch_get_one(toks.data(), n_prompt))) return 3;
        llama_synchronize(ctx);   // llama_decode may return before a GPU has computed the logits
        t_prompt += now_s() - t0;
        llama_token tok = emit(0, llama_get_logits_ith(ctx, -1));
        for (int s = 1; s <= n_steps; ++s) {
            if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
            if (!endpoint.empty()) snapshot(before);
            t0 = now_s();
            if (!decode(llama_batch_get_one(&tok, 1))) return 3;
            llama_synchronize(ctx);
            step_s.push_back(now_s() - t0);
            t_decode += step_s.back();
            if (!endpoint.empty()) {
                snapshot(after);
                for (size_t i = 0; i < dec.size(); ++i) dec[i] += after[i] - before[i];
            }
            n_decoded++;
            tok = emit(s, llama_get_logits_ith(ctx, -1));
        }
        // this round alone (with --rounds, the later rounds find the VRAM tier as the earlier ones left it)
        printf("round %d prompt_s=%.6f decode_tokens=%d decode_s=%.6f graphs_reused=%d\n", round, t_prompt - tp0,
               n_decoded - nd0, t_decode - td0, llama_perf_context(ctx).n_reused);
        llama_free(ctx);
    }
    if (fd) fclose(fd);
    if (fmoe) fclose(fmoe);
    char st[512];
    llama_moecached_stats(st, sizeof st);
    // the decode steps' times: lower decile, median, upper decile (a step that something else on the
    // machine slowed moves the mean, rarely the median)
    std::vector<double> q = step_s;
    std::sort(q.begin(), q.end());
    auto quant = [&](double f) { return q.empty() ? 0.0 : q[(size_t) (f * (q.size() - 1) + 0.5)] * 1e6; };
    printf("timing prompt_tokens=%d prompt_s=%.6f decode_tokens=%d decode_s=%.6f rounds=%d step_us_p10=%.1f step_us_p50=%.1f "
           "step_us_p90=%.1f\n", n_prompt * rounds, t_prompt, n_decoded, t_decode, rounds, quant(0.1), quant(0.5), quant(0.9));
    if (endpoint.empty()) {
        printf("moecached off\n");
    } else {
        printf("moecached %s", st);
        for (size_t i = 0; i < n_op_keys; ++i) printf(" decode_%s=%llu", DECODE_OP_KEYS[i], dec[n_keys + i]);
        printf("\n");
    }
    if (!endpoint.empty()) {
        char pf[512];
        llama_moecached_prefetch_stats(pf, sizeof pf);
        printf("prefetch %s\n", pf);
        char vr[2048];
        llama_moecached_vram_stats(vr, sizeof vr);
        printf("vram %s", vr);
        for (size_t i = 0; i < n_keys; ++i) printf(" decode_%s=%llu", DECODE_KEYS[i], dec[i]);
        printf("\n");
    }
    fflush(stdout);
    llama_model_free(model);
    return 0;
}
