#!/usr/bin/env bash
# The hybrid path on a CUDA machine: a CUDA build of the patched llama.cpp with every layer
# offloaded, the routed experts taken from the daemon's arena, against llama.cpp's own runs.
# From the project's root on the GPU machine (carry .whl and .dev: ../shared/device/README.md):
#
#   bash benchmarks/gpu_hybrid.sh OUT_DIR [BLOCKS] [STEPS]
#
# Writes a synth --runnable model of the Qwen3-30B-A3B expert geometry (BLOCKS blocks, Q8_0),
# then, each result in OUT_DIR as it comes:
#   bench_gpu.json / bench_exps_cpu.json  llama-bench decode, all on the GPU / -ot exps=CPU
#   engine.json        benchmarks/engine.py: resident (all on the GPU) vs --moecached (all experts
#                      in the daemon), interleaved rounds, logits compared
#   engine_plain.json  the same with LLAMA_MOECACHED_PLAIN_BUFFERS=1 (the arena's buffers not
#                      marked as weights: what the patch did before), fewer steps
#   sched_*.txt        GGML_SCHED_DEBUG of one decode step each way: graph splits and copies
set -uo pipefail
OUT=${1:?usage: gpu_hybrid.sh OUT_DIR [BLOCKS] [STEPS]}; BLOCKS=${2:-4}; STEPS=${3:-64}
mkdir -p "$OUT"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/log.txt"; }
SETUP=../shared/device/setup.sh   # the GPU machine's kit; a copy in .dev/ when ../shared does not travel
[ -f "$SETUP" ] || SETUP=.dev/setup.sh
# shellcheck disable=SC1090
. "$SETUP" cuda > "$OUT/setup.log" 2>&1 || { tail -30 "$OUT/setup.log"; exit 1; }
BIN=/tmp/llama/build-cuda/bin
say "built: $(tail -1 "$OUT/setup.log")"
M=/tmp/gpu-hybrid-$BLOCKS.gguf
[ -f "$M" ] || moecache-ctl synth --runnable --out "$M" --geometry qwen3-30b-a3b --blocks "$BLOCKS" \
    --quant q8_0 > "$OUT/synth.log" 2>&1 || { tail -5 "$OUT/synth.log"; exit 1; }
say "model $M: $(du -h "$M" | cut -f1)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$OUT/log.txt" 2>&1
"$BIN/llama-bench" -m "$M" -ngl 99 -p 0 -n "$STEPS" -t 8 -r 3 -o json > "$OUT/bench_gpu.json" 2>> "$OUT/log.txt"
say "llama-bench all on the GPU done"
"$BIN/llama-bench" -m "$M" -ngl 99 -ot exps=CPU -p 0 -n "$STEPS" -t 8 -r 3 -o json > "$OUT/bench_exps_cpu.json" 2>> "$OUT/log.txt"
say "llama-bench -ot exps=CPU done"
python3 benchmarks/engine.py --bin "$BIN" --model "$M" --rounds 3 --steps "$STEPS" --threads 8 \
    --cached 1.0 --json "$OUT/engine.json" > "$OUT/engine.txt" 2>&1
say "engine (weights usage) done: $(tail -3 "$OUT/engine.txt" | tr '\n' ' ')"
# one decode step each way with the scheduler's debug output: its splits and their inputs
python3 - "$BIN" "$M" "$OUT" <<'EOF'
import os, subprocess, sys, time
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "benchmarks")]
from benchutil import start_daemon, stop_daemon
bin_dir, model, out = sys.argv[1:4]
sock = "/tmp/gpu-hybrid-sched.sock"
p = start_daemon(model, sock, "--slots", "512")
try:
    for tag, extra in (("weights", {}), ("plain", {"LLAMA_MOECACHED_PLAIN_BUFFERS": "1"})):
        env = dict(os.environ, GGML_SCHED_DEBUG="2", **extra)
        r = subprocess.run([f"{bin_dir}/mc-decode", "-m", model, "-n", "1", "-t", "8",
                            "--moecached", f"ipc://{sock}"], capture_output=True, text=True, env=env,
                           timeout=300)
        text = r.stdout + r.stderr
        splits = text.count("## SPLIT #")
        open(f"{out}/sched_{tag}.txt", "w").write(f"splits {splits}\n" + text[-200000:])
        print(tag, "splits", splits, "rc", r.returncode)
finally:
    stop_daemon(p)
EOF
say "sched debug done"
LLAMA_MOECACHED_PLAIN_BUFFERS=1 python3 benchmarks/engine.py --bin "$BIN" --model "$M" --rounds 2 \
    --steps 16 --threads 8 --cached 1.0 --json "$OUT/engine_plain.json" > "$OUT/engine_plain.txt" 2>&1
say "engine (plain buffers) done: $(tail -3 "$OUT/engine_plain.txt" | tr '\n' ' ')"
