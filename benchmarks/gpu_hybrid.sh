#!/usr/bin/env bash
# The hybrid path on a CUDA machine: a CUDA build of the patched llama.cpp with every layer
# offloaded, the routed experts taken from the daemon's arena, against llama.cpp's own runs.
# From the project's root on the GPU machine (carry .whl and .dev: ../shared/device/README.md):
#
#   bash benchmarks/gpu_hybrid.sh OUT_DIR [build|measure|test|all] [BLOCKS] [STEPS]
#
# build:   the CUDA build (the kit's setup.sh; FlashAttention kernels off to save build time),
#          a synth --runnable model of the Qwen3-30B-A3B expert geometry (BLOCKS blocks, Q8_0;
#          written while the build runs), llama-bench decode all on the GPU and with
#          -ot exps=CPU (repacked and not), the latter left to the measure phase when the build
#          phase has run 8 minutes
# measure: mc-decode, STEPS greedy steps, 8 threads, ROUNDS (default 4) interleaved rounds, the
#          first a warm-up; the daemon holds every expert. Rows (RUNGS, default all):
#            gpu      resident, every layer on the GPU
#            cpu_moe  resident, --cpu-moe: the experts' tensors on the CPU (-ot exps=CPU, no repack)
#            rung1    --moecached --cpu-moe: the expert matmuls on the CPU over the arena
#            rung2    --moecached --cpu-moe --moecached-gpu zerocopy: on the GPU, reading the
#                     arena (registered with CUDA) over the host link
#            rung3_P  (P = 10, 25, 50, 100) rung 2 plus --moecached-vram P% with
#                     --moecached-vram-lookup host: a tier of P % of the served experts in VRAM,
#                     filled from the arena, looked up by a host op per block; the block's
#                     matmuls read the tier (a prompt that can need more experts than the tier
#                     holds runs as rung 2); per row also the tier's hits, misses, bytes copied
#                     to the device per decoded token (and per token overall) and the VRAM it takes
#            rung3_Ppin  (P = 10, 25, 50) rung3_P with the arena registered with CUDA for the
#                     tier's copies (LLAMA_MOECACHED_VRAM_PINNED=1; matters without zerocopy)
#            rung4_P  (P = 10, 25, 50, 100) the same tier looked up on the device
#                     (--moecached-vram-lookup auto, the default: a table per block in VRAM, no
#                     host op in a decoded token's graph; a token that met a missing expert is
#                     computed again after the host copied it in; auto starts on the host lookup
#                     and goes to the device once decoded tokens stop copying); per row also the
#                     passes run again, the reads of the routed ids and the switches, and the
#                     host's time in the lookup per decoded token (its waits for the graph apart)
#            rung4_Pa50  (P = 25, 50) rung4_P against a second daemon whose arena holds 50 % of
#                     the experts (--slots blocks*experts//2, its socket /tmp/gpu-hybrid-a50.sock,
#                     started only for these rows; the other daemon rows share one of --slots
#                     blocks*experts): the tier's misses that the arena lacks wait on the daemon's
#                     drive reads too
#            rung5_P  (P = 10, 25, 50, 100) the device lookup reading what the tier lacks from the
#                     arena in place (--moecached-vram-lookup arena: ids past the tier's slots name
#                     arena slots, registered with CUDA; no pass run again while the arena holds the
#                     expert; copied into the tier after the token); rung5_25a50 over the 50 % arena
#            rung4_Pall, rung5_Pall  (P = 10, 25, 50) the same rows with every in-place read
#                     copied into the tier (LRU; the default copies one used more often than the one
#                     it evicts)
#            rung4_Pnow, rung5_Pnow, rung4_Poff, rung5_Poff, rung4_Ppg, rung5_Ppg  (P = 10, 25, 50) the
#                     same rows with the in-place reads' copies into the tier made on the tier's
#                     stream before the next token (now), never made (off), or made before the next
#                     token with the routing record and tables in pageable memory (pg: the build
#                     before the fill stream); the default copies them on a second stream while the
#                     next token runs (LLAMA_MOECACHED_VRAM_FILL, clients/llama.cpp/README.md)
#            rung4_Pstg, rung4_Pstgk, rung4_Pstg3k, rung4_Pnostg (and rung5_...)  (P = 10, 25, 50) the
#                     same rows with block l+1's guessed experts copied ahead into the tier's
#                     staging slots while block l runs (LLAMA_MOECACHED_VRAM_STAGE=next), guessing
#                     twice (the default width), once or three times the top-k, or with none copied
#                     ahead (STAGE=off; the default, auto, stages where a block's guess is at most
#                     1 MiB); the table's "copied ahead / found there" column counts them
#            rung5_100w  rung5_100 over two rounds in one process, the second round's figures
#                     (rung5_100wnostg: without copies ahead)
#            rung4_100w  rung4_100 over two rounds in one process (--rounds 2), the second
#                     round's figures: every expert its tokens need is in the tier already
#            rung4_100x2 two engines at once (two processes), each rung4_100w with its own
#                     tier, on one daemon: each one's decode, both logits against gpu, and a
#                     fresh daemon's reads for the pair (each expert read once for both)
#          then the H2D rate from pinned memory (PyTorch, the same run) and, per tier row, the
#          ceiling its copies allow (resident time per token + MiB copied per decoded token / H2D)
#          and the row's share of it (the ceiling takes every miss from the arena: the rows with a
#          50 % arena also wait on the drive reads of the experts their arena lacks); the device
#          lookup's cost per MoE block (rung4_100w against gpu);
#          then the logits of each pair: max |diff|, identical rows, greedy tokens identical
#          (rung 1 against cpu_moe: 0 and all expected; rungs 2 and 3 against gpu: the same
#          kernels over the same bytes), and one decode step of each daemon row with
#          GGML_SCHED_DEBUG (its graph splits)
#          Rung 3 with its references (gpu for the logits, rung2 for the speed without the tier),
#          once the build phase has run:
#            RUNGS=gpu,rung2,rung3_10,rung3_25,rung3_50,rung3_100 bash benchmarks/gpu_hybrid.sh OUT measure
#          Rung 4 against rung 3:
#            RUNGS=gpu,rung3_100,rung4_10,rung4_25,rung4_50,rung4_100,rung4_100w bash benchmarks/gpu_hybrid.sh OUT measure
# test:    the build, then tests/test_llama_gpu.py on it (zerocopy and the VRAM tier against the
#          all-on-the-GPU logits, a daemon restart under both; the GPU machine has pytest; the
#          trained model of benchmarks/models travels with the tree): its output in OUT_DIR/test.txt
# BACKEND=vulkan (environment): the same phases on the Vulkan backend (the kit's headers, loader
#          and glslc from .dev/vulkan: clients/llama.cpp/vulkan-kit.sh .dev/vulkan on the 2-core
#          machine, carried with .dev; the machine's own ICD, nvidia*.json where it has one, made
#          to name libEGL_nvidia.so.0 for a machine without a display, else VK_ICD_FILENAMES):
#          the rows without zero-copy (the tier's misses are copied from the arena); the test
#          phase is CUDA's only; a build tree made without the kit's glslc is to be removed first
# MODEL=PATH (environment): that GGUF instead of the synth one (its blocks, experts and top-k read
#          from it; BLOCKS then only names the run), PROMPT_FILE=PATH: the prompt, its first 300
#          characters (a trained model's held-out text: routing with locality), e.g.
#            MODEL=benchmarks/models/qwen3moe-stdlib-8x32-q8_0.gguf PROMPT_FILE=benchmarks/models/qwen3moe-stdlib-heldout.txt ZEROCOPY=0
#          (ZEROCOPY=0: the rows without --moecached-gpu zerocopy, which refuses expert rows that are
#          not whole chunks of 256 elements, as the trained model's 64-element ones)
# all:     build and measure (one call, when the machine is warm enough). Each phase is idempotent: a warm
#          machine keeps the build (/tmp/llama), the model and the llama-bench results
#          (/tmp/gpu-hybrid) between calls, and both phases copy what exists into OUT_DIR:
#   log.txt, setup.log, bench_gpu.json, bench_exps_cpu.json, rungs.json, rungs.md, sched.txt
set -uo pipefail
OUT=${1:?usage: gpu_hybrid.sh OUT_DIR [build|measure|test|all] [BLOCKS] [STEPS]}
PHASE=${2:-all}; BLOCKS=${3:-4}; STEPS=${4:-64}
case "$PHASE" in build|measure|all|test) ;; *) echo "gpu_hybrid.sh: phase $PHASE: expected build, measure, test or all" >&2; exit 2 ;; esac
mkdir -p "$OUT"
KEEP=/tmp/gpu-hybrid; mkdir -p "$KEEP"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/log.txt"; }
SETUP=../shared/device/setup.sh   # the GPU machine's kit; a copy in .dev/ when ../shared does not travel
[ -f "$SETUP" ] || SETUP=.dev/setup.sh
# the model is written while llama.cpp builds (the kit installs the same wheels the same way)
M=${MODEL:-$KEEP/model-$BLOCKS.gguf}
[ -n "${MODEL:-}" ] && [ ! -f "$M" ] && { echo "gpu_hybrid.sh: MODEL $M: no such file"; exit 2; }
if [ -n "${MODEL:-}" ]; then KEEP=$KEEP/$(basename "$M" .gguf); mkdir -p "$KEEP"; fi   # its own llama-bench results
if [ ! -f "$M" ]; then
    if [ ! -f /tmp/site/.done ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.done
    fi
    ( PYTHONPATH=$PWD:$PWD/clients/python:/tmp/site python3 -m moecached.tools.ctl synth --runnable --out "$M.part" \
          --geometry qwen3-30b-a3b --blocks "$BLOCKS" --quant q8_0 > "$KEEP/synth.log" 2>&1 && mv "$M.part" "$M" ) &
    SYNTH=$!
fi
# GGML_CUDA_FA=OFF on the first configure only (the kit's cmake line has no room for it): CMake
# reads a toolchain file named in the environment when it creates a build tree. BACKEND=vulkan:
# the kit's CPU build tree made a Vulkan one the same way, with the headers, loader and glslc of
# .dev/vulkan (clients/llama.cpp/vulkan-kit.sh .dev/vulkan, on the 2-core machine)
export BACKEND=${BACKEND:-cuda}
mkdir -p "$KEEP/$BACKEND"   # llama-bench's results, per backend
if [ "$BACKEND" = vulkan ]; then
    [ -f .dev/vulkan/vulkan.cmake ] || { echo "gpu_hybrid.sh: no .dev/vulkan (run clients/llama.cpp/vulkan-kit.sh .dev/vulkan first)"; exit 1; }
    printf 'include("%s/.dev/vulkan/vulkan.cmake")\nset(GGML_VULKAN ON CACHE BOOL "gpu_hybrid.sh")\n' "$PWD" > "$KEEP/toolchain.cmake"
    . .dev/vulkan/env.sh
    if [ -z "${VK_ICD_FILENAMES:-}" ]; then   # the GPU's driver: its ICD file, where the machine has one
        icd=$(ls /usr/share/vulkan/icd.d/nvidia*.json /etc/vulkan/icd.d/nvidia*.json /usr/share/glvnd/egl_vendor.d/../../vulkan/icd.d/nvidia*.json 2>/dev/null | head -1)
        [ -n "$icd" ] && export VK_ICD_FILENAMES=$icd
        # NVIDIA's ICD file names libGLX_nvidia.so.0, which finds no device without a display
        # ("Could not get 'vkCreateInstance' via 'vk_icdGetInstanceProcAddr'" on the headless
        # H200); the same driver's EGL library does: an ICD file naming it, the same API version
        if [ -n "$icd" ] && grep -q libGLX_nvidia "$icd" && ldconfig -p | grep -q 'libEGL_nvidia.so.0 '; then
            sed 's/libGLX_nvidia\.so\.0/libEGL_nvidia.so.0/' "$icd" > "$KEEP/nvidia_egl_icd.json"
            export VK_ICD_FILENAMES=$KEEP/nvidia_egl_icd.json
        fi
    fi
    say "Vulkan ICD: ${VK_ICD_FILENAMES:-none found, the loader defaults}"
    kit=cpu
else
    printf 'set(GGML_CUDA_FA OFF CACHE BOOL "gpu_hybrid.sh: no FlashAttention kernels (build time)")\n' > "$KEEP/toolchain.cmake"
    kit=cuda
fi
export CMAKE_TOOLCHAIN_FILE=$KEEP/toolchain.cmake
set +u   # (the kit is sourced: its variables stay in this shell)
# shellcheck disable=SC1090
. "$SETUP" $kit > "$OUT/setup.log" 2>&1 || { tail -30 "$OUT/setup.log"; exit 1; }
set -u
unset CMAKE_TOOLCHAIN_FILE
# shellcheck disable=SC1091
[ "$BACKEND" = vulkan ] && . .dev/vulkan/env.sh   # the kit's loader again (the kit's setup.sh sets LD_LIBRARY_PATH)
BIN=/tmp/llama/build-$kit/bin
say "built: $(tail -1 "$OUT/setup.log") ($(grep -o 'GGML_CUDA_FA:BOOL=[A-Z]*\|GGML_VULKAN:BOOL=[A-Z]*' /tmp/llama/build-$kit/CMakeCache.txt))"
[ -n "${SYNTH:-}" ] && { wait "$SYNTH" || { tail -5 "$KEEP/synth.log"; exit 1; }; }
say "model $M: $(du -h "$M" | cut -f1)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$OUT/log.txt" 2>&1

if [ "$PHASE" = test ] && [ "$BACKEND" = vulkan ]; then
    say "the test phase runs tests/test_llama_gpu.py, which is CUDA's (zero-copy); BACKEND=vulkan has none"
    exit 2
fi
if [ "$PHASE" = test ]; then
    MOECACHED_LLAMA_CUDA_BIN=$BIN TMPDIR=/tmp python3 -m pytest -q -p no:cacheprovider -rs tests/test_llama_gpu.py \
        > "$OUT/test.txt" 2>&1
    rc=$?
    say "tests/test_llama_gpu.py: exit $rc: $(tail -1 "$OUT/test.txt")"
    exit $rc
fi

# llama-bench rows, in whichever call has the time (the build phase stops at 8 minutes)
if [ "$PHASE" != build ] || [ $(( $(date +%s) - t0 )) -lt 480 ]; then
    [ -s "$KEEP/$BACKEND/bench_gpu.json" ] || "$BIN/llama-bench" -m "$M" -ngl 99 -p 0 -n "$STEPS" -t 8 -r 3 -o json \
        > "$KEEP/$BACKEND/bench_gpu.json" 2>> "$OUT/log.txt"
    say "llama-bench all on the GPU done"
fi
if [ "$PHASE" != build ] || [ $(( $(date +%s) - t0 )) -lt 500 ]; then
    [ -s "$KEEP/$BACKEND/bench_exps_cpu.json" ] || "$BIN/llama-bench" -m "$M" -ngl 99 -ot exps=CPU --repack 1,0 -p 0 \
        -n "$STEPS" -t 8 -r 3 -o json > "$KEEP/$BACKEND/bench_exps_cpu.json" 2>> "$OUT/log.txt"
    say "llama-bench -ot exps=CPU done"
fi
cp "$KEEP/$BACKEND"/bench_*.json "$OUT/" 2>/dev/null

if [ "$PHASE" != build ]; then
    PYTHONUNBUFFERED=1 python3 - "$BIN" "$M" "$OUT" "$BLOCKS" "$STEPS" "${ROUNDS:-4}" "${RUNGS:-gpu,cpu_moe,rung1,rung2}" \
        <<'EOF' 2>&1 | tee -a "$OUT/log.txt"
import json, os, re, statistics, subprocess, sys, time
import numpy as np
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "benchmarks")]
from benchutil import start_daemon, stop_daemon
bin_dir, model, out, blocks, steps, rounds, want = sys.argv[1:8]
blocks, steps, rounds, want = int(blocks), int(steps), int(rounds), want.split(",")
PROMPT = ("Mixture-of-experts models keep most of their weights in routed experts; a shared "
          "daemon caches them for every engine on the machine.")   # benchmarks/engine.py's
