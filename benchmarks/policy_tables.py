"""Tables and plot of docs/policies.md ("Closing the gap to Belady"): per shared trace and
cache size, the daemon's g-lru, the best policy the daemon can run, scan-resistant admission,
substitution (traces with gate weights) and g-opt, with the share of the g-lru -> g-opt gap
each closes.

    python benchmarks/policy_tables.py [--traces DIR] [--sizes 0.1,0.25,0.5]
                                       [--json benchmarks/results/policy_tables.json]
                                       [--md OUT.md] [--plot docs/policies_gap.png]

Deterministic (replays, no timing), so the numbers are machine-independent.
"""
import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moecached.tools import simulate as sim  # noqa: E402
from moecached.tools import simstream, simsubst  # noqa: E402
from moecached.engine.trace import load_trace  # noqa: E402

HERE = Path(__file__).resolve().parent
DAEMON_POLICIES = ("g-lru", "lru", "g-lfu-decay", "lfu-subst", "g-slru")   # policy; eviction
SUBST_POLICIES = ("g-lru", "lru", "lfu-subst")
SUBST = [(0.5, 1), (0.5, -1), (0.8, 1), (0.8, -1)]


def gap(x, lo, hi):
    if x is None or lo is None or hi is None or hi == lo:
        return None
    return (x - lo) / (hi - lo)


def rate(trace, policy, size, **kw):
    try:
        return sim.simulate(trace, policy, size, **kw)["hit_rate"]
    except simstream.SimulationError:
        return None


def measure(path, sizes):
    t = load_trace(path)
    st = simstream.prepare(t)
    rows = []
    view = None
    try:
        view = simsubst.subst_view(t)
    except simstream.SimulationError:
        pass
    for sz in sizes:
        r = dict(size=sz)
        r["g_lru"] = rate(t, "g-lru", sz, stream=st)
        r["g_opt"] = rate(t, "g-opt", sz, stream=st)
        daemon = {p: rate(t, p, sz, stream=st) for p in DAEMON_POLICIES}
        ok = {p: v for p, v in daemon.items() if v is not None}
        r["best_daemon_policy"] = max(ok, key=ok.get)
        r["best_daemon"] = ok[r["best_daemon_policy"]]
        r["admit_cold_prompt"] = rate(t, "g-lru", sz, stream=st, admit_cold="prompt")
        r["gap_best_daemon"] = gap(r["best_daemon"], r["g_lru"], r["g_opt"])
        r["gap_admit_cold"] = gap(r["admit_cold_prompt"], r["g_lru"], r["g_opt"])
        if view is not None:
            for pol in SUBST_POLICIES:
                for rr, cap in SUBST:
                    key = f"subst_{pol}_r{rr:g}_cap{'none' if cap < 0 else cap}"
                    try:
                        o = simsubst.simulate_subst(view, pol, sz, rr, cap)
                    except simstream.SimulationError:
                        r[key] = None
                        continue
                    r["view_g_lru"], r["view_g_opt"] = o["g_lru"], o["g_opt"]
                    r[key] = o["served_rate"]
                    r[key + "_gap"] = o["gap_closed"]
        rows.append(r)
    return dict(trace=os.path.basename(path), counted_tokens=st.counted_tokens, note=st.note,
                weights=view is not None, subst_view=simsubst.SUBST_VIEW if view else None,
                rows=rows)


def pct(x):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 100:.1f} %"


