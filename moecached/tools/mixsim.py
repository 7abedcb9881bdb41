"""Several models' traces against one shared budget: ``moecache-ctl policy --mix A.npz,B.npz``.

The traces are interleaved by time: model m issues its steps at ``rates[m]`` tokens per second
(default: each trace's length over the longest, so all of them end together), step j at time
``tokens_before(j) / rate``; steps at the same time go in the order the traces were named. Each
model replays as the daemon serves it (``g-lru``: the daemon's LRU per size class, every set of
one layer pinned while it loads, exactly ``moecached.tools.replayplan.reference_lru``), with the
daemon's ghost entries (``moecached.daemon.split``): per size class a FIFO of the keys evicted last,
as many as one more step of budget would add; a demanded miss on one of them is a ghost hit.

Three ways to split the budget, side by side:

* ``shared``: ``moecached.daemon.split.Split``, the daemon's own code: every ``split_every`` tokens
  (all models' tokens together) :meth:`Split.rebalance` gets the ghost hits counted since the
  last call, and the shares it returns are applied at once (a shrink evicts LRU victims into
  the ghost list, as the cache's ``set_budget`` does).
* ``equal``: the split's starting shares (equal by weight within each model's bounds), frozen.
* ``static``: a sweep of frozen splits (two models: model A's share from its minimum to its
  maximum in ``points`` steps, the rest to B; more models: each model's share swept with the
  rest split equally).

Hit rates count what ``moecache-ctl policy`` counts per trace (decode tokens, or every token
after the warm-up); the combined hit rate is all models' hits over all their accesses.
"""
from __future__ import annotations

import json
import mmap
import os
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np

from moecached.engine.policy import LRU
from moecached.daemon.split import Member, Split, SplitError, least_share
from moecached.engine.trace import Trace, load_trace
from moecached.tools.replayplan import pin_resident
from moecached.tools.simstream import SimulationError, prepare

__all__ = ["MixModel", "layout_index", "mix_members", "interleaving", "replay_mix", "run_mix", "main_mix",
           "DEFAULT_SPLIT_EVERY"]

#: tokens (all models together) between two rebalances in the simulator
DEFAULT_SPLIT_EVERY = 64


@dataclass
class _SC:
    id: int
    layers: list
    parts: list
    part_bytes: dict
    slot_bytes: int


class _LayoutIndex:
    """The size classes of a layout JSON's first ``n_layers`` MoE layers (what
    ``plan_slots``/``arena_bytes`` read of an index), for a model not written to disk."""

    def __init__(self, size_classes, n_experts):
        self.size_classes = size_classes
        self.n_experts = n_experts


