"""llama.cpp with substitution decided at the cache: KL divergence against the exact run and
the demand misses it saves.

    python benchmarks/engine_subst.py [--model PATH | --blocks 4 --experts 32 --top-k 4 --hidden 128]
                                      [--cached 0.25] [--r 0.5,0.8] [--cap 1] [--ctx 128]
                                      [--chunks 8] [--text FILE] [--json OUT]

Needs the patched build with llama-perplexity (clients/llama.cpp/build.sh --target
llama-perplexity; --bin or MOECACHED_LLAMA_BIN or ~/.cache/moecached-llama/bin). Without
--model it writes a runnable qwen3moe Q8_0 model (random weights, seed --seed); without --text
a repeated prose text. llama-perplexity runs with one token per ubatch (-ub 1), so every token
is decoded as in generation and substitution is decided per token and block. The resident
model writes the base logits (--kl-divergence-base); the resident model again against them
gives the floor of the measure (llama-perplexity stores the base as 16-bit log-probabilities);
then, each against one fresh daemon of --cached x all experts slots, the exact served run (the
same logits: the floor again) and one run per tolerance r (--moecached-subst r
--moecached-subst-cap cap). Reported per run: mean
and 99th-percentile KL divergence, same top token, PPL ratio, and the daemon's counters
(demand misses, substitutions, hits). Prints a table and writes JSON (--json).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python"), str(ROOT / "tests")]

from daemon_util import start_daemon, stop_daemon  # noqa: E402
from moecached.engine.index import open_index  # noqa: E402
from moecached.tools import engine_llama  # noqa: E402
from moecached.tools.synth_runnable import write_runnable  # noqa: E402

WORDS = ("the cache keeps experts resident in shared memory while engines decode tokens and the router "
         "picks a few experts for every token of every layer so that most weights stay on disk until "
         "needed").split()


def prose(n_sentences: int = 400, seed: int = 7) -> str:
    rnd = random.Random(seed)
    sents = [" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(8, 16))).capitalize() + "."
             for _ in range(60)]
    return " ".join(sents[i % len(sents)] for i in range(n_sentences))


def perplexity(bin_dir: Path, model: str, text: str, a, *extra: str) -> str:
    cmd = [str(bin_dir / "llama-perplexity"), "-m", model, "-f", text, "-c", str(a.ctx), "-b", str(a.ctx),
           "-ub", "1", "--chunks", str(a.chunks), "-t", str(a.threads), "--no-repack", *extra]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"llama-perplexity failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}")
    return r.stdout + "\n" + r.stderr


def kl_of(out: str) -> dict:
    def num(pat):
        m = re.search(pat, out, re.M)
        if not m:
            raise SystemExit(f"llama-perplexity printed no line matching {pat!r}:\n{out[-3000:]}")
        return float(m.group(1))
    return {"kl_mean": num(r"^Mean\s+KLD:\s+([-\d.e]+)"), "kl_p99": num(r"^99\.0%\s+KLD:\s+([-\d.e]+)"),
            "kl_max": num(r"^Maximum KLD:\s+([-\d.e]+)"), "same_top": num(r"^Same top p:\s+([-\d.e]+)"),
            "ppl_ratio": num(r"^Mean PPL\(Q\)/PPL\(base\)\s+:\s+([-\d.e]+)")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--cached", type=float, default=0.25, help="slots as a fraction of all experts")
    ap.add_argument("--r", default="0.5,0.8", help="tolerances, comma-separated")
    ap.add_argument("--cap", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text")
    ap.add_argument("--bin")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    bin_dir = Path(a.bin) if a.bin else engine_llama.llama_bin()
    if bin_dir is None or not (bin_dir / "llama-perplexity").exists():
        raise SystemExit("no llama-perplexity: clients/llama.cpp/build.sh --target llama-perplexity, then --bin DIR")
    with tempfile.TemporaryDirectory(prefix="mc-subst-") as td:
        model = a.model or write_runnable(os.path.join(td, "model.gguf"), blocks=a.blocks, experts=a.experts,
                                          top_k=a.top_k, hidden=a.hidden, expert_ff=a.hidden, quant="q8_0",
                                          seed=a.seed)
        text = a.text or os.path.join(td, "text.txt")
        if not a.text:
            Path(text).write_text(prose())
        idx = open_index(model).to_json()
        n_all = len(idx["expert_layers"]) * idx["n_experts"]
        slots = max(int(n_all * a.cached), idx["top_k"] * len(idx["size_classes"]))
        base = os.path.join(td, "base.kld")
        perplexity(bin_dir, model, text, a, "--kl-divergence-base", base)
        floor = kl_of(perplexity(bin_dir, model, text, a, "--kl-divergence-base", base, "--kl-divergence"))
        runs = [("exact", None)] + [(f"r={r}", float(r)) for r in a.r.split(",")]
        rows = []
        for name, r in runs:
            sock = os.path.join(td, "d.sock")
            p = start_daemon(model, sock, "--slots", str(slots))
            try:
                extra = ["--moecached", f"ipc://{sock}"]
                if r is not None:
                    extra += ["--moecached-subst", str(r), "--moecached-subst-cap", str(a.cap)]
                out = perplexity(bin_dir, model, text, a, "--kl-divergence-base", base, "--kl-divergence", *extra)
                from moecache_client import Client
                with Client(f"ipc://{sock}", name="bench") as c:
                    st = c.stats()
            finally:
                stop_daemon(p)
            rows.append({"run": name, "r": r, "cap": a.cap if r is not None else None, **kl_of(out),
                         "demand_misses": st["demand_misses"], "substitutions": st["substitutions"],
                         "hits": st["hits"] + st["prefetch_hits"]})
    exact = rows[0]["demand_misses"]
    rows.insert(0, {"run": "resident", "r": None, "cap": None, **floor, "demand_misses": None, "substitutions": None,
                    "hits": None})
    print(f"model {idx['arch']} {len(idx['expert_layers'])} blocks, {idx['n_experts']} experts, top-{idx['top_k']}; "
          f"{slots} slots ({slots / n_all:.0%} of the experts); -c {a.ctx} -ub 1, {a.chunks} chunks")
    print(f"{'run':<8} {'mean KL':>9} {'p99 KL':>9} {'max KL':>9} {'same top':>9} {'PPL ratio':>10} "
          f"{'demand misses':>14} {'vs exact':>9} {'substitutions':>14} {'hits':>7}")
    for x in rows:
        counts = (f"{'-':>14} {'-':>9} {'-':>14} {'-':>7}" if x["demand_misses"] is None else
                  f"{x['demand_misses']:>14} {x['demand_misses'] / exact - 1:>+9.1%} {x['substitutions']:>14} {x['hits']:>7}")
        print(f"{x['run']:<8} {x['kl_mean']:>9.6f} {x['kl_p99']:>9.6f} {x['kl_max']:>9.6f} {x['same_top']:>8.2f}% "
              f"{x['ppl_ratio']:>10.5f} {counts}")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": model if a.model else "synthetic", "index": {
            "blocks": len(idx["expert_layers"]), "experts": idx["n_experts"], "top_k": idx["top_k"]},
            "slots": slots, "ctx": a.ctx, "chunks": a.chunks, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
