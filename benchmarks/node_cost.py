"""What one more ggml-cpu graph node costs: an empty one-thread op between two matrix-vector products.

    python benchmarks/node_cost.py [--cache DIR] [--threads 2,8] [--pairs 32] [--iters 200] [--json PATH]

A block served by moecached adds host ops to llama.cpp's graph (the acquire before the expert
matmuls, the release after them); each is a node that one thread runs while the others wait at the
barrier ending every node. The op's own time is the engine's `op_us` (mc-decode's moecached line);
this measures the rest: benchmarks/node_cost.cpp, compiled against the patched llama.cpp's CPU build
(clients/llama.cpp/build.sh), times PAIRS pairs of matrix-vector products (2048 x 128 Q8_0 and back)
with and without an empty op after each pair's first (medians of 11 alternating rounds of ITERS
graphs), and a chain of empty ops alone.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]
from benchutil import write_json  # noqa: E402
from mmid_slots import build, default_cache  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", default=default_cache())
    ap.add_argument("--threads", default="2")
    ap.add_argument("--pairs", type=int, default=32)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json", default=str(HERE / "results" / "node_cost.json"))
    a = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="node-cost-") as td:
        exe = build(Path(a.cache), Path(td), "node_cost")
        for nth in [int(x) for x in a.threads.split(",")]:
            out = subprocess.run([str(exe), str(nth), str(a.iters), str(a.pairs)],
                                 capture_output=True, text=True, check=True).stdout
            f = {k: float(v) for k, v in (kv.split("=") for kv in out.split())}
            rows.append({"threads": nth} | f)
    print(f"an empty one-thread node: {a.pairs} pairs of matrix-vector products, medians of 11 x {a.iters} graphs")
    print("| threads | graph us without | with | us per node between products | us per node, empty ops alone |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['threads']} | {r['base_us']:.1f} | {r['with_us']:.1f} | {r['per_node_us']:.2f} | {r['alone_per_node_us']:.2f} |")
    write_json(a.json, {"pairs": a.pairs, "iters": a.iters, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
