"""Read-path benchmark: cold expert loads through ReaderPool into an Arena vs fio on the same file.

What it measures
  ours: random (layer, expert) picks of a real-layout GGUF fixture whose routed experts are
        larger than the arena budget; every pick is a cold load (one job = all parts of one
        expert, read in ``--chunk`` pieces by ``--threads`` O_DIRECT reader threads, widened to the
        direct-I/O alignment and copied into a slot). ``--window`` jobs are kept in flight (an
        engine queueing several layers' experts), for ``--seconds`` per round.
  fio:  the same files, ``--rw=randread --bs=<chunk> --direct=1 --ioengine=psync
        --numjobs=<threads>``: psync with numjobs=N is our pattern exactly (N threads, each a
        blocking pread of one chunk at a time, queue depth 1 per thread); libaio iodepth=N
        from one thread would measure a submission model we do not use.
  A second fio run per round, ``--rw=randread:K`` (K = chunks per expert), reads expert-sized
  sequential runs like our loads do; both ratios are printed.
  Rounds alternate ours / fio (``--rounds``, default 3) because the disk's speed swings
  minute to minute; the page cache is dropped before each run (where allowed).

Output: a table (MiB/s per round, ratio ours/fio; target >= 0.9) and a JSON file.

Usage::

    python benchmarks/read_path.py [--model PATH.gguf | --layers 8 --experts 128]
        [--dir /work/bench-tmp] [--budget 1G] [--threads 16] [--chunk 256K] [--seconds 10]
        [--rounds 3] [--window 32] [--json out/read_path.json] [--keep]

Without ``--model`` it writes a scaled Qwen3-30B-A3B Q4_K_M fixture (dense: no file holes, so
fio reads real blocks everywhere) under ``--dir`` and deletes it afterwards unless ``--keep``.
"""
from __future__ import annotations

import argparse
import json
import resource
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import numpy as np  # noqa: E402

from moecached.engine.arena import Arena  # noqa: E402
from moecached.engine.index import open_index  # noqa: E402
from moecached.engine.readers import ReaderPool  # noqa: E402
from benchutil import fixture_model  # noqa: E402


