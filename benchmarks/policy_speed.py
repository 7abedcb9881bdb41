"""Replay speed of every simulator policy on the shared traces (accesses per second).

    python benchmarks/policy_speed.py [--traces DIR] [--sizes 0.25,0.5] [--repeat 3] [--json OUT]

Counts every access the kernel replays (warm-up included) and times
``moecached.engine.policy.replay`` alone (stream building and policy construction excluded).
The ``--repeat`` rounds are interleaved: each round replays every policy x trace x size once,
in the same order, so a slow spell of a shared machine falls on every policy alike; a cell's
figure is its best round. Prints a table of M accesses/s per policy (aggregate over the traces
and sizes, and the slowest trace x size; every cell in the JSON). Targets: >= 2 M/s for the online policies (the LRU family, LFU, ARC, W-TinyLFU
...), >= 0.5 M/s for the Belady policies (opt, g-opt), which look at the future.
"""
import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moecached.tools import simsizes, simstream  # noqa: E402
from moecached.engine.policy import NEEDS_FUTURE, POLICIES, make_policy, replay  # noqa: E402
from moecached.engine.trace import load_trace  # noqa: E402


def target(policy: str) -> float:
    """M accesses/s a policy must reach on every trace x size."""
    return 0.5 if policy in NEEDS_FUTURE else 2.0


def streams(paths):
    """(name, stream) per trace: built once, outside every timing."""
    return [(p.stem, simstream.prepare(load_trace(p))) for p in paths]


def replay_once(st, policy, size) -> float:
    """Seconds of one replay of ``st`` through a fresh ``policy`` at ``size`` (one budget for
    the whole trace, or one per layer for the per-layer policies)."""
    L, E = st.n_layers, st.n_experts
    cls = [list(range(L))]
    class_caps, layer_caps, _ = simsizes.capacities(size, L, E, cls)
    group, caps = simsizes.budgets(POLICIES[policy][0], cls, class_caps, layer_caps, E)
    pol = make_policy(policy, group, caps, st.next_use if policy in NEEDS_FUTURE else None)
    t0 = time.perf_counter()
    replay(pol, st.keys, st.set_start, st.set_layer, st.set_counted, st.set_tokens_before, L)
    return time.perf_counter() - t0


def measure(sts, policies, sizes, rounds) -> dict:
    """Best seconds per (policy, trace, size) over ``rounds`` interleaved rounds."""
    best = {}
    for _ in range(rounds):
        for pol in policies:
            for name, st in sts:
                for s in sizes:
                    dt = replay_once(st, pol, s)
                    k = (pol, name, s)
                    best[k] = min(best.get(k, float("inf")), dt)
    return best


def main(argv=None):
    here = Path(__file__).resolve().parents[1]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=os.environ.get(
        "MOECACHE_SHARED", str(here.parent / "shared")) + "/traces")
    ap.add_argument("--sizes", default="0.25,0.5")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds (best of them)")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                   "results", "policy_speed.json"))
    a = ap.parse_args(argv)
    paths = sorted(Path(a.traces).glob("*.npz"))
    if not paths:
        print(f"no traces in {a.traces}", file=sys.stderr)
        return 1
    if a.repeat < 1:
        print(f"--repeat: found {a.repeat}, expected >= 1", file=sys.stderr)
        return 1
    sizes = [float(s) for s in a.sizes.split(",")]
    policies = list(POLICIES)
    sts = streams(paths)
    best = measure(sts, policies, sizes, a.repeat)
    rows = []
    for pol in policies:
        per = {}
        tot_acc = tot_s = 0.0
        for name, st in sts:
            for s in sizes:
                n, dt = len(st.keys), best[(pol, name, s)]
                per[f"{name}@{s:g}"] = n / dt / 1e6
                tot_acc += n
                tot_s += dt
        rows.append(dict(policy=pol, maccess_per_s=tot_acc / tot_s / 1e6, accesses=int(tot_acc),
                         seconds=tot_s, per_trace_size=per, target=target(pol)))
    print(f"replay speed, {len(paths)} traces x sizes {a.sizes}, best of {a.repeat} interleaved "
          f"rounds ({platform.processor() or platform.machine()}, python "
          f"{platform.python_version()})")
    print(f"{'policy':<13} {'M acc/s':>8} {'min M/s':>8} {'target':>7}  ok")
    ok_all = True
    for r in rows:
        mn = min(r["per_trace_size"].values())
        ok = mn >= r["target"]
        ok_all &= ok
        print(f"{r['policy']:<13} {r['maccess_per_s']:>8.2f} {mn:>8.2f} "
              f"{r['target']:>7.1f}  {'yes' if ok else 'NO'}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(dict(traces=[str(p) for p in paths], sizes=sizes, repeat=a.repeat,
                           interleaved=True, machine=platform.machine(),
                           python=platform.python_version(), results=rows), fh, indent=1)
        print(f"wrote {a.json}")
    return 0 if ok_all else 2


if __name__ == "__main__":
    sys.exit(main())
