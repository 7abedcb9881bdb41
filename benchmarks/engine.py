"""llama.cpp through moecached vs the resident model: decode and prompt tokens/s.

    python benchmarks/engine.py [--model PATH | --arch qwen3moe --blocks N --quant q8_0] [--rounds 5]
                                [--steps 64] [--threads 2] [--cached 1.0,0.75,0.5,0.25]
                                [--variant NAME=DAEMON_ARGS ...]

Needs the patched build (clients/llama.cpp/build.sh; --bin or MOECACHED_LLAMA_BIN or
~/.cache/moecached-llama/bin). Without --model it writes a runnable model with the expert
geometry of Qwen3-30B-A3B (hidden 2048, expert FFN 768, 128 experts, top-8) and --blocks
blocks, as architecture --arch (qwen3moe, llama or olmoe: moecache-ctl synth --runnable). One
daemon per cached fraction (slots = fraction x all experts), started before the rounds; each
round runs the resident model and every fraction, interleaved (the order reversed every other
round), with the same prompt and greedy steps (mc-decode); the first round is a warm-up (not
counted). Every
run's logits are checked against the resident run's (bit-identical or the run is reported
as wrong). ``--variant huge=--arena-dir=/mnt/huge`` adds, per fraction, a daemon started with
those arguments as well, run in the same rounds; ``--resident-copy shm=/dev/shm`` a resident run of a
copy of the model there (what the memory the weights live in costs, apart from the daemon). ``--engine-cpus 0-7`` runs every engine on those
CPUs and this process and its daemons on the others (a run's threads then land on the same cores
whichever kind it is). Each row gives the paired ratio to the resident run of the same round twice:
from the decode's tokens/s, and from the median decode step (mc-decode's ``step_us_p50``: a step
slowed by something else on the machine moves the first, rarely the second), each as median and
mean +- standard error; and, for the runs through a daemon, the served blocks' host ops a decoded
token (mc-decode's ``decode_op_us``: the acquire and release ops' time on the thread that runs them)
and their share of the median step. Prints a table and writes JSON (--json).
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "clients")]

from benchutil import start_daemon, stop_daemon  # noqa: E402
from moecached.tools import engine_llama  # noqa: E402
from moecached.engine.index import open_index  # noqa: E402
from moecached.tools.synth_runnable import write_runnable  # noqa: E402

PROMPT = ("Mixture-of-experts models keep most of their weights in routed experts; a shared "
          "daemon caches them for every engine on the machine.")


def find_bin(arg):
    if arg:
        return Path(arg)
    b = engine_llama.llama_bin()
    if b is None:
        sys.exit(f"benchmarks/engine.py: no patched llama.cpp: {engine_llama.BUILD_HINT}")
    return b


def run(bin_dir, model, dump, steps, threads, endpoint=None, cpus=None):
    r = engine_llama.decode(bin_dir, model, str(dump), prompt=PROMPT, steps=steps, threads=threads, endpoint=endpoint,
                            cpus=cpus)
    if r.returncode != 0:
        raise RuntimeError(f"mc-decode failed: {r.stderr[-1500:]}")
    # graphs llama.cpp did not build again (mc-decode's round line; None from a build that does not say)
    g = re.search(r"^round \d+ .*graphs_reused=(\d+)", r.stdout, re.M)
    return engine_llama.parse_timing(r.stdout) | {"stats": engine_llama.parse_stats(r.stdout),
                                                  "graphs_reused": int(g.group(1)) if g else None}


def cpu_list(text: str) -> set:
    """``0-7,12`` -> {0, ..., 7, 12}; ValueError naming the text."""
    out = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            lo, hi = int(lo), int(hi or lo)
            if lo > hi:
                raise ValueError
            out |= set(range(lo, hi + 1))
    except ValueError:
        raise ValueError(f"--engine-cpus {text!r}: expected CPU numbers and rising ranges, e.g. 0-7 or 0,2,4,6") from None
    return out


def mean_se(xs) -> tuple:
    """(mean, standard error) of ``xs`` (standard error 0 for fewer than two)."""
    m = statistics.mean(xs)
    return m, (statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else 0.0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", help="directory of the patched build's binaries")
    ap.add_argument("--model", help="a runnable MoE GGUF (default: write one)")
    ap.add_argument("--arch", default="qwen3moe", help="architecture of the written model")
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--quant", default="q8_0")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cached", default="1.0,0.75,0.5,0.25", help="cached fractions of all experts")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "engine.json"))
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=DAEMON_ARGS",
                    help="per fraction, another daemon with these arguments (split on spaces) in the same rounds")
    ap.add_argument("--resident-copy", action="append", default=[], metavar="NAME=DIR",
                    help="another resident row on a copy of the model in DIR (e.g. a tmpfs), in the same rounds")
    ap.add_argument("--time-limit", type=float, metavar="S",
                    help="begin no round after S seconds (the table then covers the rounds run)")
    ap.add_argument("--engine-cpus", metavar="LIST",
                    help="run the engines on these CPUs (e.g. 0-7), this process and the daemons on the others")
    a = ap.parse_args(argv)
    bin_dir = find_bin(a.bin)
    engine_cpus = None
    if a.engine_cpus:
        try:
            engine_cpus = cpu_list(a.engine_cpus)
        except ValueError as e:
            ap.error(str(e))
        mine = os.sched_getaffinity(0)
        if not engine_cpus <= mine:
            ap.error(f"--engine-cpus {a.engine_cpus}: CPUs {sorted(engine_cpus - mine)} are not this process's "
                     f"({sorted(mine)})")
        if not mine - engine_cpus:
            ap.error(f"--engine-cpus {a.engine_cpus}: every CPU of this process; leave some for the daemons")
        os.sched_setaffinity(0, mine - engine_cpus)   # the daemons (started below) inherit it
    variants = [("", [])]
    for v in a.variant:
        name, sep, args = v.partition("=")
        if not sep or not name:
            ap.error(f"--variant {v!r}: expected NAME=DAEMON_ARGS")
        variants.append((name, args.split()))
    # a row: (fraction, variant name); the plain daemon's variant name is ""
    fracs = [(float(x), name) for x in a.cached.split(",") for name, _ in variants]
    copies = {}
    for v in a.resident_copy:
        name, sep, d = v.partition("=")
        if not sep or not name or not os.path.isdir(d):
            ap.error(f"--resident-copy {v!r}: expected NAME=DIR, DIR an existing folder")
        if f"resident, {name}" in copies:
            ap.error(f"--resident-copy {v!r}: NAME {name} given twice")
        copies[f"resident, {name}"] = d
    vargs = dict(variants)
    label = lambda k: f"{int(k[0] * 100)}% cached" + (f", {k[1]}" if k[1] else "")
    with tempfile.TemporaryDirectory(prefix="moecache-engine-") as td:
        td = Path(td)
        model = a.model
        if not model:
            model = str(td / "model.gguf")
            q = str(bin_dir / "llama-quantize") if a.quant.lower() not in ("f32", "q8_0") else None
            write_runnable(model, arch=a.arch, geometry="qwen3-30b-a3b", blocks=a.blocks, quant=a.quant, quantize_bin=q)
        idx = open_index(model).to_json()
        for k, d in list(copies.items()):
            dst = os.path.join(d, f"moecache-engine-copy-{os.getpid()}.gguf")
            shutil.copyfile(model, dst)
            copies[k] = dst
        n_all = len(idx["expert_layers"]) * idx["n_experts"]
        daemons = {}
        try:
            for i, (f, name) in enumerate(fracs):
                sock = str(td / f"d{i}.sock")
                slots = max(int(round(f * n_all)), idx["top_k"] * len(idx["size_classes"]) * 2)
                daemons[f, name] = (start_daemon(model, sock, "--slots", str(slots), *vargs[name]),
                                    f"ipc://{sock}", slots)
            rows = {"resident": []} | {k: [] for k in copies} | {f: [] for f in fracs}
            wrong = []
            t_start = time.monotonic()
            for rnd in range(a.rounds + 1):
                if a.time_limit and rnd > 1 and time.monotonic() - t_start > a.time_limit:
                    print(f"--time-limit {a.time_limit:.0f} s: stopping after {rnd - 1} rounds", file=sys.stderr)
                    a.rounds = rnd - 1
                    break
                ref = td / "ref.bin"
                # the order alternates (resident first in odd rounds, last in even ones): a machine
                # that runs the first or the last run of a round faster biases no row
                order = ["resident"] + list(copies) + fracs
                if rnd % 2 == 0:
                    order.reverse()
                res = {}
                for k in order:
                    if k == "resident":
                        res[k] = run(bin_dir, model, ref, a.steps, a.threads, cpus=engine_cpus)
                    elif k in copies:
                        res[k] = run(bin_dir, copies[k], td / f"copy{list(copies).index(k)}.bin", a.steps, a.threads,
                                     cpus=engine_cpus)
                    else:
                        res[k] = run(bin_dir, model, td / f"out{fracs.index(k)}.bin", a.steps, a.threads, daemons[k][1],
                                     cpus=engine_cpus)
                for i, f in enumerate(fracs):
                    if not filecmp.cmp(ref, td / f"out{i}.bin", shallow=False):
                        wrong.append((rnd, label(f)))
                for i, k in enumerate(copies):
                    if not filecmp.cmp(ref, td / f"copy{i}.bin", shallow=False):
                        wrong.append((rnd, k))
                r0 = res["resident"]
                if rnd == 0:
                    continue   # warm-up: page cache, the 100 % daemon's arena filled
                for k, v in res.items():
                    rows[k].append(v)
                print(f"round {rnd}: resident {r0['decode_tps']:.1f} tok/s; " +
                      ", ".join(f"{label(f)} {res[f]['decode_tps']:.1f}" for f in fracs), file=sys.stderr)
        finally:
            for p, _, _ in daemons.values():
                stop_daemon(p)
            for dst in copies.values():
                if os.path.exists(dst):
                    os.unlink(dst)
    med = lambda xs: statistics.median(xs)
    base_d = med([r["decode_tps"] for r in rows["resident"]])
    base_p = med([r["prompt_tps"] for r in rows["resident"]])
    table = []
    for k in ["resident"] + list(copies) + fracs:
        d = med([r["decode_tps"] for r in rows[k]])
        p = med([r["prompt_tps"] for r in rows[k]])
        ratios = [x["decode_tps"] / y["decode_tps"] for x, y in zip(rows[k], rows["resident"])]
        # the same from the median step (None from a driver that does not print it)
        step_ratios = [y["step_us_p50"] / x["step_us_p50"] for x, y in zip(rows[k], rows["resident"])
                       if x.get("step_us_p50") and y.get("step_us_p50")]
        m, se = mean_se(ratios)
        sm, sse = mean_se(step_ratios) if step_ratios else (None, None)
        # the served blocks' host ops (mc-decode's decode_op_us: the acquire, the release, ...) a decoded
        # token, and their share of its median step (None for a resident run or an older driver)
        ops = [r["stats"]["decode_op_us"] / a.steps for r in rows[k] if "decode_op_us" in r.get("stats", {})]
        op_us = med(ops) if ops else None
        step_med = med([r["step_us_p50"] for r in rows[k] if r.get("step_us_p50")] or [0])
        table.append({"run": k if isinstance(k, str) else label(k),
                      "slots": None if isinstance(k, str) else daemons[k][2],
                      "decode_tps": d, "decode_ratio": d / base_d, "paired_ratio_median": med(ratios),
                      "prompt_tps": p, "prompt_ratio": p / base_p,
                      "decode_tps_rounds": [round(r["decode_tps"], 3) for r in rows[k]],
                      "paired_ratios": [round(x, 5) for x in ratios],
                      "paired_ratio_mean": m, "paired_ratio_se": se,
                      "step_p50_us_rounds": [r.get("step_us_p50") for r in rows[k]],
                      "step_ratios": [round(x, 5) for x in step_ratios],
                      "step_ratio_median": med(step_ratios) if step_ratios else None,
                      "step_ratio_mean": sm, "step_ratio_se": sse,
                      "op_us_per_token": op_us, "op_share_of_step": op_us / step_med if op_us is not None and step_med else None,
                      "graphs_reused": [r["graphs_reused"] for r in rows[k]],
                      "last_stats": rows[k][-1]["stats"]})
    print(f"\nmodel {os.path.basename(model)}: {len(idx['expert_layers'])} MoE blocks x {idx['n_experts']} experts, "
          f"top-{idx['top_k']}, {a.steps} steps, prompt {len(PROMPT)} bytes, {a.threads} threads, {a.rounds} rounds"
          + (f", engines on CPUs {a.engine_cpus}" if a.engine_cpus else ""))
    print("| run | slots | decode tok/s | vs resident | paired: median, mean +- se | median step: paired median, "
          "mean +- se | prompt tok/s | vs resident | host ops us a token (of the step) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t in table:
        step = ("-" if t["step_ratio_mean"] is None else
                f"{t['step_ratio_median']:.3f}, {t['step_ratio_mean']:.3f} +- {t['step_ratio_se']:.3f}")
        ops = ("-" if t["op_us_per_token"] is None else
               f"{t['op_us_per_token']:.1f}" + (f" ({100 * t['op_share_of_step']:.2f} %)" if t["op_share_of_step"] else ""))
        print(f"| {t['run']} | {t['slots'] or '-'} | {t['decode_tps']:.2f} | {t['decode_ratio']:.3f} | "
              f"{t['paired_ratio_median']:.3f}, {t['paired_ratio_mean']:.3f} +- {t['paired_ratio_se']:.3f} | {step} | "
              f"{t['prompt_tps']:.1f} | {t['prompt_ratio']:.3f} | {ops} |")
    print(f"logits bit-identical to the resident run: {'all runs' if not wrong else f'NO: {wrong}'}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"model": idx["arch"], "blocks": len(idx["expert_layers"]),
                                        "experts": idx["n_experts"], "top_k": idx["top_k"], "steps": a.steps,
                                        "threads": a.threads, "rounds": a.rounds, "engine_cpus": a.engine_cpus,
                                        "table": table,
                                        "wrong": wrong, "time": time.time()}, indent=1))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