def layout_index(path, n_layers: int, n_experts: int):
    """A duck-typed expert index from a layout JSON (``expert_bytes`` rows): its first
    ``n_layers`` MoE layers grouped into size classes by equal parts, as the daemon's index
    groups them. Raises SimulationError for an unreadable layout or too few layers."""
    try:
        with open(path) as fh:
            d = json.load(fh)
        rows = sorted(d["expert_bytes"], key=lambda r: r["layer"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SimulationError(f"{path}: unreadable layout ({e}), expected a layout JSON with "
                              "expert_bytes")
    if len(rows) < n_layers:
        raise SimulationError(f"{path}: {len(rows)} MoE layers, expected >= {n_layers} "
                              "(the trace's layers)")
    classes: dict = {}
    for i, r in enumerate(rows[:n_layers]):
        parts = sorted(k for k, v in r.items() if isinstance(v, dict) and "bytes_per_expert" in v)
        pb = tuple((p, int(r[p]["bytes_per_expert"]), str(r[p].get("ggml_type"))) for p in parts)
        classes.setdefault(pb, []).append(i)
    scs = []
    for cid, (pb, layers) in enumerate(classes.items()):
        scs.append(_SC(cid, layers, [p for p, _, _ in pb], {p: b for p, b, _ in pb},
                       sum(b for _, b, _ in pb)))
    return _LayoutIndex(scs, int(n_experts))


@dataclass
class MixModel:
    """One model of the mix: name, trace (path or Trace), index (GGUF ``open_index`` or
    :func:`layout_index`), tokens per second, bounds and weight of its share."""
    name: str
    trace: object
    index: object
    rate: Optional[float] = None
    min_bytes: Optional[int] = None
    max_bytes: Optional[int] = None
    weight: float = 1.0


class _Model:
    """Replay state of one model: an LRU and a ghost FIFO per size class."""

    def __init__(self, mm: MixModel, warmup, tokens):
        t = load_trace(mm.trace) if not isinstance(mm.trace, Trace) else mm.trace
        self.trace = t
        self.st = st = prepare(t, warmup, tokens)
        self.name = mm.name
        E = self.E = st.n_experts
        L = st.n_layers
        idx = mm.index
        if sum(len(sc.layers) for sc in idx.size_classes) != L:
            raise SimulationError(f"model {mm.name}: its index has "
                                  f"{sum(len(sc.layers) for sc in idx.size_classes)} MoE layers, "
                                  f"the trace {L}: expected the same layers")
        self.cls_of = [0] * L
        self.cids = [sc.id for sc in idx.size_classes]
        # layers of a GGUF index are block numbers: trace layer i is the i-th of them
        blocks = sorted(b for sc in idx.size_classes for b in sc.layers)
        tl = {b: i for i, b in enumerate(blocks)}
        for sc in idx.size_classes:
            for b in sc.layers:
                self.cls_of[tl[b]] = sc.id
        self.lru = {cid: LRU(L * E) for cid in self.cids}
        self.cap = {cid: 0 for cid in self.cids}
        self.ghost = {cid: {} for cid in self.cids}
        self.gsize = {cid: 0 for cid in self.cids}
        self.slot_bytes = {sc.id: sc.slot_bytes for sc in idx.size_classes}
        # steps: [(tokens_before, [(layer, [keys]), ...], counted)]
        self.steps = []
        ss, sl, keys = st.set_start, st.set_layer, st.keys
        cur = None
        for s in range(len(sl)):
            tb = int(st.set_tokens_before[s])
            if cur is None or cur[0] != tb:
                cur = (tb, [], bool(st.set_counted[s]))
                self.steps.append(cur)
            cur[1].append((int(sl[s]), [int(k) for k in keys[ss[s]:ss[s + 1]]]))
        self.hits = self.acc = self.ghost_hits = self.ghost_total = 0
        self.bytes_read = 0
        self.hits_counted_layer = np.zeros(L, np.int64)

    def _evict_one(self, cid):
        lr = self.lru[cid]
        k = lr.victim()
        lr.remove(k)
        g = self.ghost[cid]
        if self.gsize[cid] > 0:
            g[k] = None
            while len(g) > self.gsize[cid]:
                del g[next(iter(g))]

    def set_caps(self, slots: dict, ghosts: dict):
        """The cache's ``set_budget`` then its ghost sizes: shrink evicts LRU victims."""
        for cid in self.cids:
            self.cap[cid] = int(slots[cid])
            lr = self.lru[cid]
            while len(lr) > self.cap[cid]:
                self._evict_one(cid)
        for cid in self.cids:
            self.gsize[cid] = int(ghosts.get(cid, 0))
            g = self.ghost[cid]
            while len(g) > self.gsize[cid]:
                del g[next(iter(g))]

    def run_step(self, i):
        _, sets, counted = self.steps[i]
        for layer, keys in sets:
            cid = self.cls_of[layer]
            lr, cap, g = self.lru[cid], self.cap[cid], self.ghost[cid]
            h, miss = pin_resident(lr, keys)
            if len(lr) + len(miss) > cap:   # slots for every miss first (the cache's _take_slots)
                n = len(lr) + len(miss) - cap
                for _ in range(n):
                    if lr.victim() < 0:
                        raise SimulationError(f"model {self.name}: layer {layer} needs "
                                              f"{len(keys)} slots at once, its class has {cap}")
                    self._evict_one(cid)
            for k in miss:   # the cache's _start_load: a demanded load of a ghost key
                if k in g:
                    del g[k]
                    self.ghost_hits += 1
                lr.insert(k)
                lr.pin(k)
            for k in keys:
                lr.unpin(k)
            if counted:
                self.hits += h
                self.acc += len(keys)
                self.bytes_read += len(miss) * self.slot_bytes[cid]
        return len(sets)


def _rates(models, rates):
    if rates is None:
        rates = [None] * len(models)
    longest = max(len(m.steps) for m in models) or 1
    return [r if r is not None else max(1, len(m.steps)) / longest for r, m in zip(rates, models)]


def interleaving(mms, warmup=None, tokens=None, rates=None) -> list:
    """The order ``replay_mix`` replays in: ``[(model name, [(trace layer, [experts])],
    counted)]`` per step, so a live run (tests, benchmarks) can drive the daemon the same way."""
    models = [_Model(mm, warmup, tokens) for mm in mms]
    rates = _rates(models, rates if rates is not None else [mm.rate for mm in mms])
    out = []
    for _, mi, j in _interleave(models, rates):
        m = models[mi]
        _, sets, counted = m.steps[j]
        out.append((m.name, [(layer, [k - layer * m.E for k in keys]) for layer, keys in sets],
                    counted))
    return out


def _interleave(models, rates):
    """(time, model index, step index) in replay order."""
    ev = []
    for mi, m in enumerate(models):
        r = rates[mi]
        for j, (tb, _, _) in enumerate(m.steps):
            ev.append((tb / r, mi, j))
    ev.sort()
    return ev


def mix_members(mms, total: int):
    """The :class:`moecached.daemon.split.Member` of each model: min share the larger of its
    ``min_bytes`` and what serving needs (``least_share``), max its ``max_bytes``."""
    out = []
    for mm in mms:
        t = load_trace(mm.trace) if not isinstance(mm.trace, Trace) else mm.trace
        least = least_share(mm.index, t.top_k, mmap.PAGESIZE)
        out.append(Member(mm.name, mm.index, max(least, mm.min_bytes or 0), mm.max_bytes,
                          mm.weight))
    return out


def replay_mix(mms, total: int, *, shares: Optional[dict] = None, dynamic: bool = True,
               split_every: int = DEFAULT_SPLIT_EVERY, step: Optional[int] = None,
               warmup=None, tokens=None, rates=None, hysteresis=None) -> dict:
    """Replay ``mms`` (list of :class:`MixModel`) interleaved against ``total`` bytes.
    ``dynamic``: the split moves shares (``moecached.daemon.split``); else the starting shares
    (``shares``, default the equal split) stay. Returns per-model and combined counts, the
    final shares and the number of moves."""
    models = [_Model(mm, warmup, tokens) for mm in mms]
    rates = _rates(models, rates if rates is not None else [mm.rate for mm in mms])
    kw = {} if hysteresis is None else {"hysteresis": hysteresis}
    sp = Split(total, mix_members(mms, total), step=step if dynamic else 0, shares=shares, **kw)

    def apply():
        for m in models:
            m.set_caps(sp.members[m.name].slots(sp.shares[m.name]), sp.ghost_slots(m.name))

    apply()
    last = {m.name: 0 for m in models}
    n = 0
    trail = []
    for _, mi, j in _interleave(models, rates):
        models[mi].run_step(j)
        n += 1
        if dynamic and n % split_every == 0:
            got = {m.name: m.ghost_hits - last[m.name] for m in models}
            last = {m.name: m.ghost_hits for m in models}
            if sp.rebalance(got) is not None:
                apply()
            trail.append(dict(sp.shares))
    H = sum(m.hits for m in models)
    A = sum(m.acc for m in models)
    return {"hits": H, "accesses": A, "hit_rate": H / A if A else float("nan"),
            "bytes_read": sum(m.bytes_read for m in models),
            "models": {m.name: {"hits": m.hits, "accesses": m.acc,
                                "hit_rate": m.hits / m.acc if m.acc else float("nan"),
                                "ghost_hits": m.ghost_hits, "bytes_read": m.bytes_read,
                                "share": sp.shares[m.name], "tokens": len(m.steps)}
                       for m in models},
            "shares": dict(sp.shares), "moves": sp.moves, "step": sp.step,
            "rates": list(rates), "equal_shares": None, "trail": trail}


def run_mix(mms, total: int, *, points: int = 9, split_every: int = DEFAULT_SPLIT_EVERY,
            step=None, warmup=None, tokens=None, rates=None) -> dict:
    """``shared`` (dynamic), ``equal`` and the ``static`` sweep for one budget."""
    members = mix_members(mms, total)
    equal = Split(total, members, step=0).shares
    shared = replay_mix(mms, total, dynamic=True, split_every=split_every, step=step,
                        warmup=warmup, tokens=tokens, rates=rates)
    eq = replay_mix(mms, total, shares=equal, dynamic=False, warmup=warmup, tokens=tokens,
                    rates=rates)
    static = []
    names = [m.name for m in members]
    for mi, m in enumerate(members):
        if len(members) == 2 and mi == 1:
            break
        others = [x for x in members if x is not m]
        room = total - sum(x.min_bytes for x in others)
        hi = min(m.max_bytes, room)
        lo = m.min_bytes
        if hi < lo:
            continue
        for p in range(points):
            s = lo + (hi - lo) * p // max(1, points - 1)
            want = {x.name: (total - s) / len(others) for x in others}
            want[m.name] = s
            try:
                sh = Split(total, members, step=0, shares=want).shares
            except SplitError:
                continue
            r = replay_mix(mms, total, shares=sh, dynamic=False, warmup=warmup, tokens=tokens,
                           rates=rates)
            static.append(r)
    best = max(static, key=lambda r: r["hit_rate"]) if static else None
    return {"total": total, "names": names, "shared": shared, "equal": eq, "static": static,
            "best_static": best}


def _fmt_bytes(n):
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def format_mix(out) -> str:
    names = out["names"]
    head = ["split"] + [f"{n} share" for n in names] + [f"{n} hit" for n in names] + \
        ["combined hit", "GB read"]
    rows = []

    def row(label, r):
        rows.append([label] + [_fmt_bytes(r["shares"][n]) for n in names]
                    + [f"{r['models'][n]['hit_rate'] * 100:.1f}%" for n in names]
                    + [f"{r['hit_rate'] * 100:.2f}%", f"{r['bytes_read'] / 1e9:.2f}"])

    row(f"shared (final; {out['shared']['moves']} moves)", out["shared"])
    row("equal", out["equal"])
    for r in out["static"]:
        row("static" + (" (best)" if r is out["best_static"] else ""), r)
    w = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(str(x).ljust(k) for x, k in zip(head, w))]
    lines += ["  ".join(str(x).ljust(k) for x, k in zip(r, w)) for r in rows]
    return "\n".join(lines)


def _json(out):
    def clean(r):
        return {k: v for k, v in r.items() if k != "trail"}
    return {"total": out["total"], "names": out["names"], "shared": clean(out["shared"]),
            "equal": clean(out["equal"]), "static": [clean(r) for r in out["static"]],
            "best_static": clean(out["best_static"]) if out["best_static"] else None}


def _split_list(text, what, n):
    xs = [x.strip() for x in text.split(",") if x.strip()]
    if len(xs) != n:
        raise SimulationError(f"{what}: found {len(xs)} entries, expected {n} (one per --mix trace)")
    return xs


def main_mix(a) -> int:
    """``moecache-ctl policy --mix`` (arguments parsed by ``policycli.main``)."""
    from moecached.facts.units import parse_size
    traces = [x.strip() for x in a.mix.split(",") if x.strip()]
    if len(traces) < 2:
        raise SimulationError(f"--mix: found {len(traces)} trace(s), expected >= 2 "
                              "comma-separated traces")
    if not a.budget:
        raise SimulationError("--mix: expected --budget SIZE (the shared budget, e.g. 24GiB)")
    total = parse_size(a.budget)
    names = _split_list(a.names, "--names", len(traces)) if a.names else \
        [os.path.basename(t).split(".")[0] for t in traces]
    rates = [float(x) for x in _split_list(a.rates, "--rates", len(traces))] if a.rates else None
    mms = []
    for i, t in enumerate(traces):
        tr = load_trace(t)
        if a.models:
            from moecached.engine.index import open_index
            idx = open_index(_split_list(a.models, "--models", len(traces))[i])
        elif a.layouts:
            idx = layout_index(_split_list(a.layouts, "--layouts", len(traces))[i],
                               tr.n_layers, tr.n_experts)
        else:
            raise SimulationError("--mix: expected --layouts A.json,B.json or --models "
                                  "A.gguf,B.gguf (the bytes of each model's experts)")
        mms.append(MixModel(names[i], tr, idx))
    out = run_mix(mms, total, points=a.points, split_every=a.split_every, warmup=a.warmup,
                  tokens=a.tokens, rates=rates)
    if a.json:
        json.dump(_json(out), sys.stdout, indent=1, default=float)
        print()
        return 0
    print(f"== {len(traces)} models, one budget of {_fmt_bytes(total)}; rates (tokens/s) "
          + ", ".join(f"{n} {r:g}" for n, r in zip(names, out["shared"]["rates"]))
          + f"; rebalance every {a.split_every} tokens, step {_fmt_bytes(out['shared']['step'])}")
    print(format_mix(out))
    return 0
