"""The simulator's budgets: cache sizes -> expert slots, per layer or per size class, and the
bytes an expert costs (from a layout JSON or a GGUF model).

Sizes -> slots (capacity is in expert slots):
  * a float fraction ``f`` (CLI: has a ``.`` or ends in ``%``): ``s = round_half_up(f * E)``
    slots for every layer; a size class with ``n`` layers gets ``s * n`` slots.
  * an int ``S`` (CLI: plain integer): ``S`` slots in all, split over size classes exactly as
    the daemon does (``moecached.engine.arena.plan_slots``: the largest fraction ``f`` with
    ``sum_c floor(f * n_c * E) <= S``; class c gets ``floor(f * n_c * E)``); per-layer policies
    give each layer of a class ``class_slots // n_c`` (as the cache's ``per-layer`` mode).
Per-layer policies (``lru lfu slru opt``...: scope ``layer`` in
``moecached.engine.policy.POLICIES``) have a budget per layer; the others one per class
(``docs/policies.md``, "Sizes and slots").
"""
from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np

from moecached.tools.simstream import SimulationError

__all__ = ["layer_classes", "capacities", "class_of_layer", "budgets", "layout_bytes",
           "model_bytes"]


def layer_classes(per_class_layers, L) -> list:
    """The size classes as lists of trace layers: ``per_class_layers`` checked (non-empty lists
    that partition ``0..L-1``), or one class of every layer when it is None."""
    if per_class_layers is None:
        return [list(range(L))]
    cls = [list(map(int, c)) for c in per_class_layers]
    flat = sorted(x for c in cls for x in c)
    if flat != list(range(L)) or any(not c for c in cls):
        raise SimulationError(f"per_class_layers: found {cls}, expected non-empty lists that "
                              f"partition the trace layers 0..{L - 1}")
    return cls


def capacities(size, n_layers: int, n_experts: int, per_class_layers=None):
    """Slots for ``size`` (see module docstring).

    Returns:
        (class_caps list[int] per class, layer_caps int64 [n_layers], description str).
    Raises:
        SimulationError: size <= 0, a float above 1, a non-number.
    """
    cls = layer_classes(per_class_layers, n_layers)
    E = n_experts
    layer_caps = np.zeros(n_layers, np.int64)
    if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, float, np.integer,
                                                                   np.floating)):
        raise SimulationError(f"size: found {size!r}, expected a fraction (float) or slots (int)")
    if isinstance(size, (float, np.floating)):
        if not 0 < size <= 1:
            raise SimulationError(f"size: found {size}, expected a fraction in (0, 1]")
        s = int(math.floor(size * E + 0.5))
        layer_caps[:] = s
        class_caps = [s * len(c) for c in cls]
        desc = f"{size:g} x {E} = {s} slots/layer"
    else:
        S = int(size)
        if S < 1:
            raise SimulationError(f"size: found {S} slots, expected >= 1")
        weights = [len(c) * E for c in cls]
        cands = sorted({Fraction(k, w) for w in set(weights) for k in range(1, w + 1)})
        best = Fraction(0)
        lo, hi = 0, len(cands) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            if sum(int(cands[mid] * w) for w in weights) <= S:
                best = cands[mid]
                lo = mid + 1
            else:
                hi = mid - 1
        class_caps = [int(best * w) for w in weights]
        for c, cap in zip(cls, class_caps):
            layer_caps[c] = cap // len(c)
        desc = f"{S} slots -> {sum(class_caps)} used ({'/'.join(map(str, class_caps))} per class)"
    return class_caps, layer_caps, desc


def class_of_layer(classes, n_layers: int) -> np.ndarray:
    """int64 [n_layers]: the index in ``classes`` of each trace layer's size class."""
    out = np.zeros(n_layers, np.int64)
    for ci, c in enumerate(classes):
        out[c] = ci
    return out


def budgets(scope: str, classes, class_caps, layer_caps, n_experts: int) -> tuple:
    """(group of each key int64 [L * E], capacity of each group int64) of a policy of ``scope``
    (``"layer"``: a budget per layer, ``layer_caps``; ``"class"``: one per size class,
    ``class_caps``), as ``moecached.engine.policy.make_policy`` takes them (key = layer * E +
    expert)."""
    L = len(layer_caps)
    if scope == "layer":
        return np.repeat(np.arange(L, dtype=np.int64), n_experts), np.asarray(layer_caps, np.int64)
    return np.repeat(class_of_layer(classes, L), n_experts), np.array(class_caps, np.int64)


def layout_bytes(path) -> tuple:
    """Bytes per expert per MoE layer from a layout JSON (``expert_bytes`` entries, parts
    summed), and the size classes (layers grouped by equal per-expert bytes).
    Returns (list[int] per trace layer, list of lists of trace layers)."""
    try:
        with open(path) as fh:
            d = json.load(fh)
    except (OSError, json.JSONDecodeError) as ex:
        raise SimulationError(f"{path}: unreadable layout ({ex}), expected a layout JSON")
    eb = d.get("expert_bytes")
    if not isinstance(eb, list) or not eb:
        raise SimulationError(f"{path}: expert_bytes: absent or empty, expected a list of "
                              "{layer, <part>: {bytes_per_expert}}")
    rows = sorted(eb, key=lambda r: r["layer"])
    per = [sum(v["bytes_per_expert"] for k, v in r.items()
               if isinstance(v, dict) and "bytes_per_expert" in v) for r in rows]
    return per, _group_equal(per)


def _group_equal(per):
    cls = {}
    for i, b in enumerate(per):
        cls.setdefault(b, []).append(i)
    return list(cls.values())


def model_bytes(path) -> tuple:
    """Bytes per expert per MoE layer and the daemon's size classes from a GGUF model
    (``moecached.engine.index.open_index``). Returns (list[int], list of lists of trace layers)."""
    from moecached.engine.index import open_index  # lazy: heavy, and optional for the simulator
    idx = open_index(path)
    pos = {b: i for i, b in enumerate(idx.expert_layers)}
    per = [0] * len(idx.expert_layers)
    cls = []
    for sc in idx.size_classes:
        layers = sorted(pos[b] for b in sc.layers)
        cls.append(layers)
        for i in layers:
            per[i] = int(sc.slot_bytes)
    return per, cls