if os.environ.get("PROMPT_FILE"):
    PROMPT = open(os.environ["PROMPT_FILE"], encoding="utf-8", errors="replace").read()[:300]
THREADS = 8
def _geometry(path):
    """(blocks, experts, top-k) of the model, from its GGUF metadata."""
    import gguf
    r = gguf.GGUFReader(path)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    val = lambda k: int(r.fields[f"{arch}.{k}"].parts[-1][0])
    return val("block_count"), val("expert_count"), val("expert_used_count")
blocks, N_EXPERTS, TOP_K = _geometry(model)
# name: (what, mc-decode arguments, environment, arena): arena None for a resident row, else the
# share of all experts its daemon's arena holds (one daemon per share, its socket in SOCKS)
ROWS = {
    "gpu": ("resident, every layer on the GPU", [], {}, None),
    "cpu_moe": ("resident, --cpu-moe (experts on the CPU, no repack)", ["--cpu-moe"], {}, None),
    "rung1": ("--moecached --cpu-moe: experts computed on the CPU from the arena (rung 1)", ["--cpu-moe"], {}, 1.0),
    "rung2": ("--moecached --cpu-moe --moecached-gpu zerocopy: experts on the GPU over the host link (rung 2)",
              ["--cpu-moe", "--moecached-gpu", "zerocopy"], {}, 1.0),
}
for pct in (10, 25, 50, 100):
    ROWS[f"rung3_{pct}"] = (f"rung 2 + --moecached-vram {pct}% --moecached-vram-lookup host: a tier of {pct} % of the experts "
                            f"in VRAM, looked up by a host op per block (rung 3)",
                            ["--cpu-moe", "--moecached-gpu", "zerocopy", "--moecached-vram", f"{pct}%",
                             "--moecached-vram-lookup", "host"], {}, 1.0)
    ROWS[f"rung4_{pct}"] = (f"rung 2 + --moecached-vram {pct}% (lookup auto): the tier looked up on the device (rung 4)",
                            ["--cpu-moe", "--moecached-gpu", "zerocopy", "--moecached-vram", f"{pct}%",
                             "--moecached-vram-lookup", "auto"], {}, 1.0)
