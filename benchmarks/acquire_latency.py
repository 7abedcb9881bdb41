"""In-process acquire+release latency of resident experts (the cache's hot path).

Writes a small real-layout fixture (``moecached.tools.synth``), opens an ExpertCache over it with
every expert fitting, makes the experts resident, then times ``release(acquire(layer, experts))``
of ``--experts`` (default 8) resident experts, ``--iters`` times, layers round-robin and expert
sets drawn at random (precomputed). Also times ``acquire_many`` (one layer) and
``acquire_async`` (inline completion) for comparison. Prints a table (microseconds) and writes
JSON.

    python benchmarks/acquire_latency.py                       # -> benchmarks/results/acquire_latency.json
    python benchmarks/acquire_latency.py --iters 200000 --json /tmp/lat.json

Target: p50 <= 20 us for 8 experts.
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchutil import write_json  # noqa: E402

from moecached.engine.cache import ExpertCache  # noqa: E402
from moecached.engine.index import open_index  # noqa: E402
from moecached.tools.synth import write_model  # noqa: E402


def measure(fn, sets, iters):
    t = np.empty(iters, dtype=np.int64)
    pc = time.perf_counter_ns
    n = len(sets)
    for i in range(iters):
        a = sets[i % n]
        t0 = pc()
        fn(a)
        t[i] = pc() - t0
    us = t / 1000.0
    return {"p50_us": float(np.percentile(us, 50)), "p90_us": float(np.percentile(us, 90)),
            "p99_us": float(np.percentile(us, 99)), "mean_us": float(us.mean()),
            "min_us": float(us.min()), "iters": iters}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="qwen3-30b-a3b-Q4_K_M")
    ap.add_argument("--layers", type=int, default=4, help="expert layers in the fixture")
    ap.add_argument("--n-experts", type=int, default=16, help="experts per layer in the fixture")
    ap.add_argument("--experts", type=int, default=8, help="experts per acquire")
    ap.add_argument("--iters", type=int, default=50000)
    ap.add_argument("--policy", default="global", choices=["global", "per-layer"])
    ap.add_argument("--lock", action="store_true", help="mlock the arena (needs RLIMIT_MEMLOCK)")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                   "results", "acquire_latency.json"))
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="moecache-bench-") as d:
        paths = write_model(args.layout, os.path.join(d, "model.gguf"), layers=args.layers,
                            experts=args.n_experts, progress=False)
        idx = open_index(paths[0])
        cache = ExpertCache(idx, policy=args.policy, readers=4, lock_memory=args.lock)
        try:
            layers = list(idx.expert_layers)
            rng = random.Random(0)
            k = min(args.experts, idx.n_experts)
            for l in layers:                        # everything resident
                cache.release(cache.acquire(l, list(range(idx.n_experts)), timeout=60))
            sets = [(layers[i % len(layers)], rng.sample(range(idx.n_experts), k))
                    for i in range(4096)]
            acq, rel, many, asy = cache.acquire, cache.release, cache.acquire_many, cache.acquire_async

            def one(a):
                rel(acq(a[0], a[1]))

            def one_many(a):
                rel(many([a]))

            def one_async(a):
                box = []
                asy([a], box.append)                # all resident: callback runs inline
                rel(box[0])

            for fn in (one, one_many, one_async):   # warm up
                measure(fn, sets, 2000)
            res = {}
            res["acquire+release"] = measure(one, sets, args.iters)
            gc.disable()
            res["acquire+release (gc off)"] = measure(one, sets, args.iters)
            gc.enable()
            res["acquire_many+release"] = measure(one_many, sets, max(args.iters // 5, 1000))
            res["acquire_async(inline)+release"] = measure(one_async, sets, max(args.iters // 5, 1000))
            s = cache.stats()
            assert s["pinned"] == 0 and s["demand_misses"] == len(layers) * idx.n_experts
        finally:
            cache.close()

    print(f"moecached acquire latency: {k} resident experts, {len(layers)} layers x "
          f"{idx.n_experts} experts ({args.layout}), policy {args.policy}, python "
          f"{platform.python_version()}")
    print(f"{'operation':34s} {'p50 us':>8s} {'p90 us':>8s} {'p99 us':>8s} {'mean us':>8s} {'iters':>8s}")
    for name, r in res.items():
        print(f"{name:34s} {r['p50_us']:8.2f} {r['p90_us']:8.2f} {r['p99_us']:8.2f} "
              f"{r['mean_us']:8.2f} {r['iters']:8d}")
    out = {"benchmark": "acquire_latency", "experts_per_acquire": k, "layout": args.layout,
           "layers": len(layers), "n_experts": idx.n_experts, "policy": args.policy,
           "python": platform.python_version(), "machine": platform.machine(),
           "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "target_p50_us": 20.0, "results": res}
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
