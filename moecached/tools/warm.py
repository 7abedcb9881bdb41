"""``moecache-ctl warm``: fill a running daemon's cache, from its state file or from a trace.

Without ``--from-trace`` the daemon reads its own state file of the model (the resident set it
saved at its last stop or periodic save) and loads what is missing, in file order, at prefetch
priority. With ``--from-trace FILE`` (docs/trace-format.md) the experts of the trace are sent in
first-use order (the first token's layers first); the daemon loads them, most wanted first, until
the budget's free slots are full. Either way the command waits and shows progress until the
fill ends (``--no-wait``: it returns once the fill started), then prints one summary line
(``--json``: the reply and the counters as JSON).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from moecached import MoecacheError
from moecached.tools.ctlstats import ENDPOINT_HELP, _client, _positive, resolve_endpoint


def first_use(trace, expert_layers, limit: int = 65535) -> list:
    """The experts of ``trace`` as ``[[block, expert], ...]`` in first-use order (token by
    token, layer by layer, router rank order), at most ``limit``. Trace layer i is the model's
    i-th expert block (``expert_layers[i]``)."""
    import numpy as np
    ex = np.asarray(trace.experts)
    T, L, k = ex.shape
    if L > len(expert_layers):
        raise MoecacheError(f"trace has {L} MoE layers, the daemon's model {len(expert_layers)}")
    ne = int(max(int(ex.max()) + 1, 1))
    flat = (np.arange(L, dtype=np.int64)[None, :, None] * ne + ex.astype(np.int64)).reshape(-1)
    flat = flat[ex.reshape(-1) >= 0]
    keys, first = np.unique(flat, return_index=True)
    order = keys[np.argsort(first, kind="stable")][:limit]
    return [[int(expert_layers[int(x) // ne]), int(x) % ne] for x in order]


def _warm_stats(c) -> tuple:
    """``(warm_loaded, warm_bytes, warm_seconds)`` of the model's ``stats``."""
    st = c.stats()
    return st.get("warm_loaded", 0), st.get("warm_bytes", 0), st.get("warm_seconds", 0.0)


def main(argv) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="moecache-ctl warm", description=(
        "Fill a running daemon's cache from its state file of the model (the resident set it "
        "saved), or with --from-trace from a routing trace's experts in first-use order; in "
        "file order, at prefetch priority, never evicting. Waits and shows progress."))
    p.add_argument("--from-trace", metavar="FILE", help="fill with this routing trace's experts "
                   "in first-use order (default: the daemon's state file of the model)")
    p.add_argument("--endpoint", "-e", default=None, help=ENDPOINT_HELP)
    p.add_argument("--model", default="*", help="the model, when the daemon serves several")
    p.add_argument("--timeout", type=_positive, default=5.0, help="seconds to wait for a reply")
    p.add_argument("--no-wait", action="store_true", help="return once the fill started")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")
    a = p.parse_args(argv)
    ep, src = resolve_endpoint(a.endpoint)
    msg = {"op": "warm"}
    with _client(ep, a.timeout, src, model=a.model) as c:
        if a.from_trace:
            from moecached.engine.trace import load_trace
            tr = load_trace(a.from_trace)
            msg["experts"] = first_use(tr, c.expert_layers)
        loaded0, bytes0, secs0 = _warm_stats(c)
        try:
            reply = c._call(msg)
        except Exception as e:
            # the daemon's error reads "CODE: message" already
            raise MoecacheError(str(e) if getattr(e, "code", None) else f"{type(e).__name__}: {e}") from None
        reply = {k: v for k, v in reply.items() if k in ("wanted", "queued", "bytes", "source")}
        live = sys.stderr.isatty()
        t0 = time.monotonic()
        loaded = nbytes = 0
        secs = -1.0
        while not a.no_wait:
            time.sleep(0.2)
            lo, by, se = _warm_stats(c)
            if se - secs0 == secs and (loaded >= reply["queued"] or lo - loaded0 == loaded):
                break   # the fill's clock (warm_seconds runs while it does) stopped: it ended
            loaded, nbytes, secs = lo - loaded0, by - bytes0, se - secs0
            if live:
                pct = 100 * loaded // max(1, reply["queued"])
                sys.stderr.write(f"\r  warm: {pct}% ({loaded}/{reply['queued']} experts, "
                                 f"{nbytes / 2**30:.2f} GiB)")
                sys.stderr.flush()
        if live and not a.no_wait:
            sys.stderr.write("\n")
    out = dict(reply, loaded=loaded, loaded_bytes=nbytes, seconds=round(max(secs, 0.0), 3),
               wall_s=round(time.monotonic() - t0, 3), waited=not a.no_wait)
    if a.json:
        print(json.dumps(out))
    elif a.no_wait:
        print(f"warm: filling {reply['queued']} of {reply['wanted']} experts "
              f"({reply['bytes'] / 2**30:.2f} GiB) from {reply['source']}")
    else:
        rate = nbytes / secs / 2**30 if secs > 0 else 0.0
        print(f"warm: loaded {loaded} of {reply['queued']} experts ({nbytes / 2**30:.2f} GiB) in "
              f"{secs:.1f} s ({rate:.2f} GiB/s) from {reply['source']}")
    return 0
