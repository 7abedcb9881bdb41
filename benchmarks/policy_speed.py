"""Replay speed of every simulator policy on the shared traces (accesses per second).

    python benchmarks/policy_speed.py [--traces DIR] [--sizes 0.25,0.5] [--repeat 3] [--json OUT]

Counts every access the kernel replays (warm-up included), takes the best of ``--repeat`` runs
of ``moecached.engine.policy.replay`` (stream building and policy construction excluded), and prints a table
of M accesses/s per policy and trace. Targets: >= 2 M/s for the LRU family,
>= 0.5 M/s for the Belady policies (opt, g-opt).
"""
import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moecached.tools import simulate as sim  # noqa: E402
from moecached.engine.policy import NEEDS_FUTURE, POLICIES, make_policy, replay  # noqa: E402
from moecached.engine.trace import load_trace  # noqa: E402

LRU_FAMILY = ["lru", "g-lru", "slru", "lru-2", "arc", "w-tinylfu-1", "w-tinylfu-10", "lfu",
              "g-lfu"]


def bench(trace_path, policy, size, repeat):
    t = load_trace(trace_path)
    st = sim.prepare(t)
    L, E = st.n_layers, st.n_experts
    _, layer_caps, _ = sim.capacities(size, L, E)
    if POLICIES[policy][0] == "layer":
        group, caps = np.repeat(np.arange(L), E), layer_caps
    else:
        group, caps = np.zeros(L * E, np.int64), np.array([layer_caps.sum()])
    best = float("inf")
    for _ in range(repeat):
        pol = make_policy(policy, group, caps, st.next_use if policy in NEEDS_FUTURE else None)
        t0 = time.perf_counter()
        replay(pol, st.keys, st.set_start, st.set_layer, st.set_counted,
               st.set_tokens_before, L)
        best = min(best, time.perf_counter() - t0)
    return len(st.keys), best


def main(argv=None):
    here = Path(__file__).resolve().parents[1]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=os.environ.get(
        "MOECACHE_SHARED", str(here.parent / "shared")) + "/traces")
    ap.add_argument("--sizes", default="0.25,0.5")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "policy_speed.json"))
    a = ap.parse_args(argv)
    paths = sorted(Path(a.traces).glob("*.npz"))
    if not paths:
        print(f"no traces in {a.traces}", file=sys.stderr)
        return 1
    sizes = [float(s) for s in a.sizes.split(",")]
    rows = []
    for pol in POLICIES:
        tot_acc = tot_s = 0.0
        per = {}
        for p in paths:
            for s in sizes:
                n, dt = bench(p, pol, s, a.repeat)
                per[f"{p.stem}@{s:g}"] = n / dt / 1e6
                tot_acc += n
                tot_s += dt
        rows.append(dict(policy=pol, maccess_per_s=tot_acc / tot_s / 1e6, accesses=int(tot_acc),
                         seconds=tot_s, per_trace_size=per))
    target = {p: 2.0 for p in LRU_FAMILY} | {"opt": 0.5, "g-opt": 0.5}
    print(f"replay speed, {len(paths)} traces x sizes {a.sizes}, best of {a.repeat} "
          f"({platform.processor() or platform.machine()}, python {platform.python_version()})")
    print(f"{'policy':<13} {'M acc/s':>8} {'min M/s':>8} {'target':>7}  ok")
    ok_all = True
    for r in rows:
        mn = min(r["per_trace_size"].values())
        ok = mn >= target[r["policy"]]
        ok_all &= ok
        print(f"{r['policy']:<13} {r['maccess_per_s']:>8.2f} {mn:>8.2f} "
              f"{target[r['policy']]:>7.1f}  {'yes' if ok else 'NO'}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(dict(traces=[str(p) for p in paths], sizes=sizes, repeat=a.repeat,
                           machine=platform.machine(), python=platform.python_version(),
                           results=rows), fh, indent=1)
        print(f"wrote {a.json}")
    return 0 if ok_all else 2


if __name__ == "__main__":
    sys.exit(main())