for pct in (10, 25, 50):   # the tier's copies from an arena registered with CUDA (opt-in)
    ROWS[f"rung3_{pct}pin"] = (ROWS[f"rung3_{pct}"][0] + ", the arena registered with CUDA for the copies (LLAMA_MOECACHED_VRAM_PINNED=1)",
                               ROWS[f"rung3_{pct}"][1], {"LLAMA_MOECACHED_VRAM_PINNED": "1"}, 1.0)
for pct in (10, 25, 50, 100):   # what the tier lacks read from the arena in place
    ROWS[f"rung5_{pct}"] = (f"rung 2 + --moecached-vram {pct}% --moecached-vram-lookup arena: the device lookup, the tier's "
                            f"misses read from the arena in place (rung 4 without the second pass)",
                            ["--cpu-moe", "--moecached-gpu", "zerocopy", "--moecached-vram", f"{pct}%",
                             "--moecached-vram-lookup", "arena"], {}, 1.0)
ROWS["rung5_25a50"] = (ROWS["rung5_25"][0] + ", its daemon's arena 50 % of the experts", ROWS["rung5_25"][1], {}, 0.5)
FILLS = {"now": ("the copies into the tier on the tier's stream before the next token (LLAMA_MOECACHED_VRAM_FILL=now)",
                 {"LLAMA_MOECACHED_VRAM_FILL": "now"}),
         "off": ("no copies into the tier (LLAMA_MOECACHED_VRAM_FILL=off)", {"LLAMA_MOECACHED_VRAM_FILL": "off"}),
         "pg": ("the copies before the next token and the routing record and tables in pageable memory "
                "(LLAMA_MOECACHED_VRAM_FILL=now LLAMA_MOECACHED_VRAM_IO_PINNED=0)",
                {"LLAMA_MOECACHED_VRAM_FILL": "now", "LLAMA_MOECACHED_VRAM_IO_PINNED": "0"}),
         "all": ("every expert read in place copied into the tier, least recently used evicted (LLAMA_MOECACHED_VRAM_ADMIT=all)",
                 {"LLAMA_MOECACHED_VRAM_ADMIT": "all"}),
         "stg": ("block l+1's guessed experts copied ahead into the tier while block l runs (LLAMA_MOECACHED_VRAM_STAGE=next, "
                 "twice the top-k)", {"LLAMA_MOECACHED_VRAM_STAGE": "next"}),
         "nostg": ("no guessed experts copied ahead (LLAMA_MOECACHED_VRAM_STAGE=off; auto stages experts of a guess of at "
                   "most 1 MiB)", {"LLAMA_MOECACHED_VRAM_STAGE": "off"}),
         "stgk": ("block l+1's top-k guess copied ahead (LLAMA_MOECACHED_VRAM_STAGE=next, LLAMA_MOECACHED_VRAM_STAGE_WIDTH=top-k)",
                  {"LLAMA_MOECACHED_VRAM_STAGE": "next", "LLAMA_MOECACHED_VRAM_STAGE_WIDTH": str(TOP_K)}),
         "stg3k": ("block l+1's guess of three times the top-k copied ahead (LLAMA_MOECACHED_VRAM_STAGE=next, "
                   "LLAMA_MOECACHED_VRAM_STAGE_WIDTH=3 x top-k)",
                   {"LLAMA_MOECACHED_VRAM_STAGE": "next", "LLAMA_MOECACHED_VRAM_STAGE_WIDTH": str(3 * TOP_K)})}