def markdown(res):
    out = []
    for o in res:
        out.append(f"**{o['trace']}** ({o['counted_tokens']} counted tokens"
                   + (f"; {o['note']}" if o["note"] else "") + ")\n")
        out.append("| size | g-lru | best daemon policy | admit cold (prompt) | g-opt | gap closed: "
                   "best daemon | gap closed: admission |")
        out.append("|---|---:|---:|---:|---:|---:|---:|")
        for r in o["rows"]:
            out.append(f"| {r['size'] * 100:g} % | {pct(r['g_lru'])} | {pct(r['best_daemon'])} "
                       f"(`{r['best_daemon_policy']}`) | {pct(r['admit_cold_prompt'])} | "
                       f"{pct(r['g_opt'])} | {pct(r['gap_best_daemon'])} | "
                       f"{pct(r['gap_admit_cold'])} |")
        out.append("")
        if o["weights"]:
            out.append(f"Substitution view ({o['subst_view']}): served from cache (gap closed)\n")
            heads = [f"{p} r {rr:g} cap {'none' if c < 0 else c}" for p in SUBST_POLICIES
                     for rr, c in SUBST]
            out.append("| size | g-lru | " + " | ".join(heads) + " | g-opt |")
            out.append("|---|---:|" + "---:|" * len(heads) + "---:|")
            for r in o["rows"]:
                cells = []
                for p in SUBST_POLICIES:
                    for rr, c in SUBST:
                        k = f"subst_{p}_r{rr:g}_cap{'none' if c < 0 else c}"
                        cells.append(f"{pct(r.get(k))} ({pct(r.get(k + '_gap'))})")
                out.append(f"| {r['size'] * 100:g} % | {pct(r.get('view_g_lru'))} | "
                           + " | ".join(cells) + f" | {pct(r.get('view_g_opt'))} |")
            out.append("")
    return "\n".join(out)


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(res), figsize=(3.6 * len(res), 3.4), squeeze=False)
    for ax, o in zip(axes[0], res):
        xs = [r["size"] * 100 for r in o["rows"]]

        def line(key, label, **kw):
            ys = [r.get(key) for r in o["rows"]]
            pts = [(x, y * 100) for x, y in zip(xs, ys) if y is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, lw=1.2, label=label, **kw)
        if o["weights"]:
            line("view_g_lru", "g-lru (top-1 view)", color="C0")
            line("subst_g-lru_r0.5_cap1", "g-lru + subst r 0.5", color="C2")
            line("subst_g-lru_r0.8_cap1", "g-lru + subst r 0.8", color="C3")
            line("subst_lru_r0.5_cap1", "lru + subst r 0.5", color="C4")
            line("subst_lfu-subst_r0.5_cap1", "lfu-subst + subst r 0.5", color="C1")
            line("view_g_opt", "g-opt (top-1 view)", color="k", ls="--")
        else:
            line("g_lru", "g-lru", color="C0")
            line("best_daemon", "best daemon policy", color="C1")
            line("admit_cold_prompt", "g-lru, prompt admitted cold", color="C5")
            line("g_opt", "g-opt", color="k", ls="--")
        ax.set_title(o["trace"].replace(".npz", ""), fontsize=7)
        ax.set_xlabel("cache size (% of each layer's experts)", fontsize=7)
        ax.set_ylabel("served from cache (%)", fontsize=7)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=5.5, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default=str(HERE.parents[1] / "shared" / "traces"))
    ap.add_argument("--sizes", default="0.1,0.25,0.5")
    ap.add_argument("--json", default=str(HERE / "results" / "policy_tables.json"))
    ap.add_argument("--md", help="also write the Markdown tables here")
    ap.add_argument("--plot", default=str(HERE.parent / "docs" / "policies_gap.png"))
    a = ap.parse_args()
    sizes = [float(x) for x in a.sizes.split(",")]
    paths = sorted(str(p) for p in Path(a.traces).glob("*.npz"))
    if not paths:
        sys.exit(f"--traces {a.traces}: no *.npz traces there")
    res = [measure(p, sizes) for p in paths]
    md = markdown(res)
    print(md)
    with open(a.json, "w") as fh:
        json.dump(res, fh, indent=1)
    if a.md:
        with open(a.md, "w") as fh:
            fh.write(md + "\n")
    if a.plot:
        plot(res, a.plot)
        print(f"plot: {a.plot}")
    print(f"json: {a.json}")


if __name__ == "__main__":
    main()
