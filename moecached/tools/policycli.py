"""``moecache-ctl policy``: the cache-policy simulator's command line, its tables and its plot
(one trace or several; ``--subst``, ``--predictor``; ``--mix``: several models' traces against
one shared budget). Owns the parsing of ``--sizes``, ``--policies``, ``--admit-cold``,
``--subst`` and ``--subst-cap``, the text tables, the JSON output and ``--plot``. The
simulation itself is :mod:`moecached.tools.simulate` (with ``simstream``, ``simsizes``,
``simsubst``, ``simprefetch``) and :mod:`moecached.tools.mixsim` (several models); this module
sits above them all.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys

from moecached.engine.policy import NEEDS_FUTURE, POLICIES, SCAN_ADMITS, expand_policies
from moecached.engine.trace import load_trace
from moecached.tools.mixsim import main_mix
from moecached.tools.simprefetch import parse_predictor, simulate_prefetch
from moecached.tools.simsizes import layout_bytes, model_bytes
from moecached.tools.simstream import SimulationError, prepare
from moecached.tools.simsubst import run_subst
from moecached.tools.simulate import DEFAULT_GBPS, run


def main(argv=None) -> int:
    """CLI entry (``moecache-ctl policy``); returns the exit status."""
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="moecache-ctl policy",
                                 description="replay routing traces through cache policies")
    ap.add_argument("traces", nargs="*", metavar="TRACE", help="trace .npz files")
    ap.add_argument("--policies", default=None,
                    help=f"comma list of {', '.join(POLICIES)} (aliases: w-tinylfu, all; "
                         f"default all)")
    ap.add_argument("--sizes", default="0.25,0.5,0.75",
                    help="comma list: fractions in (0, 1] of each layer's experts (0.25, "
                         "25%%) or integer total slot counts >= 1; a size smaller than the "
                         "experts one step routes to a layer shows n/a (explained below the "
                         "table)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--layout", help="layout JSON (expert_bytes) for bytes per expert")
    src.add_argument("--model", help="GGUF model for bytes per expert and size classes")
    ap.add_argument("--gbps", type=float, default=DEFAULT_GBPS,
                    help="drive read bandwidth, GB/s (1e9 bytes/s)")
    ap.add_argument("--compute-ms", type=float, help="compute time per token, ms")
    ap.add_argument("--warmup", type=int, help="tokens at the start that never count "
                    "(default: 0 with decode tokens, else min(256, T/4))")
    ap.add_argument("--tokens", type=int, help="count only the first N counted tokens after "
                    "the warm-up (the trace is cut after them, as moecache-ctl replay --tokens)")
    ap.add_argument("--admit-cold", metavar="prompt|N",
                    help="scan-resistant admission for lru/g-lru: insert the misses of "
                         "prompt-only steps ('prompt') or of sets wider than N experts at the "
                         "cold end (other policies show n/a)")
    ap.add_argument("--scan-admit", choices=SCAN_ADMITS, default="cold",
                    help="with --admit-cold: put those misses at the cold end (default) or at "
                         "the probation point, a fifth of the keys from the cold end (the "
                         "daemon's scan_admit)")
    ap.add_argument("--predictor", metavar="P",
                    help="prefetch replay with the daemon's LRU (g-lru): oracle, "
                         "noisy:RECALL,EXTRA or cooc (co-occurrence with the previous layer, "
                         "learned online); prints demand hits, prefetch hits, wasted prefetches "
                         "and reads per token against no prefetch")
    ap.add_argument("--lookahead", type=int, default=1,
                    help="with --predictor: 1 prefetches the layer about to run, 2 the next "
                         "one, ... (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="with --predictor noisy: the seed")
    ap.add_argument("--subst", metavar="R",
                    help="substitution: comma list of tolerances r in [0, 1]; replays the view "
                         "where the top k/2 experts are routed and ranks k/2+1..k are "
                         "candidates (traces with gate weights only), or, when the trace "
                         "recorded candidates and scores, on its own routed experts and "
                         "candidates; the output names the view; with g-lru and g-opt on "
                         "the same view (--policies default: g-lru)")
    ap.add_argument("--subst-cap", metavar="N", default="none",
                    help="with --subst: comma list of caps on swaps per token-layer set, "
                         "integers >= 1 or 'none' (no cap; default)")
    ap.add_argument("--subst-refresh", action="store_true",
                    help="with --subst: also access every resident candidate, so eviction "
                         "keeps likely substitutes")
    ap.add_argument("--mix", metavar="A.npz,B.npz",
                    help="several models against one shared budget: replay these traces "
                         "interleaved (one per model) with the daemon's split, an equal split "
                         "and a sweep of static splits (TRACE arguments are then not used)")
    ap.add_argument("--budget", help="with --mix: the shared budget, e.g. 24GiB")
    ap.add_argument("--rates", help="with --mix: tokens/s per model, comma list (default: "
                    "each trace's length, so all end together)")
    ap.add_argument("--names", help="with --mix: model names, comma list (default: file names)")
    ap.add_argument("--layouts", help="with --mix: layout JSON per model, comma list")
    ap.add_argument("--models", help="with --mix: GGUF model per model, comma list")
    ap.add_argument("--split-every", type=int, default=64, help="with --mix: tokens (all "
                    "models together) between two rebalances of the shared split")
    ap.add_argument("--points", type=int, default=9, help="with --mix: static splits swept")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--plot", help="write hit rate vs cache size per policy (PNG)")
    a = ap.parse_args(argv)
    if a.mix:
        return main_mix(a)
    if not a.traces:
        ap.error("expected at least one TRACE (or --mix A.npz,B.npz)")
    policies = _parse_policies(a.policies if a.policies is not None
                               else ("g-lru" if a.subst else "all"))
    sizes = _parse_sizes(a.sizes)
    if a.gbps <= 0:
        raise SimulationError(f"--gbps: found {a.gbps}, expected > 0")
    bpe = cls = None
    if a.layout:
        bpe, cls = layout_bytes(a.layout)
    elif a.model:
        bpe, cls = model_bytes(a.model)
    if a.tokens is not None and a.tokens < 1:
        raise SimulationError(f"--tokens: found {a.tokens}, expected >= 1")
    if a.subst is not None:
        return _main_subst(a, policies, sizes, cls)
    if a.predictor is not None:
        return _main_prefetch(a, sizes, bpe, cls)
    admit = _parse_admit(a.admit_cold)
    out = run(a.traces, policies, sizes, a.warmup, bpe, cls, a.gbps, a.compute_ms, a.tokens,
              admit, a.scan_admit)
    if a.plot:
        _plot(out, policies, sizes, a.plot)
    if a.json:
        js = []
        for o in out:
            o = dict(o)
            o["results"] = [{k: _json_num(v) for k, v in r.items()}
                            for r in o["results"].values()]
            js.append(o)
        json.dump(js, sys.stdout, indent=1, default=float)
        print()
        return 0
    for o in out:
        print(f"== {o['trace']}: {o['n_tokens']} tokens, {o['n_layers']} MoE layers, "
              f"{o['n_experts']} experts, top-{o['top_k']}; counted tokens {o['counted_tokens']}"
              + (f"; {o['n_classes']} size classes" if o["n_classes"] > 1 else ""))
        if o["note"]:
            print(f"note: {o['note']}")
        if o["counted_accesses"] == 0:
            print(f"no counted accesses: {_why_nothing_counted(o)}; no hit rates to show")
            print()
            continue
        res = o["results"]
        errs = sorted({r["error"] for r in res.values() if "error" in r})

        def cell(fmt):
            def f(p, s):
                r = res[(p, s)]
                return "n/a" if "error" in r else fmt(r)
            return f

        print(_table("hit rate", policies, sizes, cell(lambda r: f"{r['hit_rate'] * 100:.1f}%")))
        if bpe is not None:
            print(_table("MB read/token", policies, sizes,
                         cell(lambda r: f"{r['bytes_per_token'] / 1e6:.1f}")))
            print(_table(f"tok/s @{a.gbps:g} GB/s", policies, sizes,
                         cell(lambda r: f"{r['drive_tok_s']:.2f}")))
            if a.compute_ms is not None:
                print(_table(f"tok/s +{a.compute_ms:g} ms", policies, sizes,
                             cell(lambda r: f"{r['tok_s_with_compute']:.2f}")))
        for e in errs:
            print(f"n/a: {e}")
        print()
    if a.plot:
        print(f"plot: {a.plot}")
    return 0


def _main_subst(a, policies, sizes, cls) -> int:
    rs = _parse_subst(a.subst)
    caps = _parse_caps(a.subst_cap)
    bad = [p for p in policies if p in NEEDS_FUTURE]
    if bad:
        raise SimulationError(f"--subst --policies: {', '.join(bad)} need the future; "
                              f"substitution replays online policies (g-opt is reported "
                              f"beside every row anyway)")
    out = run_subst(a.traces, policies, sizes, rs, caps, a.warmup, cls, a.tokens,
                    a.subst_refresh)
    if a.json:
        js = [dict(o, results=[{k: _json_num(v) for k, v in r.items()} for r in o["results"]])
              for o in out]
        json.dump(js, sys.stdout, indent=1, default=float)
        print()
        return 0
    for o in out:
        print(f"== {o['trace']}: substitution view: {o['view']}")
        if "skipped" in o:
            print(f"skipped: {o['skipped']}")
            print()
            continue
        print(f"{o['routed_per_token']} routed expert(s) per token-layer of top-{o['top_k']}; "
              f"counted tokens {o['counted_tokens']}" + ("; refresh on" if a.subst_refresh
                                                         else ""))
        if o["note"]:
            print(f"note: {o['note']}")
        res = {(r["policy"], r["r"], r["max_swaps"], r["size"]): r for r in o["results"]}
        first = {}
        for r in o["results"]:
            if "error" not in r:
                first.setdefault(r["size"], r)

        def pct(x):
            return "n/a" if x is None or x != x else f"{x * 100:.1f}%"

        rows = {"g-lru": lambda s: pct(first[s]["g_lru"]) if s in first else "n/a",
                "g-opt": lambda s: pct(first[s]["g_opt"]) if s in first else "n/a"}
        for pol in policies:
            for r in rs:
                for c in caps:
                    name = f"{pol} subst r={r:g} cap={'none' if c < 0 else c}"
                    rows[name] = (lambda k: lambda s: "n/a" if "error" in res[k + (s,)]
                                  else pct(res[k + (s,)]["served_rate"]))((pol, r, c))
                    rows["  gap closed"] = None
                    rows[name + " gap"] = (lambda k: lambda s: "n/a" if "error" in res[k + (s,)]
                                           else pct(res[k + (s,)]["gap_closed"]))((pol, r, c))
        rows.pop("  gap closed")
        print(_table("served from cache", list(rows), sizes, lambda row, s: rows[row](s)))
        for e in sorted({r["error"] for r in o["results"] if "error" in r}):
            print(f"n/a: {e}")
        print()
    return 0


def _main_prefetch(a, sizes, bpe, cls) -> int:
    pred = parse_predictor(a.predictor)
    out = []
    for p in a.traces:
        t = load_trace(p)
        st = prepare(t, a.warmup, a.tokens)
        res = []
        for sz in sizes:
            try:
                res.append(simulate_prefetch(t, sz, pred, a.lookahead, cls, bytes_per_expert=bpe,
                                             seed=a.seed, stream=st))
            except SimulationError as ex:
                res.append(dict(size=sz, error=str(ex)))
        out.append(dict(trace=os.fspath(p), predictor=a.predictor, lookahead=a.lookahead,
                        counted_tokens=st.counted_tokens, note=st.note, results=res))
    if a.json:
        json.dump([dict(o, results=[{k: _json_num(v) for k, v in r.items()} for r in o["results"]])
                   for o in out], sys.stdout, indent=1, default=float)
        print()
        return 0
    for o in out:
        print(f"== {o['trace']}: prefetch with the daemon's LRU (g-lru), predictor "
              f"{o['predictor']}, lookahead {o['lookahead']}; counted tokens {o['counted_tokens']}")
        if o["note"]:
            print(f"note: {o['note']}")
        res = {r["size"]: r for r in o["results"]}

        def cell(f):
            return lambda row, s: "n/a" if "error" in res[s] else f(res[s])
        rows = {
            "hit rate, no prefetch": lambda r: f"{r['hit_rate_no_prefetch'] * 100:.1f}%",
            "demand hits": lambda r: f"{r['demand_hits'] / r['accesses'] * 100:.1f}%",
            "prefetch hits": lambda r: f"{r['prefetch_hits'] / r['accesses'] * 100:.1f}%",
            "misses": lambda r: f"{r['misses'] / r['accesses'] * 100:.1f}%",
            "wasted prefetches/token": lambda r: f"{r['wasted_per_token']:.2f}",
            "reads/token": lambda r: f"{r['reads_per_token']:.2f}",
            "reads/token, no prefetch": lambda r: f"{r['reads_per_token_no_prefetch']:.2f}",
        }
        if bpe is not None:
            rows["wasted MB/token"] = lambda r: f"{r['wasted_bytes_per_token'] / 1e6:.1f}"
        print(_table("of counted accesses", list(rows), sizes,
                     lambda row, s: cell(rows[row])(row, s)))
        for e in sorted({r["error"] for r in o["results"] if "error" in r}):
            print(f"n/a: {e}")
        print()
    return 0


SIZES_EXPECTED = "expected a fraction in (0, 1] (0.25 or 25%) or an integer slot count >= 1"


def _parse_size(s: str):
    """One ``--sizes`` item: a fraction (has a ``.``, an exponent or ends in ``%``) in (0, 1],
    or a plain integer slot count >= 1. SimulationError (one line) otherwise."""
    s = s.strip()
    shown = shlex.quote(s)
    try:
        if s.endswith("%"):
            v = float(s[:-1]) / 100.0
        elif "." in s or "e" in s.lower():
            v = float(s)
        else:
            v = int(s)
    except ValueError:
        raise SimulationError(f"--sizes {shown}: {SIZES_EXPECTED}") from None
    if isinstance(v, float) and not (math.isfinite(v) and 0 < v <= 1):
        raise SimulationError(f"--sizes {shown}: {SIZES_EXPECTED}")
    if isinstance(v, int) and v < 1:
        raise SimulationError(f"--sizes {shown}: {SIZES_EXPECTED}")
    return v


def _parse_sizes(text: str) -> list:
    """The ``--sizes`` list: validated items (see :func:`_parse_size`), duplicates dropped;
    an empty list is refused."""
    out = []
    for item in text.split(","):
        if item.strip():
            v = _parse_size(item)
            if not any(type(v) is type(x) and v == x for x in out):
                out.append(v)
    if not out:
        raise SimulationError(f"--sizes {shlex.quote(text)}: found no sizes, expected a comma "
                              f"list of fractions in (0, 1] (0.25 or 25%) or integer slot "
                              f"counts >= 1")
    return out


def _parse_policies(text: str) -> list:
    """The ``--policies`` list (names and aliases expanded); an empty list is refused."""
    try:
        policies = expand_policies(text)
    except ValueError as ex:
        raise SimulationError(f"--policies: {ex}") from None
    if not policies:
        raise SimulationError(f"--policies {shlex.quote(text)}: found no policies, expected a "
                              f"comma list of {', '.join(POLICIES)} (aliases: w-tinylfu, all)")
    return policies


def _fmt_size(x):
    return f"{x * 100:g}%" if isinstance(x, float) else f"{x} slots"


def _table(title, rows, cols, cell):
    w0 = max([len(title)] + [len(r) for r in rows])
    heads = [_fmt_size(c) for c in cols]
    ws = [max(9, len(h)) for h in heads]
    lines = [f"{title:<{w0}}  " + "  ".join(f"{h:>{w}}" for h, w in zip(heads, ws))]
    for r in rows:
        lines.append(f"{r:<{w0}}  " + "  ".join(f"{cell(r, c):>{w}}" for c, w in zip(cols, ws)))
    return "\n".join(lines)


def _parse_admit(text):
    """``--admit-cold``: None, ``prompt`` or an int width >= 1."""
    if text is None:
        return None
    if text.strip() == "prompt":
        return "prompt"
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise SimulationError(f"--admit-cold {shlex.quote(text)}: expected 'prompt' or a width "
                              f">= 1 (sets wider than that many experts are admitted cold)")
    return v


def _json_num(v):
    """NaN (no counted accesses) as JSON null: NaN is not JSON."""
    return None if isinstance(v, float) and math.isnan(v) else v


def _why_nothing_counted(o) -> str:
    if o["n_tokens"] == 0:
        return "the trace has no tokens (recorded with no traffic?)"
    if o["counted_tokens"] == 0:
        return (f"none of its {o['n_tokens']} tokens is counted (prompt tokens and a warm-up "
                f"of {o['warmup']} tokens never count)")
    return f"its {o['counted_tokens']} counted tokens route no experts (all -1)"


def _plot(out, policies, sizes, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SimulationError("--plot needs matplotlib (pip install matplotlib)") from None
    n = len(out)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6), squeeze=False)
    xs = sorted(sizes, key=lambda s: (s if isinstance(s, float) else 2.0 + s))
    for ax, o in zip(axes[0], out):
        for pi, pol in enumerate(policies):
            pts = [(s, o["results"][(pol, s)].get("hit_rate")) for s in xs]
            pts = [(s, h) for s, h in pts if h is not None and h == h]
            if pts:
                xv = [s * 100 if isinstance(s, float) else s for s, _ in pts]
                ax.plot(xv, [h * 100 for _, h in pts], marker="o", ms=3, lw=1.2,
                        color=plt.cm.tab20(pi % 20),
                        ls="--" if pol in NEEDS_FUTURE else "-", label=pol)
        ax.set_title(os.path.basename(o["trace"]).replace(".npz", ""), fontsize=8)
        ax.set_xlabel("cache size (% of each layer's experts)" if all(
            isinstance(s, float) for s in xs) else "cache size")
        ax.set_ylabel("hit rate (%)")
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    axes[0][-1].legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _parse_subst(text: str) -> list:
    """``--subst``: comma list of tolerances in [0, 1]."""
    out = []
    for item in text.split(","):
        if not item.strip():
            continue
        try:
            v = float(item)
        except ValueError:
            v = float("nan")
        if not (0.0 <= v <= 1.0):
            raise SimulationError(f"--subst {shlex.quote(item.strip())}: expected a tolerance "
                                  f"0 <= r <= 1 (0.5 grants a candidate scoring at least half "
                                  f"the missing expert's score)")
        if v not in out:
            out.append(v)
    if not out:
        raise SimulationError(f"--subst {shlex.quote(text)}: found no tolerances, expected a "
                              f"comma list such as 0.5,0.8")
    return out


def _parse_caps(text: str) -> list:
    """``--subst-cap``: comma list of ints >= 1 or ``none`` (-1 = no cap)."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if item.lower() == "none":
            v = -1
        else:
            try:
                v = int(item)
            except ValueError:
                v = 0
            if v < 1:
                raise SimulationError(f"--subst-cap {shlex.quote(item)}: expected an integer "
                                      f">= 1 (swaps per token-layer set) or 'none'")
        if v not in out:
            out.append(v)
    if not out:
        raise SimulationError(f"--subst-cap {shlex.quote(text)}: found no caps, expected e.g. "
                              f"1,none")
    return out


if __name__ == "__main__":
    sys.exit(main())