for pct in (10, 25, 50):   # rung5_Pnow, rung5_Poff, rung5_Ppg (and rung4_P...: auto, which takes the arena lookup for small experts)
    for rung in ("rung4", "rung5"):
        for tag, (what, env) in FILLS.items():
            ROWS[f"{rung}_{pct}{tag}"] = (ROWS[f"{rung}_{pct}"][0] + ", " + what, ROWS[f"{rung}_{pct}"][1], env, 1.0)
for pct in (25, 50):   # the same tier over an arena of half the experts (its misses read from the drive)
    ROWS[f"rung4_{pct}a50"] = (ROWS[f"rung4_{pct}"][0] + ", its daemon's arena 50 % of the experts",
                               ROWS[f"rung4_{pct}"][1], {}, 0.5)
ROWS["rung4_100w"] = ("rung4_100, the second of two rounds in one process: the tier already holds every expert (rung 4)",
                      ["--cpu-moe", "--moecached-gpu", "zerocopy", "--moecached-vram", "100%", "--moecached-vram-lookup",
                       "auto", "--rounds", "2"], {}, 1.0)
ROWS["rung5_100w"] = ("rung5_100, the second of two rounds in one process: the tier already holds every expert, looked up "
                      "with the in-place reads on", ROWS["rung5_100"][1] + ["--rounds", "2"], {}, 1.0)