def parse_size(s: str) -> int:
    s = s.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def ensure_fio() -> str:
    fio = shutil.which("fio")
    if fio:
        return fio
    print("fio not found: apt-get install -y fio", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    r = subprocess.run(["apt-get", "install", "-y", "fio"], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True)
        r = subprocess.run(["apt-get", "install", "-y", "fio"], env=env, capture_output=True, text=True)
    fio = shutil.which("fio")
    if not fio:
        sys.exit(f"cannot install fio: {r.stderr.strip()[-500:]}")
    return fio


def run_ours(idx, arena: Arena, pool: ReaderPool, seconds: float, window: int, rng) -> dict:
    """Keep ``window`` expert loads in flight for ``seconds``; returns bytes, seconds, MiB/s.

    Bandwidth counts chunk bytes completed between start and the deadline (like fio's io_bytes
    over its runtime); the drain of the last loads after the deadline is not timed.
    """
    layers = list(idx.expert_layers)
    tables = {l: idx.part_table(l) for l in layers}
    next_slot = {c.id: 0 for c in arena.classes}
    cond = threading.Condition()
    state = {"inflight": 0, "bytes": 0, "jobs": 0, "errors": []}

    def done(jid, err, nbytes, secs):
        with cond:
            state["inflight"] -= 1
            if err is None:
                state["bytes"] += nbytes
                state["jobs"] += 1
            else:
                state["errors"].append(str(err))
            cond.notify()

    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    b0 = pool.stats()["bytes"]
    t0 = time.perf_counter()
    deadline = t0 + seconds
    b1 = None
    while True:
        with cond:
            while state["inflight"] >= window and time.perf_counter() < deadline:
                cond.wait(0.01)
            if time.perf_counter() >= deadline or state["errors"]:
                b1 = pool.stats()["bytes"]
                t1 = time.perf_counter()
                ru1 = resource.getrusage(resource.RUSAGE_SELF)
                break
            state["inflight"] += 1
        layer = layers[int(rng.integers(len(layers)))]
        e = int(rng.integers(idx.n_experts))
        cid = idx.layer_class[layer]
        lay = arena.layout(cid)
        slot = next_slot[cid] % lay.n_slots  # round-robin: never two loads into one slot at once
        next_slot[cid] += 1
        offs, fids = tables[layer]
        reads = [(int(fids[e, j]), int(offs[e, j]), lay.part_bytes[p],
                  arena.base_address + arena.part_offset(cid, slot, p)) for j, p in enumerate(lay.parts)]
        pool.submit(reads, priority=0, callback=done)
    with cond:
        while state["inflight"] > 0:
            cond.wait()
    if state["errors"]:
        raise SystemExit("load failed: " + state["errors"][0])
    dt = t1 - t0
    return {"bytes": b1 - b0, "seconds": dt, "jobs": state["jobs"], "mib_s": (b1 - b0) / dt / 2**20,
            "drain_seconds": time.perf_counter() - t1,
            "cpu_cores": (ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime) / dt}


def fio_args(files: list[str], bs: int, threads: int, seconds: float, run: int = 1) -> list[str]:
    """fio arguments; ``run`` > 1: a new random offset every ``run`` I/Os (sequential in between)."""
    rw = "randread" if run <= 1 else f"randread:{run}"
    return ["--name=read_path", "--filename=" + ":".join(f.replace(":", "\\:") for f in files),
            f"--rw={rw}", f"--bs={bs}", "--direct=1", "--ioengine=psync", f"--numjobs={threads}",
           "--group_reporting", "--time_based", f"--runtime={seconds}", "--norandommap",
           "--randrepeat=0"]


def run_fio(fio: str, files: list[str], bs: int, threads: int, seconds: float, run: int = 1) -> dict:
    cmd = [fio] + fio_args(files, bs, threads, seconds, run) + ["--output-format=json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"fio failed: {r.stderr.strip()}")
    out = json.loads(r.stdout[r.stdout.index("{"):])
    rd = out["jobs"][0]["read"]
    return {"bytes": rd["io_bytes"], "seconds": rd["runtime"] / 1000, "mib_s": rd["bw_bytes"] / 2**20,
            "iops": rd["iops"], "cmd": " ".join(cmd)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="existing GGUF (first shard); default: write a fixture")
    ap.add_argument("--layout", default="qwen3-30b-a3b-Q4_K_M")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--dir", default="/work/bench-tmp", help="where the fixture is written")
    ap.add_argument("--budget", default="1G", help="arena budget (must be < the experts' bytes)")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--chunk", default="256K")
    ap.add_argument("--seconds", type=float, default=10.0, help="per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=int, default=32, help="expert loads kept in flight")
    ap.add_argument("--no-lock", action="store_true", help="do not mlock the arena")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "read_path.json"))
    ap.add_argument("--keep", action="store_true", help="keep the written fixture")
    a = ap.parse_args(argv)
    chunk, budget = parse_size(a.chunk), parse_size(a.budget)
    fio = ensure_fio()

    model, written = fixture_model(a, "writing fixture")
    try:
        idx = open_index(model)
        expert_bytes = idx.routed_expert_bytes
        file_bytes = sum(idx.file_sizes)
        if budget >= expert_bytes:
            raise SystemExit(f"budget {budget} >= routed expert bytes {expert_bytes}: not a cold-read test")
        arena = Arena(idx, budget_bytes=budget, lock=not a.no_lock)
        pool = ReaderPool(idx.files, threads=a.threads, chunk_bytes=chunk,
                          file_sizes=idx.file_sizes, file_mtimes_ns=idx.file_mtimes_ns)
        rng = np.random.default_rng(0)
        # fio second variant: sequential runs as long as one expert (ours reads experts whole)
        mean_slot = sum(c.slot_bytes * len(c.layers) for c in idx.size_classes) / len(idx.expert_layers)
        run_len = max(1, round(mean_slot / chunk))
        rounds = []
        dropped = True
        try:
            for r in range(a.rounds):
                dropped &= drop_caches()
                ours = run_ours(idx, arena, pool, a.seconds, a.window, rng)
                dropped &= drop_caches()
                f = run_fio(fio, idx.files, chunk, a.threads, a.seconds)
                dropped &= drop_caches()
                g = run_fio(fio, idx.files, chunk, a.threads, a.seconds, run_len)
                rounds.append({"round": r, "ours_mib_s": ours["mib_s"], "fio_mib_s": f["mib_s"],
                               "ratio": ours["mib_s"] / f["mib_s"], "ours": ours,
                               "fio": {k: v for k, v in f.items() if k != "cmd"},
                               "fio_runs_mib_s": g["mib_s"], "ratio_runs": ours["mib_s"] / g["mib_s"],
                               "fio_runs": {k: v for k, v in g.items() if k != "cmd"}})
                print(f"round {r}: ours {ours['mib_s']:8.1f} MiB/s  fio {f['mib_s']:8.1f} MiB/s  "
                      f"ratio {ours['mib_s'] / f['mib_s']:.3f}  fio randread:{run_len} {g['mib_s']:8.1f} "
                      f"MiB/s ratio {ours['mib_s'] / g['mib_s']:.3f}  (ours used {ours['cpu_cores']:.2f} cores)", file=sys.stderr, flush=True)
            st = pool.stats()
        finally:
            pool.close()
            arena.close()
        ratios = [x["ratio"] for x in rounds]
        ours_all = sum(x["ours"]["bytes"] for x in rounds) / sum(x["ours"]["seconds"] for x in rounds) / 2**20
        fio_all = sum(x["fio"]["bytes"] for x in rounds) / sum(x["fio"]["seconds"] for x in rounds) / 2**20
        fio_runs_all = (sum(x["fio_runs"]["bytes"] for x in rounds)
                        / sum(x["fio_runs"]["seconds"] for x in rounds) / 2**20)
        res = {"model": model, "files": idx.files, "file_bytes": file_bytes,
               "routed_expert_bytes": expert_bytes, "budget_bytes": budget, "arena_bytes": arena.size,
               "arena_locked": not a.no_lock, "threads": a.threads, "chunk_bytes": chunk,
               "window": a.window, "seconds_per_run": a.seconds, "caches_dropped": dropped,
               "direct": st["direct"], "align": st["align"], "job_p50_s": st["p50_s"],
               "job_p99_s": st["p99_s"], "rounds": rounds,
               "ours_mib_s": ours_all, "fio_mib_s": fio_all, "ratio": ours_all / fio_all,
               "fio_runs_mib_s": fio_runs_all, "ratio_runs": ours_all / fio_runs_all, "fio_run_len": run_len,
               "ratio_median": statistics.median(ratios), "target": 0.9,
               "argv": sys.argv[1:]}
        res["fio_cmd"] = "fio " + " ".join(fio_args(idx.files, chunk, a.threads, a.seconds))
        res["fio_runs_cmd"] = "fio " + " ".join(fio_args(idx.files, chunk, a.threads, a.seconds, run_len))
        print()
        print(f"model {model}: {len(idx.files)} file(s), {file_bytes / 2**30:.2f} GiB; routed experts "
              f"{expert_bytes / 2**30:.2f} GiB; arena {arena.size / 2**30:.2f} GiB "
              f"({'locked' if not a.no_lock else 'unlocked'}); {a.threads} threads, "
              f"{chunk // 1024} KiB chunks, {a.window} loads in flight; caches dropped: {dropped}")
        h2 = f"fio randread:{run_len}"
        print(f"{'round':>5} | {'ours MiB/s':>10} | {'fio MiB/s':>10} | {'ratio':>6} | {h2:>17} | {'ratio':>6}")
        print("-" * 70)
        for x in rounds:
            print(f"{x['round']:>5} | {x['ours_mib_s']:>10.1f} | {x['fio_mib_s']:>10.1f} | {x['ratio']:>6.3f} | "
                  f"{x['fio_runs_mib_s']:>17.1f} | {x['ratio_runs']:>6.3f}")
        print("-" * 70)
        print(f"{'all':>5} | {ours_all:>10.1f} | {fio_all:>10.1f} | {ours_all / fio_all:>6.3f} | "
              f"{fio_runs_all:>17.1f} | {ours_all / fio_runs_all:>6.3f}")
        print(f"median round ratio vs fio randread {statistics.median(ratios):.3f}, vs fio randread:{run_len} "
              f"{statistics.median([x['ratio_runs'] for x in rounds]):.3f} (target >= 0.9)")
        print("fio: " + res["fio_cmd"])
        print(f"expert load latency (ours, {chunk // 1024} KiB chunks, {idx.size_classes[0].slot_bytes / 2**20:.2f} "
              f"MiB/expert): p50 {st['p50_s'] * 1e3:.1f} ms, p99 {st['p99_s'] * 1e3:.1f} ms")
        if a.json:
            os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
            print(f"wrote {a.json}")
    finally:
        if written is not None and not a.keep:
            shutil.rmtree(written, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
