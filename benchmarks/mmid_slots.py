"""ggml-cpu's MUL_MAT_ID per call against its weight tensor's expert count, the experts used the same.

    python benchmarks/mmid_slots.py [--cache DIR] [--threads 2,8] [--rows 16] [--iters 3000]
                                    [--n-as 128,512,1536,6144] [--json PATH]

A block served by moecached multiplies by weight tensors over every slot of its size class (a full
arena of a 48-block, 128-expert model: 6,144), where the resident model's span its 128 experts; a
decoded token uses 8 either way. This compiles benchmarks/mmid_slots.cpp against the patched
llama.cpp build (clients/llama.cpp/build.sh; --cache, default $MOECACHED_LLAMA_CACHE or
~/.cache/moecached-llama) and times one MUL_MAT_ID of 8 experts (Q8_0, 2048 x ROWS each; few rows,
so what the call costs beside the multiplication shows) per expert count and thread count: the
median of five runs of ITERS calls. Flat across the counts: the call costs the experts used.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]
from benchutil import write_json  # noqa: E402


def default_cache() -> str:
    """build.sh's cache: $MOECACHED_LLAMA_CACHE, else ~/.cache/moecached-llama."""
    return os.environ.get("MOECACHED_LLAMA_CACHE", os.path.expanduser("~/.cache/moecached-llama"))


def build(cache: Path, out: Path, name: str = "mmid_slots") -> Path:
    """Compile benchmarks/NAME.cpp against CACHE's CPU build; the binary's path. SystemExit naming
    what is missing."""
    inc, lib = cache / "src" / "ggml" / "include", cache / "build-cpu" / "ggml" / "src"
    libs = [lib / "libggml.a", lib / "libggml-cpu.a", lib / "libggml-base.a"]
    missing = [str(p) for p in [inc] + libs if not p.exists()]
    if missing:
        sys.exit(f"benchmarks/{name}.py: no CPU build of the patched llama.cpp under {cache} ({missing[0]} is "
                 "missing): run clients/llama.cpp/build.sh first")
    exe = out / name
    cmd = ["c++", "-O2", "-std=c++17", "-I", str(inc), str(HERE / f"{name}.cpp"), *map(str, libs),
           "-lpthread", "-fopenmp", "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"benchmarks/{name}.py: compiling the harness failed: {r.stderr.strip()[-800:]}")
    return exe


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", default=default_cache())
    ap.add_argument("--threads", default="2")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--n-as", default="128,512,1536,6144")
    ap.add_argument("--json", default=str(HERE / "results" / "mmid_slots.json"))
    a = ap.parse_args(argv)
    n_as = [int(x) for x in a.n_as.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="mmid-") as td:
        exe = build(Path(a.cache), Path(td))
        for nth in [int(x) for x in a.threads.split(",")]:
            out = subprocess.run([str(exe), str(nth), str(a.iters), str(a.rows), *map(str, n_as)],
                                 capture_output=True, text=True, check=True).stdout
            for line in out.splitlines():
                f = dict(kv.split("=") for kv in line.split())
                rows.append({"threads": nth, "n_as": int(f["n_as"]), "us": float(f["us"]), "min_us": float(f["min_us"])})
    print(f"MUL_MAT_ID of 8 experts (Q8_0, 2048 x {a.rows}), us per call (median of 5 x {a.iters} calls)")
    print("| threads | " + " | ".join(f"{n} experts" for n in n_as) + " |")
    print("|---|" + "---|" * len(n_as))
    for nth in sorted({r["threads"] for r in rows}):
        print(f"| {nth} | " + " | ".join(f"{r['us']:.1f}" for r in rows if r["threads"] == nth) + " |")
    write_json(a.json, {"rows_per_expert": a.rows, "iters": a.iters, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