ROWS["rung5_100wnostg"] = (ROWS["rung5_100w"][0] + ", no guessed experts copied ahead (LLAMA_MOECACHED_VRAM_STAGE=off)",
                          ROWS["rung5_100w"][1], {"LLAMA_MOECACHED_VRAM_STAGE": "off"}, 1.0)
TWO = "rung4_100x2"   # two processes at once, each its own tier over one arena
ROWS[TWO] = ("two engines at once (two processes) on one daemon, each rung4_100w with its own tier (the first one's figures)",
             ROWS["rung4_100w"][1], {}, 1.0)
if os.environ.get("BACKEND") == "vulkan" or os.environ.get("ZEROCOPY") == "0":
    # no zero-copy (Vulkan; ZEROCOPY=0: a model whose expert rows CUDA's kernels cannot read in
    # place, e.g. the trained one's 64-element rows): the tier's misses are copied from the arena
    for k, (w, a, e, arena) in list(ROWS.items()):
        if "zerocopy" in a:
            i = a.index("--moecached-gpu")
            ROWS[k] = (w.replace("rung 2 + ", "--cpu-moe + "), a[:i] + a[i + 2:], e, arena)
PAIRS = [("cpu_moe", "rung1"), ("gpu", "rung2"), ("gpu", "cpu_moe"), ("rung1", "rung2"),
         ("gpu", "rung3_10"), ("gpu", "rung3_25"), ("gpu", "rung3_50"), ("gpu", "rung3_100"),
         ("gpu", "rung4_10"), ("gpu", "rung4_25"), ("gpu", "rung4_50"), ("gpu", "rung4_100"), ("gpu", "rung4_100w"), ("gpu", TWO),
         ("gpu", "rung4_25a50"), ("gpu", "rung4_50a50"), ("gpu", "rung3_10pin"), ("gpu", "rung3_25pin"), ("gpu", "rung3_50pin"),
         ("gpu", "rung5_10"), ("gpu", "rung5_25"), ("gpu", "rung5_50"), ("gpu", "rung5_100"), ("gpu", "rung5_100w"), ("gpu", "rung5_25a50")]
PAIRS += [("gpu", r) for r in ROWS if any(r.endswith(tag) for tag in FILLS)]
rows = [r for r in want if r in ROWS]
SOCKS = {1.0: "/tmp/gpu-hybrid.sock", 0.5: "/tmp/gpu-hybrid-a50.sock"}   # per arena share, its daemon's socket
work = "/tmp/gpu-hybrid/runs"; os.makedirs(work, exist_ok=True)

def pair(name, dump, rnd, endpoint, extra_env=None, n=steps):
    """Two engines of row ``name`` at once against ``endpoint``: the first's (res, run), the
    second's figures in res["b"] (its logits in DUMP-b.bin)."""
    import threading
    got = {}
    th = threading.Thread(target=lambda: got.update(
        b=decode(name, dump and dump[:-4] + "-b.bin", rnd, extra_env, n, endpoint)))
    th.start()
    res, r = decode(name, dump, rnd, extra_env, n, endpoint)
    th.join()
    res["b"] = got["b"][0]
    return res, r

def decode(name, dump, rnd, extra_env=None, n=steps, endpoint=None):
    if name == TWO and endpoint is None:   # the pair: two processes at once
        return pair(name, dump, rnd, SOCKS[ROWS[name][3]], extra_env, n)
    what, args, env, arena = ROWS[name]
    cmd = [f"{bin_dir}/mc-decode", "-m", model, "-p", PROMPT, "-n", str(n), "-t", str(THREADS), *args]
    if dump:
        cmd += ["--dump", dump]
    if arena:
        cmd += ["--moecached", f"ipc://{endpoint or SOCKS[arena]}"]
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **env, **(extra_env or {})), timeout=300)
    res = {"rc": r.returncode, "wall_s": time.time() - t}
    if r.returncode != 0:
        res["error"] = (r.stdout + r.stderr)[-3000:]
        return res, r
    m = re.search(r"timing prompt_tokens=(\d+) prompt_s=([\d.]+) decode_tokens=(\d+) decode_s=([\d.]+)", r.stdout)
    res["prompt_tps"] = int(m.group(1)) / float(m.group(2))
    res["decode_tps"] = int(m.group(3)) / float(m.group(4))
    rr = re.findall(r"^round (\d+) prompt_s=([\d.]+) decode_tokens=(\d+) decode_s=([\d.]+)", r.stdout, re.M)
    if "--rounds" in args and rr:   # the last round alone
        res["prompt_tps"] = (int(m.group(1)) / len(rr)) / float(rr[-1][1])
        res["decode_tps"] = int(rr[-1][2]) / float(rr[-1][3])
    res["tokens"] = [int(x) for x in re.findall(r"^step \d+ token (\d+)$", r.stdout, re.M)]
    s = re.search(r"^moecached (acquires=.*)$", r.stdout, re.M)
    res["stats"] = {k: int(v) for k, v in (kv.split("=") for kv in s.group(1).split())} if s else {}
    v = re.search(r"^vram (slots=.*)$", r.stdout, re.M)
    res["vram"] = {k: int(x) if x.isdigit() else x for k, x in (kv.split("=") for kv in v.group(1).split())} if v else {}
    res["prompt_tokens"], res["decode_tokens"] = int(m.group(1)), int(m.group(3))
    return res, r

