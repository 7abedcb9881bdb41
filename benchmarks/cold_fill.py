"""Cold fill: a layer's whole missing set asked for at once, on a cold daemon.

A cold engine (a prompt, a restart without a state file) asks for many experts of a layer in
one acquire. The cache queues all their reads at once (one read job per expert, demand
priority); this measures how fast they come in, per round on a fresh daemon with the page cache
dropped, for the same expert sets asked in two orders:

* ``rank``: the order a router names them (random: the experts' ids shuffled);
* ``file``: sorted by id, which is file order within a layer (the experts of one tensor lie
  back to back).

``--before TREE`` adds the rank order on the daemon of another source tree (a checkout before a
change), in the same rounds. Each acquire names ``--width`` experts of one layer (default: every expert of the layer), the
layers one after another; the figure is MiB/s from the first acquire to the last lease, against
the drive's ceiling (the read-path benchmark's O_DIRECT loop, ``read_path.run_ours``) measured
in the same round.

Usage::

    python benchmarks/cold_fill.py [--model PATH.gguf | --layers 4 --experts 128] [--width 128]
        [--rounds 3] [--dir /work/bench-tmp] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import numpy as np  # noqa: E402

from benchutil import start_daemon, stop_daemon, write_json  # noqa: E402
from read_path import drop_caches  # noqa: E402
from warm_restart import drive_bandwidth  # noqa: E402
from moecached.engine.index import open_index  # noqa: E402


def fill(model, sock, idx, sets, readers, tree=None) -> dict:
    """A fresh daemon holding every expert; the acquires of ``sets`` ([(layer, [experts])])
    one after another, each released at once. MiB/s over all of them."""
    from moecache_client import Client
    drop_caches()
    env = dict(os.environ, PYTHONPATH=tree) if tree else None
    d = start_daemon(model, sock, "--slots", str(len(idx.expert_layers) * idx.n_experts),
                     "--state-dir", "", "--readers", str(readers), env=env)
    try:
        with Client(f"ipc://{sock}", name="cold-fill", map_arena=False) as c:
            t0 = time.perf_counter()
            for layer, experts in sets:
                c.acquire(layer, experts, timeout=120).release()
            dt = time.perf_counter() - t0
            st = c.stats()
    finally:
        stop_daemon(d)
    return {"seconds": dt, "bytes": st["bytes_read"], "mib_s": st["bytes_read"] / dt / 2**20,
            "misses": st["demand_misses"], "read_p50_ms": (st["read_latency"]["p50_us"] or 0) / 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--layout", default="qwen3-30b-a3b-Q4_K_M")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--width", type=int, default=0, help="experts per acquire (0: the whole layer)")
    ap.add_argument("--readers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bw-seconds", type=float, default=5.0)
    ap.add_argument("--before", metavar="TREE", help="also run rank order on the daemon of this "
                    "source tree (another checkout, e.g. before a change): a third column")
    ap.add_argument("--dir", default="/work/bench-tmp")
    ap.add_argument("--json", default=str(HERE / "results" / "cold_fill.json"))
    a = ap.parse_args(argv)
    work = Path(a.dir) / "cold_fill"
    work.mkdir(parents=True, exist_ok=True)
    if a.model:
        model = a.model
    else:
        from moecached.tools.synth import write_model
        out = Path(a.dir) / f"{a.layout}-L{a.layers}-E{a.experts}" / "model.gguf"
        if not out.exists():
            write_model(a.layout, out, layers=a.layers, experts=a.experts, progress=False, sparse=False)
        model = str(out)
    idx = open_index(model)
    width = a.width or idx.n_experts
    rng = np.random.default_rng(0)
    rounds = []
    try:
        for r in range(a.rounds):
            picks = [(int(l), [int(e) for e in rng.permutation(idx.n_experts)[:width]])
                     for l in idx.expert_layers]
            orders = {"rank": picks, "file": [(l, sorted(es)) for l, es in picks]}
            bw = drive_bandwidth(idx, a.readers, 256 << 10, a.bw_seconds)["mib_s"]
            row = {"round": r, "drive_mib_s": bw}
            runs = [("rank", orders["rank"], None), ("file", orders["file"], None)]
            if a.before:
                runs.append(("rank_before", orders["rank"], a.before))
            for name, sets, tree in (runs if r % 2 == 0 else runs[::-1]):
                row[name] = fill(model, str(work / "d.sock"), idx, sets, a.readers, tree)
            rounds.append(row)
            print(f"round {r}: drive {bw:.0f} MiB/s; " + ", ".join(
                f"{k} {row[k]['mib_s']:.0f} MiB/s" for k, _, _ in runs), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nmodel {model}: {len(idx.expert_layers)} layers x {idx.n_experts} experts; acquires of "
          f"{width} experts of one layer, {a.readers} readers")
    cols = ["rank", "file"] + (["rank_before"] if a.before else [])
    names = {"rank": "rank order", "file": "file order", "rank_before": "rank order, before"}
    print("| round | drive MiB/s | " + " | ".join(f"{names[k]} MiB/s | / drive" for k in cols) + " |")
    print("|---|---|" + "---|---|" * len(cols))
    for x in rounds:
        print(f"| {x['round']} | {x['drive_mib_s']:.0f} | " + " | ".join(
            f"{x[k]['mib_s']:.0f} | {x[k]['mib_s'] / x['drive_mib_s']:.2f}" for k in cols) + " |")
    med = {k: statistics.median(x[k]["mib_s"] / x["drive_mib_s"] for x in rounds) for k in cols}
    print("median share of the drive: " + ", ".join(f"{names[k]} {med[k]:.2f}" for k in cols))
    write_json(a.json, {"model": model, "width": width, "readers": a.readers, "rounds": rounds,
                        "median_share": med, "argv": sys.argv[1:]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
