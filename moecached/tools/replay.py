"""Replay a routing trace against a live daemon as a batch-1 decode engine would.

``moecache-ctl replay TRACE [-e/--endpoint E] [--compute-ms X] [--attn-frac F] [--lookahead 0|1|2]
[--predictor trace|oracle|noisy:RECALL,EXTRA] [--warm-tokens N] [--tokens N] [--gbps X]
[--json]``

Per decode step (one token, or one multi-token ``step`` of the trace: experts unioned per
layer in first-appearance order, like the simulator), per MoE layer ``i`` in order:

1. at the layer's start issue the prefetch: lookahead 1 = this layer's predicted experts,
   lookahead 2 = the next layer's (the next step's first layer after the last); 0 = none;
2. wait the attention share (``--attn-frac``) of the layer's compute time
   (``--compute-ms / n_moe_layers``);
3. acquire the routed experts (``tag="decode"``), timing the wait (stall);
4. wait the rest of the layer's compute time; release.

Which tokens count (same rules as ``moecache-ctl policy``, so the numbers are comparable):
* a trace with decode tokens: decode tokens count; the last ``--warm-tokens`` prompt tokens
  before the first decode token are replayed first, uncounted (default: all of them);
* a trace without decode tokens (the Qwen3 prefill traces): the first ``--warm-tokens``
  tokens (default ``min(256, T // 4)``, the simulator's) warm the cache and every later token is
  treated as a decode token; the output says so.
``--tokens N`` stops after N counted tokens (the window ends right after the N-th counted
token: ``moecached.tools.simstream.window_end``, the same window as ``moecache-ctl policy --tokens N``).

Counters are the daemon's, taken as differences of ``stats()`` around the counted phase; the
lease replies give the same hits / prefetch hits / misses for this client. After the counted
phase an *all-resident* pass replays one step's experts over and over (every acquire a hit) and
reports the daemon's overhead per token (client + IPC + daemon bookkeeping, no reads).

The *drive ceiling* (tok/s if drive reads alone limited decoding: bandwidth / bytes read per
token) uses the larger of ``--gbps`` (or the 1 s probe) and the read bandwidth achieved during
the run, and says which (:func:`drive_ceiling`): a short probe of a noisy, shared drive can
under-measure it, and a ceiling below the achieved tok/s would be meaningless.

Consistency with the simulator (prefetch off, a fresh daemon, this client alone): the daemon's
hits equal ``simulate(window, "g-lru", slots, per_class_layers=..., warmup=...)``'s exactly
(same tokens, same warm-up, same slots per size class: the simulator takes a set's resident
experts first, then its misses in order, as the daemon grants a request). A second,
independent check: ``reference_lru``, the daemon's LRU class driven offline the way the
cache drives it (written apart from the simulator's replay kernel), gives the same hits too.
Both are in ``sim`` (``daemon_equals_simulator``, ``daemon_equals_reference``) and in the table.

Which tokens count, the step sets, the predictions and ``reference_lru`` are worked out offline
in :mod:`moecached.tools.replayplan`; this module drives the daemon, probes the drive and prints.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from typing import Optional

import numpy as np

from moecached.engine.trace import Trace, load_trace
from moecached.tools.replayplan import (ReplayError, parse_predictor, plan, predictions,
                                        reference_lru, step_sets)

__all__ = ["replay", "probe_drive", "format_table", "main", "drive_ceiling", "build_parser",
           "add_engine_args"]


# ---------------------------------------------------------------------------------- drive probe

def probe_drive(model_path, seconds: float = 1.0, threads: int = 8, max_bytes: int = 1 << 30,
                seed: int = 0) -> Optional[float]:
    """Read random whole experts of ``model_path`` with O_DIRECT from ``threads`` threads for
    about ``seconds`` (or ``max_bytes``); returns GB/s (1e9 B/s), or None when it cannot."""
    import mmap
    from moecached.engine.index import open_index
    try:
        idx = open_index(model_path)
    except Exception:
        return None
    layers = list(idx.expert_layers)
    rng = np.random.default_rng(seed)
    fds = {}
    try:
        for i, f in enumerate(idx.files):
            try:
                fds[i] = os.open(f, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            except OSError:
                fds[i] = os.open(f, os.O_RDONLY)
        jobs = []
        for _ in range(4096):
            l = layers[int(rng.integers(len(layers)))]
            e = int(rng.integers(idx.n_experts))
            jobs.append(idx.parts(l, e))
        lock = threading.Lock()
        state = {"i": 0, "bytes": 0, "err": None}
        t_end = time.perf_counter() + seconds

        def work():
            buf = mmap.mmap(-1, 64 << 20)
            try:
                while time.perf_counter() < t_end:
                    with lock:
                        if state["i"] >= len(jobs) or state["bytes"] >= max_bytes:
                            return
                        spans = jobs[state["i"]]
                        state["i"] += 1
                    for sp in spans:
                        a = int(sp.offset) // 4096 * 4096
                        b = -(-(int(sp.offset) + int(sp.nbytes)) // 4096) * 4096
                        n = min(b - a, len(buf))
                        got = os.preadv(fds[int(sp.file)], [memoryview(buf)[:n]], a)
                        with lock:
                            state["bytes"] += got
            except OSError as ex:
                state["err"] = ex
            finally:
                buf.close()

        t0 = time.perf_counter()
        ths = [threading.Thread(target=work) for _ in range(threads)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        dt = time.perf_counter() - t0
        if state["err"] is not None or state["bytes"] == 0:
            return None
        return state["bytes"] / dt / 1e9
    finally:
        for fd in fds.values():
            os.close(fd)


# ---------------------------------------------------------------------------------- replay

def _class_layout(client, n_layers):
    """(class_of_layer [trace layer -> class index], class slots, slot bytes, classes desc)."""
    desc = client.info.get("arena", {})
    scs = desc.get("size_classes") or []
    pos = {b: i for i, b in enumerate(client.expert_layers[:n_layers])}
    class_of = [0] * n_layers
    caps, sbytes, per_class = [], [], []
    for ci, sc in enumerate(scs):
        caps.append(int(sc["n_slots"]))
        sbytes.append(int(sc["slot_bytes"]))
        ls = sorted(pos[b] for b in sc["layers"] if b in pos)
        per_class.append(ls)
        for i in ls:
            class_of[i] = ci
    return class_of, caps, sbytes, per_class


_DELTA_KEYS = ("hits", "demand_misses", "prefetch_hits", "prefetches", "wasted_prefetches",
               "bytes_read", "reads", "evictions")


def replay(client, trace, *, compute_ms: float = 0.0, attn_frac: float = 0.3,
           lookahead: int = 0, predictor="oracle", warm_tokens: Optional[int] = None,
           tokens: Optional[int] = None, gbps: Optional[float] = None,
           gbps_source: str = "given", overhead_tokens: int = 20, seed: int = 0,
           simulate_check: bool = True, progress: bool = False, label: str = "") -> dict:
    """Replay ``trace`` (Trace or path) through ``client`` (a connected ``Client``).

    Returns a JSON-able dict (keys listed in :func:`format_table`'s rows, plus ``sim``).
    Raises ReplayError on a trace that does not fit the daemon's model.
    """
    t = trace if isinstance(trace, Trace) else load_trace(trace)
    t.validate()
    ex_layers = list(client.expert_layers)
    E = int(client.n_experts)
    if t.n_layers != len(ex_layers):
        raise ReplayError(f"trace has {t.n_layers} MoE layers, expected {len(ex_layers)} "
                          f"(the daemon's model)")
    if t.n_experts > E or (t.experts.size and int(t.experts.max()) >= E):
        raise ReplayError(f"trace has {t.n_experts} experts per layer, expected <= {E} "
                          "(the daemon's model)")
    if lookahead not in (0, 1, 2):
        raise ReplayError(f"--lookahead: found {lookahead}, expected 0, 1 or 2")
    if not 0 <= attn_frac <= 1:
        raise ReplayError(f"--attn-frac: found {attn_frac}, expected 0..1")
    if compute_ms < 0:
        raise ReplayError(f"--compute-ms: found {compute_ms}, expected >= 0")
    pred = parse_predictor(predictor) if isinstance(predictor, str) else predictor
    p = plan(t, warm_tokens, tokens)
    sub, steps, counted = p.trace, p.steps, p.counted
    L = t.n_layers
    sets = step_sets(sub.experts, steps)
    preds = predictions(pred, sub, steps, sets, E, seed) if lookahead else None
    class_of, caps, sbytes, per_class = _class_layout(client, L)
    layer_s = compute_ms / 1e3 / L
    attn_s, rest_s = layer_s * attn_frac, layer_s * (1 - attn_frac)

    s0 = client.stats()
    fresh = s0.get("reads", 0) == 0 and s0.get("hits", 0) == 0 and \
        sum(c.get("used", 0) for c in s0.get("classes", [])) == 0
    others = [c for c in s0.get("clients", []) if c.get("name") != client.name] \
        if isinstance(s0.get("clients"), list) else []

    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(steps), unit="tok", desc=label or "replay", leave=False,
                       file=sys.stderr)
        except ImportError:
            bar = None

    acq = client.acquire
    pf = client.prefetch
    sleep = time.sleep
    pc = time.perf_counter
    n_steps = len(steps)
    first_counted = counted.index(True)
    acc = dict(hits=0, prefetch_hits=0, misses=0, stall_us=0, acquire_s=0.0, accesses=0,
               acquires=0)
    s_mid = None
    t_count0 = None
    for si in range(n_steps):
        if si == first_counted:
            s_mid = client.stats()
            t_count0 = pc()
        c = counted[si]
        ss = sets[si]
        for li in range(L):
            layer = ex_layers[li]
            t_layer = pc()
            if lookahead == 1:
                q = preds[si][li]
                if q:
                    pf(layer, q)
            elif lookahead == 2:
                if li + 1 < L:
                    q = preds[si][li + 1]
                    nl = ex_layers[li + 1]
                elif si + 1 < n_steps:
                    q = preds[si + 1][0]
                    nl = ex_layers[0]
                else:
                    q = None
                if q:
                    pf(nl, q)
                if si == 0 and li == 0 and preds[0][0]:
                    pf(layer, preds[0][0])
            if attn_s > 0:
                d = t_layer + attn_s - pc()
                if d > 0:
                    sleep(d)
            want = ss[li]
            if not want:
                continue
            a0 = pc()
            lease = acq(layer, want, tag="decode")
            a1 = pc()
            if c:
                acc["hits"] += lease.hits
                acc["prefetch_hits"] += lease.prefetch_hits
                acc["misses"] += lease.misses
                acc["stall_us"] += lease.stall_us
                acc["acquire_s"] += a1 - a0
                acc["accesses"] += len(want)
                acc["acquires"] += 1
            if rest_s > 0:
                d = t_layer + layer_s - pc()
                if d > 0:
                    sleep(d)
            lease.release()
        if bar is not None:
            bar.update(1)
    wall = pc() - t_count0
    client.ping()  # every release has been processed
    s1 = client.stats()
    if bar is not None:
        bar.close()

    # all-resident pass: one step's experts, over and over. Skipped while the daemon records a
    # trace: those made-up tokens would enter it as if the engine had routed them.
    tracing = s1.get("tracing")
    o_wall = n_acq = 0
    all_hit = None
    if overhead_tokens > 0 and not tracing:
        last = sets[n_steps - 1]
        for li in range(L):
            if last[li]:
                acq(ex_layers[li], last[li]).release()
        client.ping()
        h0 = client.stats()["hits"]
        o0 = pc()
        for _ in range(overhead_tokens):
            for li in range(L):
                if last[li]:
                    acq(ex_layers[li], last[li], tag="decode").release()
                    n_acq += 1
        client.ping()
        o_wall = pc() - o0
        all_hit = client.stats()["hits"] - h0 == sum(len(x) for x in last) * overhead_tokens

    d = {k: s1.get(k, 0) - s_mid.get(k, 0) for k in _DELTA_KEYS}
    CT = p.counted_tokens
    total_slots = sum(caps)
    arena_bytes = sum(cp * b for cp, b in zip(caps, sbytes))
    all_experts = L * E
    bpt = d["bytes_read"] / CT
    res = {
        "label": label,
        "trace": str(t.meta.get("path", "")) or label,
        "model": client.info.get("model"),
        "synthetic": bool(t.meta.get("synthetic", False)),
        "note": p.note,
        "slots": total_slots, "experts_total": all_experts,
        "cache_fraction": total_slots / all_experts if all_experts else float("nan"),
        "class_slots": caps, "arena_gib": arena_bytes / 2**30,
        "model_expert_gib": sum(len(ls) * E * b for ls, b in zip(per_class, sbytes)) / 2**30,
        "warm_tokens": p.warm_tokens, "counted_tokens": CT, "window": [p.start, p.end],
        "compute_ms": compute_ms, "attn_frac": attn_frac, "lookahead": lookahead,
        "predictor": predictor if isinstance(predictor, str) else pred[0],
        "wall_s": wall, "tok_s": CT / wall if wall > 0 else float("inf"),
        "stall_ms_per_token": acc["stall_us"] / 1e3 / CT,
        "acquire_ms_per_token": acc["acquire_s"] * 1e3 / CT,
        "accesses": acc["accesses"], "hits": acc["hits"], "prefetch_hits": acc["prefetch_hits"],
        "demand_misses": acc["misses"],
        "hit_rate": acc["hits"] / acc["accesses"] if acc["accesses"] else float("nan"),
        "daemon": d,
        "prefetches": d["prefetches"], "wasted_prefetches": d["wasted_prefetches"],
        "bytes_read": d["bytes_read"], "reads": d["reads"], "bytes_per_token": bpt,
        "read_gbps": d["bytes_read"] / wall / 1e9 if wall > 0 else float("nan"),
        "read_latency": s1.get("read_latency", {}),
        "gbps": gbps, "gbps_source": gbps_source if gbps else None,
        # None when the probe was skipped (the daemon was recording a trace, or overhead_tokens=0)
        "overhead_ms_per_token": o_wall * 1e3 / overhead_tokens if n_acq else None,
        "overhead_us_per_acquire": o_wall * 1e6 / n_acq if n_acq else None,
        "overhead_all_hits": bool(all_hit) if all_hit is not None else None,
        "overhead_skipped": ("the daemon is recording a trace" if tracing and overhead_tokens > 0
                             else None),
        "fresh_daemon": bool(fresh), "other_clients": len(others),
    }
    res["drive_ceiling_tok_s"], res["ceiling_gbps"], res["ceiling_gbps_source"] = \
        drive_ceiling(gbps, gbps_source, d["bytes_read"], wall, CT)
    if compute_ms > 0:
        res["compute_only_tok_s"] = 1e3 / compute_ms
    if simulate_check and lookahead == 0:
        res["sim"] = _sim_check(p, sets, counted, class_of, caps, per_class, E, res)
    return res


def drive_ceiling(gbps, gbps_source, bytes_read, wall, counted_tokens):
    """The drive ceiling: decode tok/s if drive reads alone limited decoding, at the larger of
    ``gbps`` (probed or given) and the read bandwidth achieved during the run (``bytes_read /
    wall``; a 1 s probe under-measures a noisy, shared drive). So the run's own tok/s (with
    the same wall) is never above the ceiling.

    Returns ``(tok_s, gbps_used, source)``: source is ``gbps_source`` ("measured" / "given")
    or "achieved"; ``(None, None, None)`` without ``gbps``; tok_s is inf when nothing was read.
    """
    if not gbps:
        return None, None, None
    achieved = bytes_read / wall / 1e9 if wall > 0 else 0.0
    use, src = (achieved, "achieved") if achieved > gbps else (gbps, gbps_source)
    bpt = bytes_read / counted_tokens if counted_tokens else 0.0
    if bpt <= 0:
        return float("inf"), use, src
    tok = use * 1e9 / bpt
    if src == "achieved":
        tok = max(tok, counted_tokens / wall)  # equal but for rounding
    return tok, use, src


def _ceiling_cell(r) -> str:
    if not r.get("gbps"):
        return "n/a (no --gbps)"
    use = r.get("ceiling_gbps") or r["gbps"]
    src = r.get("ceiling_gbps_source") or r["gbps_source"]
    cell = _f(r["drive_ceiling_tok_s"], "{:.2f}") + f" @{use:.2f}"
    if src == "achieved":   # the run read faster than the probe: its own rate is the ceiling's
        cell += "*"
    return cell


def _sim_check(p, sets, counted, class_of, caps, per_class, E, res):
    """The daemon's hits against ``simulate``'s g-lru on the replayed window (the check) and
    against :func:`reference_lru` (a second, independent model of the daemon)."""
    from moecached.tools.simstream import SimulationError
    from moecached.tools.simulate import simulate
    out = {}
    try:
        r = simulate(p.trace, "g-lru", int(sum(caps)), per_class_layers=per_class,
                     warmup=p.sim_warmup)
        out.update(glru_hits=r["hits"], glru_accesses=r["accesses"], glru_hit_rate=r["hit_rate"],
                   glru_class_caps=r["class_caps"], glru_size_desc=r["size_desc"],
                   glru_warmup=r["warmup"], glru_counted_tokens=r["counted_tokens"])
        out["slots_match"] = list(r["class_caps"]) == list(caps)
        out["daemon_equals_simulator"] = (res["hits"] == r["hits"]
                                          and res["accesses"] == r["accesses"])
    except SimulationError as ex:
        out["glru_error"] = str(ex)
        out["daemon_equals_simulator"] = False
    h, a = reference_lru(sets, counted, class_of, caps, E)
    out["reference_hits"] = h
    out["reference_accesses"] = a
    out["reference_hit_rate"] = h / a if a else float("nan")
    out["daemon_equals_reference"] = (res["hits"] == h and res["accesses"] == a)
    return out


# ---------------------------------------------------------------------------------- output

def _f(x, fmt):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return fmt.format(x)


WIDTH = 100   # the table and its notes fit a terminal this wide


def _wrap(texts) -> list:
    import textwrap
    return [line for x in texts for line in textwrap.wrap(x, WIDTH, subsequent_indent="    ")]


def format_table(results, title: str = "") -> str:
    """Results of one or more replays, one column each; every line fits :data:`WIDTH`
    columns, each row that needs it explained under the table."""
    cols = [r.get("label") or f"run {i}" for i, r in enumerate(results)]

    def pct(n, r):
        a = r["accesses"]
        return f"{n} ({n / a * 100:.1f}%)" if a else str(n)

    rows = [
        ("cache slots (of all experts)", lambda r: f"{r['slots']}/{r['experts_total']} "
                                                   f"({r['cache_fraction'] * 100:.0f}%)"),
        ("experts in RAM, GiB", lambda r: f"{r['arena_gib']:.2f} of {r['model_expert_gib']:.2f}"),
        ("counted tokens (warm-up)", lambda r: f"{r['counted_tokens']} ({r['warm_tokens']})"),
        ("decode tok/s (drive+cache)", lambda r: _f(r["tok_s"], "{:.2f}")),
        ("read wait ms/token [1]", lambda r: _f(r["stall_ms_per_token"], "{:.2f}")),
        ("acquire calls ms/token [2]", lambda r: _f(r["acquire_ms_per_token"], "{:.2f}")),
        ("hits", lambda r: pct(r["hits"], r)),
        ("prefetch hits", lambda r: pct(r["prefetch_hits"], r)),
        ("demand misses", lambda r: pct(r["demand_misses"], r)),
        ("prefetches / wasted", lambda r: f"{r['prefetches']} / {r['wasted_prefetches']}"),
        ("MB read/token", lambda r: _f(r["bytes_per_token"] / 1e6, "{:.1f}")),
        ("GB read (GB/s achieved)", lambda r: f"{r['bytes_read'] / 1e9:.2f} "
                                              f"({_f(r['read_gbps'], '{:.2f}')})"),
        ("read latency p50/p99 ms", lambda r: f"{r['read_latency'].get('p50_us', 0) / 1e3:.1f}"
                                              f"/{r['read_latency'].get('p99_us', 0) / 1e3:.1f}"),
        ("drive ceiling tok/s @GB/s [3]", _ceiling_cell),
        ("daemon overhead ms/token [4]", lambda r: (f"{r['overhead_ms_per_token']:.2f} "
                                                    f"({r['overhead_us_per_acquire']:.0f} us/acq)")
                                                   if r.get("overhead_ms_per_token") is not None
                                                   else "skipped"),
    ]
    if any("sim" in r for r in results):
        def hr(r):
            return _f(r["hit_rate"], "{:.4%}")

        def sim(r, key):
            s = r.get("sim")
            if not s:
                return "n/a (prefetch on)"
            if key == "glru" and "glru_error" in s:
                return "n/a"
            return _f(s.get(f"{key}_hit_rate"), "{:.4%}")

        def same(r, key):
            s = r.get("sim")
            return (" =" if s.get(f"daemon_equals_{key}") else " DIFFERS") if s else ""

        rows += [
            ("hit rate: daemon", hr),
            ("hit rate: simulator g-lru", lambda r: sim(r, "glru") + same(r, "simulator")),
            ("hit rate: LRU reference", lambda r: sim(r, "reference") + same(r, "reference")),
        ]
    cells = [[fn(r) for r in results] for _, fn in rows]
    w0 = max(len(n) for n, _ in rows)
    ws = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = _wrap([title]) if title else []
    lines.append(f"{'':<{w0}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cols, ws)))
    for (name, _), row in zip(rows, cells):
        lines.append(f"{name:<{w0}}  " + "  ".join(f"{v:>{w}}" for v, w in zip(row, ws)))
    probe = results[0]
    legend = [
        "[1] time the daemon waited for reads of this client's misses, per token",
        "[2] time the engine spent inside acquire calls, per token: [1] plus the round trips",
        "[3] tokens/s if every byte read came at the drive's rate: the one of the "
        + (f"probe ({probe['gbps']:.2f} GB/s, {probe['gbps_source']})" if probe.get("gbps") else "probe")
        + "; * the run read faster than that, so its own rate is used",
        "[4] what the daemon adds per token when every expert is resident (all-hit probe)",
    ]
    skipped = sorted({r.get("overhead_skipped") or "off" for r in results
                      if r.get("overhead_ms_per_token") is None})
    if skipped:
        legend[3] += f"; skipped: {', '.join(skipped)}"
    lines += _wrap(legend)
    notes = sorted({r["note"] for r in results if r.get("note")})
    lines += _wrap([f"note: {n}" for n in notes])
    cfg = results[0]
    lines += _wrap([f"engine: batch 1, compute {cfg['compute_ms']:g} ms/token "
                    f"(attention share {cfg['attn_frac']:g}), lookahead {cfg['lookahead']}"
                    + (f", predictor {cfg['predictor']}" if cfg["lookahead"] else " (prefetch off)")])
    if any(not r.get("fresh_daemon") for r in results if "sim" in r):
        lines += _wrap(["note: the daemon was not fresh (used before this replay): the reference "
                        "and simulator assume a cold cache"])
    if any(r.get("other_clients") for r in results):
        lines += _wrap(["note: other clients were connected; their traffic is in the daemon counters"])
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- CLI

def add_engine_args(ap, compute_default=0.0):
    ap.add_argument("--compute-ms", type=float, default=compute_default,
                    help=f"simulated compute time per token, ms, spread evenly over the MoE "
                         f"layers (default {compute_default:g}: the drive and daemon alone)")
    ap.add_argument("--attn-frac", type=float, default=0.3,
                    help="share of a layer's compute spent before its experts are needed "
                         "(attention + router), when prefetches can land (default 0.3)")
    ap.add_argument("--lookahead", type=int, default=0, choices=(0, 1, 2),
                    help="0: no prefetch (default; the simulator check applies); 1: prefetch "
                         "this layer's predicted experts at its start; 2: the next layer's")
    ap.add_argument("--predictor", default="oracle",
                    help="trace (the trace's 'predicted'), oracle (the true route, the bound; "
                         "default), noisy:RECALL,EXTRA (each true expert kept with probability "
                         "RECALL, EXTRA wrong experts per true one)")
    ap.add_argument("--tokens", type=int, help="stop after N counted tokens (the window of "
                    "moecache-ctl policy --tokens N)")
    ap.add_argument("--gbps", type=float,
                    help="drive bandwidth for the drive ceiling (tok/s if drive reads alone "
                         "limited decoding), GB/s (default: measured for 1 s by reading random "
                         "experts of the model with O_DIRECT, when readable). The ceiling uses "
                         "the larger of this and the read bandwidth achieved during the run (a "
                         "short probe under-measures a noisy, shared drive), so the run's tok/s "
                         "is never above it; the table says which bandwidth it used")
    ap.add_argument("--seed", type=int, default=0, help="seed of the noisy predictor")


def build_parser() -> argparse.ArgumentParser:
    """The ``moecache-ctl replay`` argument parser."""
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="moecache-ctl replay",
                                 description="replay a routing trace against a live daemon as "
                                             "a batch-1 decode engine (see module doc)")
    ap.add_argument("trace", metavar="TRACE", help="routing trace .npz")
    from moecached.tools.ctlstats import ENDPOINT_HELP
    ap.add_argument("--endpoint", "-e", default=None, help=ENDPOINT_HELP)
    add_engine_args(ap)
    ap.add_argument("--warm-tokens", type=int,
                    help="tokens replayed uncounted first: the last N prompt tokens (default: "
                         "all), or for a prefill-only trace the first N (default min(256, T/4))")
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    from moecache_client import Client, ClientError

    from moecached.tools.ctlstats import resolve_endpoint
    endpoint, source = resolve_endpoint(a.endpoint)
    t = load_trace(a.trace)
    t.meta["path"] = a.trace
    try:
        c = Client(endpoint, name="moecache-ctl-replay", timeout=120, connect_timeout=10)
    except ClientError as ex:
        raise ReplayError(f"cannot reach moecached at {endpoint} (endpoint from {source}): {ex}") from None
    try:
        gbps, src = a.gbps, "given"
        if gbps is None and c.info.get("model"):
            gbps, src = probe_drive(c.info["model"]), "measured"
        r = replay(c, t, compute_ms=a.compute_ms, attn_frac=a.attn_frac,
                   lookahead=a.lookahead, predictor=a.predictor, warm_tokens=a.warm_tokens,
                   tokens=a.tokens, gbps=gbps, gbps_source=src, seed=a.seed,
                   progress=not a.no_progress and not a.json,
                   label=os.path.basename(a.trace))
    finally:
        c.close()
    if a.json:
        json.dump(r, sys.stdout, indent=1, default=float)
        print()
    else:
        print(format_table([r], title=f"replay of {a.trace} against {c.endpoint}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