def h2d_bandwidth(nbytes=256 << 20, reps=8):
    """Bytes/s of a copy from pinned host memory to the GPU (the tier's fills come from the
    arena registered with CUDA), median of reps; None without PyTorch's CUDA."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            t = time.perf_counter(); dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        return nbytes / statistics.median(ts)
    except Exception as ex:   # no torch, no device: the ceiling column says so
        print(f"h2d bandwidth not measured: {ex}", flush=True)
        return None

results = {"model": os.path.basename(model), "blocks": blocks, "experts": N_EXPERTS, "top_k": TOP_K, "steps": steps,
           "threads": THREADS, "rounds": rounds, "prompt_bytes": len(PROMPT), "rows": {}, "pairs": [], "sched": {}}
results["h2d_bytes_per_s"] = h2d_bandwidth()
runs = {r: [] for r in rows}
daemons = {}   # arena share: its daemon, started for the shares the rows need
try:
    for share in sorted({ROWS[r][3] for r in rows if ROWS[r][3]}, reverse=True):
        daemons[share] = start_daemon(model, SOCKS[share], "--slots", str(int(blocks * N_EXPERTS * share)))
    for rnd in range(rounds):
        for name in rows:
            res, _ = decode(name, f"{work}/{name}-{rnd}.bin", rnd)
            runs[name].append(res)
            print(f"round {rnd} {name}: " + (f"decode {res['decode_tps']:.1f} tok/s, prompt {res['prompt_tps']:.1f} tok/s"
                                            if res["rc"] == 0 else f"FAILED rc {res['rc']}: {res['error'][-600:]}"), flush=True)
    for name in rows:   # one decode step with the scheduler's debug output: its splits
        if ROWS[name][3] and name != TWO:
            res, r = decode(name, None, 0, {"GGML_SCHED_DEBUG": "2"}, n=1)
            text = r.stdout + r.stderr
            # every graph the scheduler split in the run (reserved, prompt, decode step), and the last
            # one's alone: the decode step's graph
            last = text.rsplit("## SPLIT #0:", 1)
            last_splits = ("## SPLIT #0:" + last[1]).count("## SPLIT #") if len(last) == 2 else 0
            results["sched"][name] = {"splits": text.count("## SPLIT #"), "decode_graph_splits": last_splits, "rc": r.returncode}
            with open(f"{out}/sched.txt", "a") as f:
                f.write(f"==== {name}: splits {text.count('## SPLIT #')}, the decode step's graph {last_splits}, "
                        f"rc {r.returncode}\n{text[-150000:]}\n")
    if TWO in rows:   # the pair against a fresh daemon: what the arena read for both
        stop_daemon(daemons.pop(1.0))
        sock2 = "/tmp/gpu-hybrid-two.sock"
        p2 = start_daemon(model, sock2, "--slots", str(blocks * N_EXPERTS))
        try:
            from moecache_client import Client
            ra, _ = pair(TWO, None, 0, sock2)
            both = [ra, ra["b"]]
            with Client(f"ipc://{sock2}", name="gpu-hybrid", map_arena=False) as c:
                st = c.stats()
            results["two_engines_fresh"] = {"rc": [x["rc"] for x in both], "reads": st.get("reads"),
                                            "bytes_read": st.get("bytes_read"), "served_experts": blocks * N_EXPERTS,
                                            "vram_copied_bytes": [x.get("vram", {}).get("copied_bytes") for x in both],
                                            "decode_tps": [x.get("decode_tps") for x in both]}
            print(f"two engines on a fresh daemon: {results['two_engines_fresh']}", flush=True)
        finally:
            stop_daemon(p2)
finally:
    for p in daemons.values():
        stop_daemon(p)
base = None
for name in rows:
    ok = [x for x in runs[name][1:] if x["rc"] == 0]
    row = {"what": ROWS[name][0], "arena": ROWS[name][3], "ok_rounds": len(ok), "failed": [x.get("error", "")[-1500:] for x in runs[name] if x["rc"] != 0][:1]}
    if ok:
        row |= {"decode_tps": statistics.median(x["decode_tps"] for x in ok),
                "prompt_tps": statistics.median(x["prompt_tps"] for x in ok),
                "decode_tps_rounds": [round(x["decode_tps"], 2) for x in ok], "stats": ok[-1]["stats"]}
        vr = ok[-1].get("vram") or {}
        if vr.get("slots"):   # rung 3: the tier's counters of the last round (one process, one tier)
            n_tok = ok[-1]["prompt_tokens"] + ok[-1]["decode_tokens"]
            row["vram"] = vr | {"copied_bytes_per_decoded_token": vr["decode_copied_bytes"] / max(ok[-1]["decode_tokens"], 1),
                                # over the host link: copies into the tier, the arena's bytes read in place and
                                # the copies ahead into the staging slots (LLAMA_MOECACHED_VRAM_STAGE)
                                "link_bytes_per_decoded_token": (vr["decode_copied_bytes"] + vr.get("decode_arena_read_bytes", 0)
                                                                 + vr.get("decode_stage_bytes", 0)) / max(ok[-1]["decode_tokens"], 1),
                                "copied_bytes_per_token": vr["copied_bytes"] / max(n_tok, 1),
                                "decode_hit_rate": vr["decode_hits"] / max(vr["decode_hits"] + vr["decode_misses"], 1)}
        if vr.get("lookup") in ("auto", "device", "arena"):   # rungs 4 and 5: per decoded token
            d = max(ok[-1]["decode_tokens"], 1)
            row["lookup"] = {k: vr.get(k) for k in ("lookup", "device_ubatches", "reruns", "reads", "fill_syncs", "switches",
                                                    "spec_copies", "decode_reruns", "decode_spec_copies", "arena_reads",
                                                    "decode_arena_reads", "stale_peeks", "admit_refused", "stage",
                                                    "stage_width", "decode_stage_copies", "decode_stage_hits")}
            row["lookup"]["decode_reruns_per_token"] = vr.get("decode_reruns", 0) / d
            for k in ("host", "wait", "fill"):   # the host's time in the lookup per decoded token
                row["lookup"][f"{k}_us_per_token"] = vr.get(f"decode_{k}_us", 0) / d
        # the same logits in every round?
        dumps = [open(f"{work}/{name}-{i}.bin", "rb").read() for i, x in enumerate(runs[name]) if x["rc"] == 0]
        row["reproducible"] = all(d == dumps[0] for d in dumps)
        if name == TWO:   # the second engine: its decode and its logits against the first's
            okb = [x["b"] for x in runs[name][1:] if x["rc"] == 0 and x["b"]["rc"] == 0]
            row["b_decode_tps"] = statistics.median(x["decode_tps"] for x in okb) if okb else None
            row["b_same_logits"] = all(open(f"{work}/{name}-{i}.bin", "rb").read() == open(f"{work}/{name}-{i}-b.bin", "rb").read()
                                       for i, x in enumerate(runs[name]) if x["rc"] == 0 and x["b"]["rc"] == 0)
    results["rows"][name] = row
for a, b in PAIRS:
    if a not in rows or b not in rows:
        continue
    rnd = next((i for i in range(rounds) if runs[a][i]["rc"] == 0 and runs[b][i]["rc"] == 0), None)
    if rnd is None:
        results["pairs"].append({"a": a, "b": b, "error": "no round where both ran"})
        continue
    x = np.fromfile(f"{work}/{a}-{rnd}.bin", dtype=np.float32)
    y = np.fromfile(f"{work}/{b}-{rnd}.bin", dtype=np.float32)
    ta, tb = runs[a][rnd]["tokens"], runs[b][rnd]["tokens"]
    n_rows = len(ta)
    xr, yr = x.reshape(n_rows, -1), y.reshape(n_rows, -1)
    first = next((i for i, (u, v) in enumerate(zip(ta, tb)) if u != v), None)
    results["pairs"].append({"a": a, "b": b, "round": rnd, "max_abs_diff": float(np.max(np.abs(x - y))),
                             "rows": n_rows, "identical_rows": int(sum(np.array_equal(u, v) for u, v in zip(xr, yr))),
                             "bit_identical": x.tobytes() == y.tobytes(), "tokens_identical": ta == tb,
                             "first_token_difference": first, "steps": len(ta) - 1})
# the llama-bench rows (build phase)
bench = {}
for tag, fn in (("gpu", "bench_gpu.json"), ("exps_cpu", "bench_exps_cpu.json")):
    try:
        for e in json.load(open(f"{out}/{fn}")):
            bench[f"{tag}{'' if tag == 'gpu' else ('_repack' if e.get('repack', True) else '_norepack')}"] = e["avg_ts"]
    except Exception as ex:   # not run in this call, or failed
        bench[tag] = f"missing: {ex}"
results["llama_bench"] = bench
results["time"] = time.time()
json.dump(results, open(f"{out}/rungs.json", "w"), indent=1)
gpu = results["rows"].get("gpu", {}).get("decode_tps")
lines = [f"model {results['model']}: {blocks} MoE blocks x {N_EXPERTS} experts, top-{TOP_K}, {steps} steps, "
         f"prompt {len(PROMPT)} bytes, {THREADS} threads, medians of {rounds - 1} rounds after a warm-up", "",
         "| run | decode tok/s | vs GPU resident | vs --cpu-moe | prompt tok/s | acquires / fast / misses |", "|---|---|---|---|---|---|"]
cpu_moe = results["rows"].get("cpu_moe", {}).get("decode_tps")
for k, v in bench.items():
    if isinstance(v, float):
        lines.append(f"| llama-bench {k} | {v:.1f} | {f'{v / gpu:.3f}' if gpu else '-'} | - | - | - |")
for name, row in results["rows"].items():
    if "decode_tps" not in row:
        lines.append(f"| mc-decode {name}: {row['what']} | FAILED | - | - | - | - |")
        continue
    st = row["stats"]
    vs = f"{row['decode_tps'] / gpu:.3f}" if gpu else "-"
    sts = f"{st.get('acquires')} / {st.get('fast')} / {st.get('misses')}" if st else "-"
    vc = f"{row['decode_tps'] / cpu_moe:.3f}" if cpu_moe else "-"
    lines.append(f"| mc-decode {name}: {row['what']} | {row['decode_tps']:.1f} | {vs} | {vc} | {row['prompt_tps']:.1f} | {sts} |")
lines += ["", "| a | b | max abs diff | identical rows | bit-identical | greedy tokens identical |", "|---|---|---|---|---|---|"]
for q in results["pairs"]:
    if "error" in q:
        lines.append(f"| {q['a']} | {q['b']} | {q['error']} | | | |")
    else:
        lines.append(f"| {q['a']} | {q['b']} | {q['max_abs_diff']:.3g} | {q['identical_rows']}/{q['rows']} | "
                     f"{'yes' if q['bit_identical'] else 'no'} | "
                     f"{'yes (' + str(q['steps']) + ' steps)' if q['tokens_identical'] else 'no, from step ' + str(q['first_token_difference'])} |")
tier = [(n, r) for n, r in results["rows"].items() if "vram" in r]
if tier:
    lines += ["", "| run | tier slots | VRAM MiB | decode hits / misses (hit rate) | MiB copied per decoded token | "
              "MiB copied per token, prompt included | evictions | blocks run on the arena | host waits for copies | "
              "arena parts registered with CUDA |", "|---|---|---|---|---|---|---|---|---|---|"]
    h2d = results.get("h2d_bytes_per_s")
    # the ceiling a row's misses allow: the resident time per token plus its bytes over the host link
    # (copies, and the arena's bytes read in place) at the H2D rate
    ceil = {}
    if h2d and gpu:
        for name, row in tier:
            c = 1 / (1 / gpu + row["vram"]["link_bytes_per_decoded_token"] / h2d)
            ceil[name] = {"ceiling_tps": c, "of_ceiling": row["decode_tps"] / c}
            row["ceiling"] = ceil[name]
    for name, row in tier:
        vr = row["vram"]
        lines.append(f"| {name} | {vr['slots']} | {vr['vram_bytes'] / 2**20:.0f} | {vr['decode_hits']} / {vr['decode_misses']} "
                     f"({vr['decode_hit_rate']:.3f}) | {vr['copied_bytes_per_decoded_token'] / 2**20:.2f} | "
                     f"{vr['copied_bytes_per_token'] / 2**20:.2f} | {vr['evictions']} | {vr['fallbacks']} | "
                     f"{vr.get('copy_syncs', '-')} | {vr.get('pinned_parts', '-')} |")
    lines += ["", f"H2D from pinned memory: {h2d / 1e9:.1f} GB/s (the same run)" if h2d else "H2D: not measured (no PyTorch CUDA)"]
    if ceil:
        lines += ["", "| run | decode tok/s | MiB over the host link per decoded token | ceiling those allow | of the ceiling |",
                  "|---|---|---|---|---|"]
        lines += [f"| {n} | {results['rows'][n]['decode_tps']:.1f} | {results['rows'][n]['vram']['link_bytes_per_decoded_token'] / 2**20:.2f} | "
                  f"{c['ceiling_tps']:.1f} | {c['of_ceiling']:.3f} |" for n, c in ceil.items()]
        part = [n for n in ceil if ROWS[n][3] < 1]
        if part:   # the ceiling's copies come from the arena; these rows' arena lacks some experts
            lines += ["", "the ceiling takes every miss from the arena; these rows' arena holds part of the experts, so "
                          "they also wait on the daemon's drive reads, which the ceiling leaves out: "
                          + ", ".join(f"{n} (arena {ROWS[n][3]:.0%})" for n in part)]
    w = results["rows"].get("rung4_100w", {}).get("decode_tps")
    if w and gpu:   # the device lookup's cost per MoE block when every expert is in the tier
        results["hit_cost_us_per_block"] = (1 / w - 1 / gpu) * 1e6 / blocks
        lines += ["", f"hit path per MoE block (rung4_100w against gpu): {results['hit_cost_us_per_block']:.1f} us"]
look = [(n, r) for n, r in results["rows"].items() if "lookup" in r]
if look:
    lines += ["", "| run | lookup | ubatches on the device | passes run again (decode) | reads of the routed ids | "
              "fill waits | switches | copies for a routing not kept | experts read from the arena in place (decode) | "
              "arena slots found reused | copies not admitted | copied ahead / found there (decode) | "
              "host us / wait us / fill us per decoded token |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in look:
        lk = row["lookup"]
        lines.append(f"| {name} | {lk['lookup']} | {lk['device_ubatches']} | {lk['reruns']} ({lk['decode_reruns']}) | {lk['reads']} | "
                     f"{lk['fill_syncs']} | {lk['switches']} | {lk['spec_copies']} | {lk.get('arena_reads')} ({lk.get('decode_arena_reads')}) | "
                     f"{lk.get('stale_peeks')} | {lk.get('admit_refused')} | {lk.get('decode_stage_copies')} / {lk.get('decode_stage_hits')} | "
                     f"{lk['host_us_per_token']:.1f} / {lk['wait_us_per_token']:.1f} / {lk['fill_us_per_token']:.1f} |")
if TWO in results["rows"] and "decode_tps" in results["rows"][TWO]:
    row, fr = results["rows"][TWO], results.get("two_engines_fresh", {})
    lines += ["", f"two engines at once: decode {row['decode_tps']:.1f} and {row['b_decode_tps'] or 0:.1f} tok/s, the second's "
              f"logits {'=' if row['b_same_logits'] else '!='} the first's; on a fresh daemon the pair made it read "
              f"{fr.get('reads')} experts ({fr.get('bytes_read')} bytes) of {fr.get('served_experts')}, each engine "
              f"copied {fr.get('vram_copied_bytes')} bytes into its own tier"]
if results["sched"]:
    lines += ["", "graph splits of a 1-step run (every graph): " + ", ".join(f"{k} {v['splits']}" for k, v in results["sched"].items()),
              "graph splits of the decode step's graph: " + ", ".join(f"{k} {v['decode_graph_splits']}" for k, v in results["sched"].items())]
json.dump(results, open(f"{out}/rungs.json", "w"), indent=1)
open(f"{out}/rungs.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
    say "mc-decode rows done"
fi
