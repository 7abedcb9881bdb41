"""``moecache-ctl policy``: the cache-policy simulator's command line (one trace or several,
``--subst``, ``--predictor``; ``--mix``: several models' traces against one shared budget).
The simulation itself is :mod:`moecached.tools.simulate` (one model) and
:mod:`moecached.tools.mixsim` (several); this module sits above both.
"""
from __future__ import annotations

import argparse
import json
import sys

from moecached.tools.mixsim import main_mix
from moecached.tools.simulate import (DEFAULT_GBPS, POLICIES, SCAN_ADMITS, SimulationError, _json_num,
                       _main_prefetch, _main_subst, _parse_admit, _parse_policies, _parse_sizes,
                       _plot, _table, _why_nothing_counted, layout_bytes, model_bytes, run)

def main(argv=None) -> int:
    """CLI entry (``moecache-ctl policy``); returns the exit status."""
    ap = argparse.ArgumentParser(prog="moecache-ctl policy",
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


if __name__ == "__main__":
    sys.exit(main())
