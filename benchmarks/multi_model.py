"""Two models under one budget in one daemon: the shared split against static splits.

    python benchmarks/multi_model.py [--budget 1GiB] [--qwen-tokens 1200] [--rate 60]
        [--workdir DIR] [--json benchmarks/results/multi_model.json]

Real-layout synth models of Qwen3-30B-A3B Q4_K_M (4 layers x 128 experts, 2.9 MiB each) and
Mixtral-8x7B Q4_K_M (2 layers x 8 experts, 109 MiB each) and their real traces (the ShareGPT
prefill trace, its first ``--qwen-tokens`` tokens; HumanEval 0), replayed concurrently by two
client processes (each at its own rate, so both end together: Qwen ``--rate`` tokens/s) against
one daemon, three times:

* ``shared``: the daemon's split (``split_interval_s`` = the time the simulator's 64 tokens take
  at these rates; nothing else set);
* ``equal``: the same daemon with the split never moving (its starting, equal shares);
* ``best static``: each model's min_budget = max_budget = its share in the simulator's best
  static split (``moecache-ctl policy --mix`` sweep, 9 points).

Next to each, the simulator's hit rates for the same split (``moecache-ctl policy --mix``
with the same models and traces). Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from moecached.engine.index import open_index  # noqa: E402
from moecached.tools.mixsim import MixModel, interleaving, run_mix  # noqa: E402
from moecached.tools.synth import write_model  # noqa: E402
from moecached.engine.trace import load_trace  # noqa: E402
from moecached.facts.units import parse_size  # noqa: E402

SHARED = os.environ.get("MOECACHE_SHARED", os.path.join(os.path.dirname(ROOT), "shared"))
if not os.path.isdir(SHARED):
    SHARED = "/work/shared"
CLIENT = os.path.join(ROOT, "tests", "mix_client.py")
EVERY = 64


def models(workdir):
    out = {}
    for name, layout, layers, experts in (("qwen", "qwen3-30b-a3b-Q4_K_M", 4, 128),
                                          ("mix", "mixtral-8x7b-Q4_K_M", 2, 8)):
        p = os.path.join(workdir, f"{name}-L{layers}.gguf")
        if not os.path.exists(p):
            write_model(os.path.join(SHARED, "layouts", layout + ".json"), p, layers=layers,
                        experts=experts, progress=False)
        out[name] = p
    return out


def run_daemon(paths, budget, steps, rates, tmp, interval, fixed=None):
    sock = os.path.join(tmp, "mm.sock")
    cfg = os.path.join(tmp, "mm.toml")
    with open(cfg, "w") as f:
        f.write(f'budget = {budget}\nsplit_interval_s = {interval}\n')
        for n, p in paths.items():
            f.write(f'[[models]]\nname = "{n}"\npath = "{p}"\n')
            if fixed:
                f.write(f"min_budget = {fixed[n]}\nmax_budget = {fixed[n]}\n")
    d = subprocess.Popen([sys.executable, "-m", "moecached.daemon", "--config", cfg,
                          "--endpoint", f"ipc://{sock}", "--no-lock-memory", "--arena-dir", tmp],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    from moecache_client import Client
    deadline = time.time() + 120
    while True:
        if d.poll() is not None:
            raise SystemExit("daemon exited: " + d.stdout.read())
        try:
            if os.path.exists(sock):
                ctl = Client(f"ipc://{sock}", model="*", map_arena=False, connect_timeout=2)
                break
        except Exception:
            time.sleep(0.2)
        if time.time() > deadline:
            d.kill()
            raise SystemExit("daemon did not start")
    try:
        procs = {}
        for n in paths:
            sf = os.path.join(tmp, f"{n}.json")
            with open(sf, "w") as f:
                json.dump(steps[n], f)
            procs[n] = subprocess.Popen([sys.executable, CLIENT, f"ipc://{sock}", n, "-1",
                                         "--free", sf, str(rates[n])], stdout=subprocess.PIPE,
                                        text=True)
        res = {n: json.loads(p.communicate(timeout=1800)[0].strip().splitlines()[-1])
               for n, p in procs.items()}
        ms = {m["name"]: m for m in ctl.models()["models"]}
        split = ctl.models()["split"]
        ctl.close()
    finally:
        d.terminate()
        d.wait(30)
    H = sum(r["counted_hits"] for r in res.values())
    A = sum(r["counted_accesses"] for r in res.values())
    return {"hit_rate": H / A, "models": {n: {"hit_rate": r["counted_hits"] / r["counted_accesses"],
                                              "share_bytes": ms[n]["share_bytes"],
                                              "errors": r["errors"], "wall_s": r["wall_s"]}
                                          for n, r in res.items()},
            "moves": split["moves"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--qwen-tokens", type=int, default=1200)
    ap.add_argument("--rate", type=float, default=60.0, help="Qwen tokens/s (Mixtral: so both end together)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "moecache-multi-bench"))
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "multi_model.json"))
    a = ap.parse_args(argv)
    os.makedirs(a.workdir, exist_ok=True)
    total = parse_size(a.budget)
    paths = models(a.workdir)
    tq = load_trace(os.path.join(SHARED, "traces", "qwen3_30b_a3b_sharegpt_prefill_2050.npz"))
    tm = load_trace(os.path.join(SHARED, "traces", "mixtral8x7b_humaneval0_full.npz"))
    tr = {"qwen": tq.window(0, a.qwen_tokens, layers=4), "mix": tm.window(0, None, layers=2)}
    mms = [MixModel(n, tr[n], open_index(paths[n])) for n in ("qwen", "mix")]
    t0 = time.time()
    sim = run_mix(mms, total, points=9, split_every=EVERY)
    sim_s = time.time() - t0
    order = interleaving(mms)
    steps = {n: [] for n in paths}
    for n, sets, counted in order:
        steps[n].append((sets, counted))
    n_steps = {n: len(s) for n, s in steps.items()}
    rates = {n: a.rate * n_steps[n] / n_steps["qwen"] for n in paths}
    interval = EVERY / sum(rates.values())
    best = sim["best_static"]
    rows = []
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        for label, kw, s in (("shared", {}, sim["shared"]),
                             ("equal", {"interval": 86400}, sim["equal"]),
                             ("best static", {"interval": 86400, "fixed": best["shares"]}, best)):
            r = run_daemon(paths, total, steps, rates, tmp, kw.get("interval", interval),
                           kw.get("fixed"))
            rows.append({"split": label, "daemon": r, "sim": {k: v for k, v in s.items()
                                                              if k != "trail"}})
    print(f"two models, one budget of {total / 2**30:.2f} GiB; Qwen {n_steps['qwen']} tokens at "
          f"{rates['qwen']:g}/s, Mixtral {n_steps['mix']} tokens at {rates['mix']:.2f}/s; "
          f"split_interval_s {interval:.2f} (64 tokens); simulator {sim_s:.1f} s")
    print("| split | qwen share | mix share | qwen hit | mix hit | combined (daemon) | combined (simulator) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        d = row["daemon"]
        print(f"| {row['split']} | {d['models']['qwen']['share_bytes'] / 2**20:.0f} MiB | "
              f"{d['models']['mix']['share_bytes'] / 2**20:.0f} MiB | "
              f"{d['models']['qwen']['hit_rate'] * 100:.1f}% | {d['models']['mix']['hit_rate'] * 100:.1f}% | "
              f"**{d['hit_rate'] * 100:.2f}%** | {row['sim']['hit_rate'] * 100:.2f}% |")
    print("\nsimulator sweep (moecache-ctl policy --mix):")
    from moecached.tools.mixsim import format_mix
    print(format_mix(sim))
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"budget": total, "rates": rates, "interval_s": interval, "rows": rows,
                   "sweep": [{k: v for k, v in r.items() if k != "trail"} for r in sim["static"]]},
                  f, indent=1, default=float)
    print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
