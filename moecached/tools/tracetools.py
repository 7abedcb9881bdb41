"""``moecache-ctl trace``: ``trace convert IN.jsonl OUT.npz`` turns a JSONL routing log into a
trace file (docs/trace-format.md); ``trace start FILE | stop`` records what a running daemon
serves (``moecached.tools.ctlstats.trace_main``)."""
from __future__ import annotations

import argparse
import json

from moecached.engine.trace import TraceError, convert_jsonl, save_trace


def main(argv) -> int:
    """``moecache-ctl trace convert ...`` or ``trace start FILE | stop``."""
    if argv and argv[0] == "convert":
        return convert_main(argv)
    from moecached.tools.ctlstats import trace_main
    return trace_main(argv)


def convert_main(argv) -> int:
    """``moecache-ctl trace convert IN.jsonl OUT.npz [--n-experts N] [--layers L] [--top-k K]``
    (``argv`` with or without the leading ``convert``)."""
    argv = list(argv)
    if argv and argv[0] == "convert":
        argv = argv[1:]
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="moecache-ctl trace convert",
                                 description="convert a JSONL routing log into a trace .npz "
                                             "(format: docs/trace-format.md)")
    ap.add_argument("input", help="JSONL file (token form or layer form)")
    ap.add_argument("output", help="trace .npz to write")
    ap.add_argument("--n-experts", type=int, help="experts per layer (else meta line / max id + 1)")
    ap.add_argument("--layers", type=int, help="MoE layers (else meta line / max layer + 1)")
    ap.add_argument("--top-k", type=int, help="minimum width of the experts array")
    ap.add_argument("--meta", help="JSON object merged into meta")
    a = ap.parse_args(argv)
    meta = {}
    if a.meta:
        try:
            meta = json.loads(a.meta)
        except json.JSONDecodeError as ex:
            raise TraceError(f"--meta: invalid JSON ({ex.msg}), expected a JSON object")
    t = convert_jsonl(a.input, n_experts=a.n_experts, n_layers=a.layers, top_k=a.top_k, meta=meta)
    save_trace(a.output, t)
    print(f"{a.output}: {t.n_tokens} tokens ({t.n_tokens - t.n_decode} prompt / {t.n_decode} "
          f"decode), {t.n_layers} MoE layers, top_k {t.top_k}, n_experts {t.n_experts}")
    return 0
