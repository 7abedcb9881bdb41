"""llama.cpp on its own (mmap, page cache, under a memory cgroup) vs llama.cpp through moecached,
in the same RAM, at 25/50/75/90/100 % of the experts in memory, cold and warm.

    python benchmarks/engine_vs_pagecache.py [--blocks 2] [--steps 32] [--threads 2]
        [--fractions 0.25,0.5,0.75,0.9,1.0] [--dir /work/bench-tmp] [--model PATH]
        [--geometry qwen3-30b-a3b] [--quant q8_0] [--json out.json]

Runs (mc-decode, the patched llama.cpp's checking driver: greedy steps, logits dumped; expert
tensors never repacked, the model memory-mapped):

* ``resident``: llama.cpp alone, no limit (cold: page cache dropped first; warm: again).
* ``page cache`` at fraction f: llama.cpp alone in a memory cgroup whose limit is the engine's
  own peak when it runs through the daemon (its memory and the non-expert weights, measured in
  this run: a cgroup without limit, page cache dropped, the daemon holding every expert) plus
  the expert budget f x routed expert bytes; the kernel's page cache decides which experts stay.
* ``daemon`` at fraction f: llama.cpp through moecached (``--moecached``), the arena = the
  expert budget (``--slots`` f x all experts); the engine runs without a cgroup.

Cold = page cache dropped (``echo 3 > /proc/sys/vm/drop_caches``), a fresh cgroup, a fresh
daemon without a state file; warm = the same run again in the same cgroup / daemon; restart =
the daemon stopped (it writes its state file), the page cache dropped, a new daemon on the same
state dir: the engine starts as soon as it serves, while its warm fill runs.

Bytes read: the engine's block input (``getrusage`` of the waited child: its page faults and
reads that reached the drive) plus the daemon's ``bytes_read`` during the run. The drive's
ceiling: the read-path benchmark's O_DIRECT loop (``read_path.run_ours``), before and after.
Every run's logits are compared with the resident warm run's (bit-identical expected).

Memory cgroups: v2 (``memory.max``, ``memory.peak``; a group under /sys/fs/cgroup with the
memory controller enabled) or v1 (``memory.limit_in_bytes``, ``memory.max_usage_in_bytes``).
Needs root. Idempotent: the model is written under ``--dir`` once and reused; daemons,
cgroups and sockets are removed at the end. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from benchutil import at_least_one, runnable_model, start_daemon, stop_daemon, write_json  # noqa: E402
from read_path import drop_caches  # noqa: E402
from moecached.tools import engine_llama  # noqa: E402
from moecached.engine.index import open_index  # noqa: E402

PROMPT = ("Mixture-of-experts models keep most of their weights in routed experts; a shared "
          "daemon caches them for every engine on the machine.")


# -- memory cgroups, v2 or v1 -------------------------------------------------------------------

class Cgroup:
    """A memory cgroup of this benchmark: ``limit`` bytes (None: none), ``peak()``, ``procs``
    (the file a process writes its pid to, to enter it), ``close()``."""

    V2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")

    def __init__(self, name: str, limit: int | None):
        if self.V2:
            root = "/sys/fs/cgroup"
            try:
                with open(f"{root}/cgroup.subtree_control", "w") as f:
                    f.write("+memory")
            except OSError:
                pass   # already on, or not ours to change: memory.max says
            self.path = f"{root}/{name}"
        else:
            self.path = f"/sys/fs/cgroup/memory/{name}"
        if os.path.isdir(self.path):
            self.close()
        os.mkdir(self.path)
        self.procs = f"{self.path}/cgroup.procs"
        self.limit = limit
        if limit is not None:
            self._write("memory.max" if self.V2 else "memory.limit_in_bytes", str(int(limit)))

    def _write(self, name: str, value: str) -> None:
        with open(f"{self.path}/{name}", "w") as f:
            f.write(value)

    def _read(self, name: str) -> str:
        with open(f"{self.path}/{name}") as f:
            return f.read().strip()

    def peak(self) -> int:
        return int(self._read("memory.peak" if self.V2 else "memory.max_usage_in_bytes"))

    def reset_peak(self) -> bool:
        try:
            self._write("memory.peak" if self.V2 else "memory.max_usage_in_bytes", "0")
            return True
        except OSError:
            return False

    def close(self) -> None:
        """Remove the group (its page cache goes to the parent)."""
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


# -- one engine run -----------------------------------------------------------------------------

#: mc-decode arguments of every run (``--cpu-moe``, ``--engine-args``)
ENGINE_ARGS: list = []


def engine(bin_dir, model, dump, steps, threads, *, cg: Cgroup | None = None, endpoint=None) -> dict:
    """mc-decode once (in ``cg`` when given); timing, bytes it read from the drive, wall time."""
    cmd = [str(bin_dir / "mc-decode"), "-m", model, "-p", PROMPT, "-n", str(steps), "-t",
           str(threads), "--dump", str(dump)] + (["--moecached", endpoint] if endpoint else []) \
        + ENGINE_ARGS
    if cg is not None:
        cmd = ["sh", "-c", f'echo $$ > {cg.procs} && exec "$@"', "sh"] + cmd
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, text=True)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.monotonic() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        so, se = out.read(), err.read()
    if p.returncode != 0:
        raise RuntimeError(f"mc-decode exited {p.returncode}: {se.strip()[-1500:]}")
    r = engine_llama.parse_timing(so)
    r.update(wall_s=wall, engine_read_bytes=ru.ru_inblock * 512, maxrss_bytes=ru.ru_maxrss * 1024,
             served=engine_llama.parse_stats(so))
    return r


def daemon_stats(ep: str) -> dict:
    from moecache_client import Client
    with Client(ep, name="bench-stats", map_arena=False) as c:
        return c.stats()


def drive_ceiling(model: str, seconds: float, threads: int) -> float:
    """MiB/s of the read path's own O_DIRECT loop on the model (random whole experts)."""
    import numpy as np
    from read_path import run_ours
    from moecached.engine.arena import Arena
    from moecached.engine.readers import ReaderPool
    idx = open_index(model)
    arena = Arena(idx, budget_bytes=min(256 << 20, idx.routed_expert_bytes // 4), lock=False)
    pool = ReaderPool(idx.files, threads=threads, chunk_bytes=256 << 10, file_sizes=idx.file_sizes,
                      file_mtimes_ns=idx.file_mtimes_ns)
    try:
        drop_caches()
        return run_ours(idx, arena, pool, seconds, 32, np.random.default_rng(0))["mib_s"]
    finally:
        pool.close()
        arena.close()


# -- the benchmark ------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", help="directory of the patched build's binaries")
    ap.add_argument("--model", help="a runnable MoE GGUF (default: write one under --dir)")
    ap.add_argument("--arch", default="qwen3moe", help="architecture of the model written (default %(default)s)")
    ap.add_argument("--geometry", default="qwen3-30b-a3b", help="its expert geometry (default %(default)s)")
    ap.add_argument("--blocks", type=int, default=2, help="its MoE blocks (default %(default)s)")
    ap.add_argument("--quant", default="q8_0", help="its quantization (default %(default)s)")
    ap.add_argument("--steps", type=int, default=32, help="greedy steps per run (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="mc-decode threads (default %(default)s)")
    ap.add_argument("--fractions", default="0.25,0.5,0.75,0.9,1.0",
                    help="shares of the routed experts in memory, each in (0, 1] (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=1, help="the whole matrix this many times; "
                    "the table shows each row's median")
    ap.add_argument("--cpu-moe", action="store_true", help="mc-decode --cpu-moe in every run: on a "
                    "GPU build the routed experts stay on the CPU (memory-mapped) as the daemon's "
                    "rows compute them, the rest on the GPU")
    ap.add_argument("--engine-args", default="", help="more mc-decode arguments for every run "
                    "(one string, split on spaces)")
    ap.add_argument("--readers", type=int, default=16, help="the daemon's reader threads")
    ap.add_argument("--daemon-arg", action="append", default=[],
                    help="one more daemon flag for every daemon run (repeatable), e.g. --daemon-arg=--chunk=4MiB")
    ap.add_argument("--bw-seconds", type=float, default=5.0,
                    help="seconds of each drive-rate measurement (default %(default)s)")
    ap.add_argument("--dir", default="/work/bench-tmp", help="the model and the runs' files (default %(default)s)")
    ap.add_argument("--json", help="where the results go (default: DIR/engine_vs_pagecache.json; the "
                    "committed figures are in benchmarks/results/)")
    a = ap.parse_args(argv)
    try:
        fracs = [float(x) for x in a.fractions.split(",")]
    except ValueError:
        ap.error(f"--fractions {a.fractions}: expected shares such as 0.25,0.5,1.0")
    if not all(0 < f <= 1 for f in fracs):
        ap.error(f"--fractions {a.fractions}: every share must be in (0, 1]")
    at_least_one(ap, a, "steps", "threads", "rounds", "blocks", "readers")
    if a.bin and not (Path(a.bin) / "mc-decode").exists():
        ap.error(f"--bin {a.bin}: no mc-decode there (clients/llama.cpp/build.sh makes one)")
    if os.geteuid() != 0:
        sys.exit("engine_vs_pagecache: needs root (memory cgroups, dropping the page cache)")
    bin_dir = Path(a.bin) if a.bin else engine_llama.llama_bin()
    if bin_dir is None:
        sys.exit(f"engine_vs_pagecache: no patched llama.cpp: {engine_llama.BUILD_HINT}")
    ENGINE_ARGS[:] = (["--cpu-moe"] if a.cpu_moe else []) + a.engine_args.split()
    work = Path(a.dir)
    work.mkdir(parents=True, exist_ok=True)
    model = a.model or runnable_model(work, blocks=a.blocks, quant=a.quant, arch=a.arch,
                                      geometry=a.geometry, bin_dir=bin_dir)
    idx = open_index(model)
    n_all = len(idx.expert_layers) * idx.n_experts
    expert_bytes = idx.routed_expert_bytes
    file_bytes = sum(idx.file_sizes)
    run_dir = Path(tempfile.mkdtemp(prefix="evp-", dir=str(work)))
    sock = str(run_dir / "d.sock")
    ep = f"ipc://{sock}"
    state = run_dir / "state"
    tag = f"mcbench-{os.getpid()}"
    rows, cgs, daemons = [], [], []
    rnd = [0]
    engine_peak = [0]
    ref = run_dir / "ref.bin"

    def say(msg):
        print(msg, file=sys.stderr, flush=True)

    def start(slots):
        d = start_daemon(model, sock, "--slots", str(slots), "--state-dir", str(state),
                         "--state-interval", "0", "--readers", str(a.readers), *a.daemon_arg)
        daemons.append(d)
        return d

    def stop(d):
        stop_daemon(d)
        daemons.remove(d)

    def row(kind, frac, temp, r, **kw):
        x = dict(run=kind, cached=frac, state=temp, round=rnd[0], **r, **kw)
        x["read_bytes"] = x["engine_read_bytes"] + x.get("daemon_read_bytes", 0)
        dump = x.pop("dump")
        x["identical"] = filecmp.cmp(ref, dump, shallow=False) if ref.exists() and dump != ref else True
        rows.append(x)
        say(f"{kind:>10} {'' if frac is None else f'{frac:.0%}':>4} {temp:>7}: "
            f"{x['decode_tps']:.2f} tok/s decode, {x['prompt_tps']:.1f} prompt, {x['wall_s']:.1f} s, "
            f"{x['read_bytes'] / 2**30:.2f} GiB read{'' if x['identical'] else ', LOGITS DIFFER'}")
        return x

    def page_cache_runs(f, slots):
        """llama.cpp alone under the limit: the engine's peak + the expert budget"""
        limit = engine_peak[0] + slots * (expert_bytes // n_all)
        drop_caches()
        cg = Cgroup(f"{tag}-pc{int(f * 100)}-r{rnd[0]}", limit)
        cgs.append(cg)
        for temp in ("cold", "warm"):
            out = run_dir / f"pc{f}{temp}.bin"
            r = engine(bin_dir, model, out, a.steps, a.threads, cg=cg)
            row("page cache", f, temp, dict(r, dump=out), limit_bytes=limit, cgroup_peak=cg.peak())
        cg.close()
        cgs.remove(cg)

    def daemon_runs(f, slots):
        """the daemon with arena = the expert budget: cold (no state file), warm, restart"""
        shutil.rmtree(state, ignore_errors=True)
        state.mkdir()
        drop_caches()
        d = start(slots)
        for temp in ("cold", "warm"):
            s0 = daemon_stats(ep)
            out = run_dir / f"d{f}{temp}.bin"
            r = engine(bin_dir, model, out, a.steps, a.threads, endpoint=ep)
            st = daemon_stats(ep)
            row("daemon", f, temp, dict(r, dump=out), arena_bytes=st["budget"]["current_bytes"],
                slots=slots, daemon_read_bytes=st["bytes_read"] - s0["bytes_read"],
                hits=st["hits"] + st["prefetch_hits"] - s0["hits"] - s0["prefetch_hits"],
                demand_misses=st["demand_misses"] - s0["demand_misses"])
        stop(d)        # writes the state file
        drop_caches()
        t0 = time.monotonic()
        d = start(slots)
        serving_s = time.monotonic() - t0
        out = run_dir / f"d{f}restart.bin"
        r = engine(bin_dir, model, out, a.steps, a.threads, endpoint=ep)
        st = daemon_stats(ep)
        row("daemon", f, "restart", dict(r, dump=out), arena_bytes=st["budget"]["current_bytes"],
            slots=slots, daemon_read_bytes=st["bytes_read"], hits=st["hits"] + st["prefetch_hits"],
            demand_misses=st["demand_misses"], warm_loaded=st["warm_loaded"],
            warm_bytes=st["warm_bytes"], warm_seconds=st["warm_seconds"], serving_s=serving_s)
        stop(d)

    try:
        ceiling = [drive_ceiling(model, a.bw_seconds, a.readers)]
        say(f"drive ceiling {ceiling[0]:.0f} MiB/s")
        # the engine's own peak through the daemon: every expert in the arena, page cache dropped
        d = start(n_all)
        engine(bin_dir, model, run_dir / "warmup.bin", a.steps, a.threads, endpoint=ep)
        drop_caches()
        cg = Cgroup(f"{tag}-peak", None)
        cgs.append(cg)
        engine(bin_dir, model, run_dir / "peak.bin", a.steps, a.threads, cg=cg, endpoint=ep)
        engine_peak[0] = cg.peak()
        say(f"engine peak through the daemon: {engine_peak[0] / 2**20:.0f} MiB")
        stop(d)
        for rnd[0] in range(a.rounds):
            # resident: llama.cpp alone, no limit
            drop_caches()
            r = engine(bin_dir, model, run_dir / "res0.bin", a.steps, a.threads)
            r0 = row("resident", None, "cold", dict(r, dump=run_dir / "res0.bin"))
            r = engine(bin_dir, model, ref, a.steps, a.threads)
            row("resident", None, "warm", dict(r, dump=ref))
            r0["identical"] = filecmp.cmp(ref, run_dir / "res0.bin", shallow=False)
            for f in fracs:
                slots = max(1, int(round(f * n_all)))
                # the page cache's runs and the daemon's alternate which goes first (the daemon in
                # odd rounds): a machine that runs the first or the last of a round faster biases
                # neither
                segs = [page_cache_runs, daemon_runs]
                for seg in (segs[::-1] if rnd[0] % 2 else segs):
                    seg(f, slots)
        ceiling.append(drive_ceiling(model, a.bw_seconds, a.readers))
    finally:
        for d in list(daemons):
            stop_daemon(d)
        for cg in cgs:
            cg.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    drive = sum(ceiling) / len(ceiling)
    for x in rows:
        x["read_s_at_ceiling"] = x["read_bytes"] / (drive * 2**20)
    table = []   # one row per (run, share, state): the median of each number over the rounds
    for key in dict.fromkeys((x["run"], x["cached"], x["state"]) for x in rows):
        xs = [x for x in rows if (x["run"], x["cached"], x["state"]) == key]
        t = dict(xs[-1])
        for k, v in t.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("cached", "round"):
                t[k] = statistics.median(x[k] for x in xs)
        t["identical"] = all(x["identical"] for x in xs)
        t["rounds"] = len(xs)
        table.append(t)
    print(f"\nmodel {os.path.basename(model)}: {len(idx.expert_layers)} MoE blocks x {idx.n_experts} "
          f"experts (top-{idx.top_k}), {file_bytes / 2**30:.2f} GiB file, {expert_bytes / 2**30:.2f} GiB "
          f"of routed experts; {a.steps} steps, {a.threads} threads; engine peak through the daemon "
          f"{engine_peak[0] / 2**20:.0f} MiB; drive ceiling {drive:.0f} MiB/s "
          f"({', '.join(f'{c:.0f}' for c in ceiling)}); cgroup v{2 if Cgroup.V2 else 1}; "
          f"{a.rounds} round{'s' if a.rounds > 1 else ''} (medians)"
          + (f"; mc-decode {' '.join(ENGINE_ARGS)}" if ENGINE_ARGS else ""))
    print("| run | experts in RAM | memory | state | decode tok/s | prompt tok/s | wall s | read GiB | "
          "read s at ceiling | hits / misses | logits |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for x in table:
        mem = (f"cgroup {x['limit_bytes'] / 2**30:.2f} GiB" if "limit_bytes" in x else
               f"arena {x['arena_bytes'] / 2**30:.2f} GiB" if "arena_bytes" in x else "no limit")
        hm = f"{x['hits']:.0f} / {x['demand_misses']:.0f}" if "hits" in x else "-"
        extra = (f" (fill {x['warm_loaded']:.0f} experts in {x['warm_seconds']:.1f} s)"
                 if x["state"] == "restart" else "")
        share = "all" if x["cached"] is None else f"{x['cached']:.0%}"
        print(f"| {x['run']} | {share} | {mem} | "
              f"{x['state']}{extra} | {x['decode_tps']:.2f} | {x['prompt_tps']:.1f} | {x['wall_s']:.1f} | "
              f"{x['read_bytes'] / 2**30:.2f} | {x['read_s_at_ceiling']:.1f} | {hm} | "
              f"{'same' if x['identical'] else 'DIFFER'} |")
    # the daemon against the page cache in the same round (same share, same state): each round's
    # ratio of decode tok/s, their mean +- the standard error (the figure a 1 % question needs)
    paired = []
    for f in fracs:
        for temp in ("cold", "warm"):
            pick = lambda kind: {x["round"]: x["decode_tps"] for x in rows
                                 if x["run"] == kind and x["cached"] == f and x["state"] == temp}
            dm, pc = pick("daemon"), pick("page cache")
            ratios = [dm[k] / pc[k] for k in sorted(dm) if k in pc and pc[k] > 0]
            if ratios:
                mean = statistics.mean(ratios)
                se = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else None   # one round: none
                paired.append({"cached": f, "state": temp, "ratios": ratios, "mean": mean, "se": se})
    print("\n| experts in RAM | state | daemon / page cache decode: mean +- standard error | rounds' ratios |")
    print("|---|---|---|---|")
    for x in paired:
        se = f"{x['mean']:.3f} +- {x['se']:.3f}" if x["se"] is not None else f"{x['mean']:.3f} (one round)"
        print(f"| {x['cached']:.0%} | {x['state']} | {se} | "
              f"{' '.join(f'{v:.3f}' for v in x['ratios'])} |")
    write_json(a.json or str(work / "engine_vs_pagecache.json"), {"model": model, "blocks": len(idx.expert_layers), "experts": idx.n_experts,
                        "top_k": idx.top_k, "file_bytes": file_bytes, "routed_expert_bytes": expert_bytes,
                        "steps": a.steps, "threads": a.threads, "engine_peak_bytes": engine_peak[0],
                        "drive_mib_s": drive, "drive_runs_mib_s": ceiling,
                        "cgroup": "v2" if Cgroup.V2 else "v1", "rounds": a.rounds,
                        "engine_args": ENGINE_ARGS, "table": table, "paired": paired, "rows": rows, "argv": sys.argv[1:],
                        "time": time.time()})
    return 0 if all(x["identical"] for x in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
