"""Warm restart: how fast a restarted daemon has its resident set back, against the drive.

What it measures, per round:

1. daemon A (``--budget``, a state dir of its own) is filled by an engine-like client: random
   layers' experts acquired until every slot is used; then it stops (SIGTERM), writing its state
   file;
2. the drive's O_DIRECT bandwidth for expert loads, by the read-path benchmark's own loop
   (``read_path.run_ours``: random whole experts, ``--threads`` reader threads, ``--chunk``
   reads, 32 loads in flight; page cache dropped first), for ``--bw-seconds`` just before the
   restart and again just after the fill (the drive's speed swings: the mean of the two);
3. the page cache is dropped and daemon B starts on the same state dir; the fill is followed
   through ``stats`` (``warm_bytes`` against ``warm_seconds``, the fill's own clock, from the
   moment it serves) until it ends.

The figure: the time B takes to hold 90 % of A's resident bytes, over resident bytes / drive
bandwidth (the time the drive needs for them at the measured rate). Target: <= 1.5.

Usage::

    python benchmarks/warm_restart.py [--model PATH.gguf | --layers 4 --experts 128]
        [--budget-frac 0.75] [--rounds 2] [--dir /work/bench-tmp] [--json out.json] [--keep]
        [--daemon-arg=--fill-run=0 ...]

Without ``--model`` it writes a scaled Qwen3-30B-A3B Q4_K_M model (dense) under ``--dir`` and
deletes it afterwards unless ``--keep``. Needs root for dropping the page cache (without it the
reads are O_DIRECT anyway; the JSON says whether caches were dropped).
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

from benchutil import fixture_model, start_daemon, stop_daemon, write_json  # noqa: E402
from read_path import drop_caches, parse_size, run_ours  # noqa: E402
from moecached.engine.arena import Arena  # noqa: E402
from moecached.engine.index import open_index  # noqa: E402
from moecached.engine.readers import ReaderPool  # noqa: E402

TARGET_FRAC, TARGET_RATIO = 0.90, 1.5


def drive_bandwidth(idx, threads: int, chunk: int, seconds: float) -> dict:
    """MiB/s of the read path's own O_DIRECT loop (random whole experts, 32 in flight)."""
    budget = min(256 << 20, idx.routed_expert_bytes // 4)
    arena = Arena(idx, budget_bytes=budget, lock=False)
    pool = ReaderPool(idx.files, threads=threads, chunk_bytes=chunk, file_sizes=idx.file_sizes,
                      file_mtimes_ns=idx.file_mtimes_ns)
    try:
        dropped = drop_caches()
        r = run_ours(idx, arena, pool, seconds, 32, np.random.default_rng(int(time.time())))
    finally:
        pool.close()
        arena.close()
    r["caches_dropped"] = dropped
    return r


def fill(ep: str, idx, rng) -> dict:
    """Acquire random layers' experts (16 at a time) until every slot is used."""
    from moecache_client import Client
    layers = list(idx.expert_layers)
    with Client(ep, name="filler") as c:
        while True:
            st = c.stats()
            if all(x["used"] >= x["slots"] for x in st["classes"]):
                break
            layer = layers[int(rng.integers(len(layers)))]
            ex = sorted(int(e) for e in rng.choice(idx.n_experts, min(16, idx.n_experts), replace=False))
            c.acquire(layer, ex, timeout=60).release()
        st = c.stats()
    resident = sum(x["used"] for x in st["classes"])
    rbytes = sum(x["used"] * x["slot_bytes"] for x in st["classes"])
    return {"resident": resident, "resident_bytes": rbytes, "bytes_read": st["bytes_read"]}


def follow(ep: str, want_bytes: int, timeout: float = 600.0) -> dict:
    """Poll ``stats`` until the warm fill ends: the (warm_seconds, warm_bytes) curve."""
    from moecache_client import Client
    curve = []
    t0 = time.monotonic()
    with Client(ep, name="watcher") as c:
        while time.monotonic() - t0 < timeout:
            st = c.stats()
            curve.append((st["warm_seconds"], st["warm_bytes"], st["warm_loaded"]))
            running = any(m["running"] for m in (st.get("warm") or {}).get("models", []))
            if not running and (st["warm_loaded"] or time.monotonic() - t0 > 5):
                break
            time.sleep(0.02)
        st = c.stats()
    t90 = next((s for s, b, _ in curve if b >= TARGET_FRAC * want_bytes), None)
    return {"curve": curve, "t90_s": t90, "seconds": st["warm_seconds"], "bytes": st["warm_bytes"],
            "loaded": st["warm_loaded"], "wanted": st["warm_wanted"],
            "resident": sum(x["used"] for x in st["classes"]),
            "demand_misses": st["demand_misses"], "evictions": st["evictions"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="existing GGUF (first shard); default: write one")
    ap.add_argument("--layout", default="qwen3-30b-a3b-Q4_K_M")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--budget-frac", type=float, default=0.75,
                    help="the daemon's budget as a share of the routed experts' bytes")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--chunk", default="256K")
    ap.add_argument("--bw-seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default="/work/bench-tmp", help="model, sockets and state files")
    ap.add_argument("--json", default=str(HERE / "results" / "warm_restart.json"))
    ap.add_argument("--keep", action="store_true", help="keep the written model")
    ap.add_argument("--daemon-arg", action="append", default=[],
                    help="one more flag for both daemons (repeatable), e.g. --daemon-arg=--fill-run=0")
    a = ap.parse_args(argv)
    chunk = parse_size(a.chunk)
    work = Path(a.dir) / "warm_restart"
    work.mkdir(parents=True, exist_ok=True)
    model, written = fixture_model(a)
    rng = np.random.default_rng(0)
    rounds = []
    try:
        idx = open_index(model)
        budget = int(idx.routed_expert_bytes * a.budget_frac)
        sock = str(work / "d.sock")
        state = work / "state"
        args = ["--budget", str(budget), "--state-dir", str(state), "--state-interval", "0",
                "--readers", str(a.threads), "--chunk", str(chunk), *a.daemon_arg]
        for r in range(a.rounds):
            shutil.rmtree(state, ignore_errors=True)
            state.mkdir()
            d = start_daemon(model, sock, *args)
            try:
                f = fill(f"ipc://{sock}", idx, rng)
            finally:
                stop_daemon(d)
            before = drive_bandwidth(idx, a.threads, chunk, a.bw_seconds)
            dropped = drop_caches()
            t_start = time.monotonic()
            d = start_daemon(model, sock, *args)
            t_ready = time.monotonic() - t_start
            try:
                w = follow(f"ipc://{sock}", f["resident_bytes"])
            finally:
                stop_daemon(d)
            after = drive_bandwidth(idx, a.threads, chunk, a.bw_seconds)
            # the drive's speed swings minute to minute: its rate just before and just after
            bw = {"mib_s": (before["mib_s"] + after["mib_s"]) / 2, "before": before, "after": after,
                  "caches_dropped": before["caches_dropped"] and after["caches_dropped"]}
            ideal = f["resident_bytes"] / (bw["mib_s"] * 2**20)
            row = {"round": r, "drive_mib_s": bw["mib_s"], "resident": f["resident"],
                   "resident_bytes": f["resident_bytes"], "ideal_s": ideal, "t90_s": w["t90_s"],
                   "ratio_t90": (w["t90_s"] / ideal) if w["t90_s"] is not None else None,
                   "fill_s": w["seconds"], "fill_mib_s": w["bytes"] / max(w["seconds"], 1e-9) / 2**20,
                   "loaded": w["loaded"], "loaded_bytes": w["bytes"], "resident_after": w["resident"],
                   "start_to_serving_s": t_ready, "caches_dropped": dropped and bw["caches_dropped"],
                   "demand_misses": w["demand_misses"], "evictions": w["evictions"],
                   "drive": {k: v for k, v in bw.items()}, "curve": w["curve"]}
            rounds.append(row)
            print(f"round {r}: drive {bw['mib_s']:.0f} MiB/s, resident {f['resident']} experts "
                  f"({f['resident_bytes'] / 2**30:.2f} GiB), ideal {ideal:.2f} s, 90 % in "
                  f"{w['t90_s']:.2f} s, all in {w['seconds']:.2f} s", file=sys.stderr, flush=True)
    finally:
        if written is not None:
            shutil.rmtree(written, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    ok = all(x["ratio_t90"] is not None and x["ratio_t90"] <= TARGET_RATIO for x in rounds)
    print()
    print(f"model {model}: {idx.routed_expert_bytes / 2**30:.2f} GiB of routed experts; budget "
          f"{a.budget_frac:.0%} ({budget / 2**30:.2f} GiB); {a.threads} readers, {chunk // 1024} KiB chunks")
    hdr = (f"{'round':>5} | {'drive MiB/s':>11} | {'resident GiB':>12} | {'ideal s':>7} | "
           f"{'90% in s':>8} | {'ratio':>5} | {'all in s':>8} | {'fill MiB/s':>10} | {'loaded':>6}")
    print(hdr)
    print("-" * len(hdr))
    for x in rounds:
        print(f"{x['round']:>5} | {x['drive_mib_s']:>11.0f} | {x['resident_bytes'] / 2**30:>12.2f} | "
              f"{x['ideal_s']:>7.2f} | {x['t90_s']:>8.2f} | {x['ratio_t90']:>5.2f} | {x['fill_s']:>8.2f} | "
              f"{x['fill_mib_s']:>10.0f} | {x['loaded']:>6}")
    print(f"target: {TARGET_FRAC:.0%} of the resident bytes within {TARGET_RATIO}x resident bytes / drive "
          f"bandwidth: {'met' if ok else 'NOT met'} in every round")
    write_json(a.json, {"model": model, "routed_expert_bytes": idx.routed_expert_bytes,
                        "budget_bytes": budget, "budget_frac": a.budget_frac, "threads": a.threads,
                        "chunk_bytes": chunk, "target_frac": TARGET_FRAC, "target_ratio": TARGET_RATIO,
                        "met": ok, "rounds": rounds, "argv": sys.argv[1:]})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
