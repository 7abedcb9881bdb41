"""``moecache-ctl inspect MODEL [--json]``: print the expert index of a GGUF model (or split
set): one table per size class, then totals; ``--json`` prints ``ExpertIndex.to_json()``."""
from __future__ import annotations

import argparse
import json

from moecached.engine.index import ExpertIndex, _fmt_layers, open_index


def _human(n: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def format_human(idx: ExpertIndex) -> str:
    """The human ``inspect`` report: one table per size class, then totals."""
    L = []
    total = sum(idx.file_sizes)
    L.append(f"{idx.files[0]}" + (f" (+{len(idx.files) - 1} more shards)" if len(idx.files) > 1 else ""))
    L.append(f"  {len(idx.files)} file(s), {_human(total)}; arch {idx.arch or '?'}; {idx.n_layers} blocks, "
             f"{len(idx.expert_layers)} with routed experts; {idx.n_experts} experts, top-{idx.top_k}, "
             f"{idx.n_shared_experts} shared")
    for c in idx.size_classes:
        L.append("")
        L.append(f"size class {c.id}: {len(c.layers)} blocks ({_fmt_layers(c.layers)}), "
                 f"slot {c.slot_bytes:,} B ({_human(c.slot_bytes)})")
        L.append(f"  {'part':<10} {'type':<8} {'bytes/expert':>14}  shape (ne)")
        for p in c.parts:
            L.append(f"  {p:<10} {c.part_types[p]:<8} {c.part_bytes[p]:>14,}  {'x'.join(map(str, c.part_shapes[p]))}")
        L.append(f"  {'slot':<10} {'':<8} {c.slot_bytes:>14,}  x {idx.n_experts} experts x {len(c.layers)} blocks "
                 f"= {_human(c.slot_bytes * idx.n_experts * len(c.layers))}")
    L.append("")
    sh = sum(s["nbytes"] for s in idx.shared)
    L.append(f"total: routed experts {idx.routed_expert_bytes:,} B ({_human(idx.routed_expert_bytes)}) in "
             f"{len(idx.expert_layers) * idx.n_experts} expert slots of {len(idx.size_classes)} size class(es); "
             f"shared-expert/dense FFN tensors {len(idx.shared)} ({_human(sh)}, not slotted)")
    return "\n".join(L)


def main(argv=None) -> int:
    """``moecache-ctl inspect MODEL [--json]``: print the expert index of a GGUF model."""
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="moecache-ctl inspect",
                                 description="index the routed experts of a GGUF model (or split set)")
    ap.add_argument("model", help="GGUF file, or any shard of a split set")
    ap.add_argument("--json", action="store_true", help="print JSON (keys: files, n_layers, expert_layers, ...)")
    a = ap.parse_args(argv)
    idx = open_index(a.model)
    if a.json:
        print(json.dumps(idx.to_json(), indent=1))
    else:
        print(format_human(idx))
    return 0
