"""Real-layout GGUF fixtures with stamped expert bytes (``moecache-ctl synth``).

From a layout (see :mod:`moecached.facts.layout`) write a real GGUF file, or split set, with
``gguf.GGUFWriter``: same tensor names, ggml types, shapes and (namespaced, typed) metadata.
Scaled-down files keep real per-expert sizes with fewer blocks and experts:

* ``layers=N`` keeps blocks 0..N-1 (dense leading layers included, each block with its real
  per-layer types); ``layers=[a, b, ...]`` keeps those source blocks, renumbered 0, 1, ... in
  the written file. ``experts=E`` keeps experts 0..E-1 (expert dimension of ``*_exps`` tensors,
  ``ffn_gate_inp`` and ``exp_probs_b`` cut to E). ``block_count``, ``expert_count``,
  ``expert_used_count`` (min(top-k, E)) and ``leading_dense_block_count`` follow the new shape.
* ``legacy=True`` writes per-expert 2-D tensors ``blk.N.ffn_{gate,up,down}.E.weight`` (old
  Mixtral files) instead of merged ``*_exps`` tensors.
* ``split=K`` writes ``OUT-00001-of-0000K.gguf`` ... with ``split.no`` / ``split.count`` /
  ``split.tensors.count``; the first shard holds all other metadata.

Expert bytes: the slice of every (block, part, expert) is seeded pseudo-random bytes (a
window of a per-seed pool, starting at a position derived from block/part/expert) with a
32-byte stamp at the start of every 4096-byte page of the slice (pages counted from the slice
start)::

    u32 magic 'MoEx' | u32 block | u32 part code | u32 expert | u32 page | u32 seed | u32 nbytes | u32 check

so a read of the wrong expert, part, block, or page shows. :func:`expected_expert_bytes`
recomputes any slice without reading the file; :func:`verify_expert_bytes` explains a mismatch.
Non-expert tensors are left as file holes (they read as zeros) unless ``sparse=False``.

Part names: ``gate``, ``up``, ``down``, ``gate_up`` (fused), ``gate_bias``, ``up_bias``,
``down_bias`` (gpt-oss per-expert biases) -- the same names :mod:`moecached.engine.index` reports.
"""
from __future__ import annotations

import argparse
import os
import re
import struct
import sys
import time
import zlib
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGUFValueType, GGUFWriter

from moecached import MoecacheError
from moecached.facts.layout import Layout, load_layout, tensor_nbytes, ggml_type_by_name

PAGE = 4096
STAMP_BYTES = 32
STAMP_MAGIC = 0x78456F4D  # b"MoEx" little-endian
POOL_BYTES = (1 << 20) + 4093  # odd length: page contents do not repeat with the page grid
PART_CODES = {"gate": 1, "up": 2, "down": 3, "gate_up": 4,
              "gate_bias": 5, "up_bias": 6, "down_bias": 7, "gate_up_bias": 8}
_CHUNK = 32 << 20

_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
_EXPS = re.compile(r"^ffn_([a-z0-9_]+?)_exps\.(weight|bias)$")
_ROUTER = re.compile(r"^(ffn_gate_inp|exp_probs_b)\.(weight|bias)$")


class SynthError(MoecacheError):
    """A fixture cannot be written as asked (one line)."""


def part_code(part: str) -> int:
    """u32 code of a part name in stamps (fixed for known parts, crc32-derived otherwise)."""
    c = PART_CODES.get(part)
    return c if c is not None else (zlib.crc32(part.encode()) | 0x80000000)


@lru_cache(maxsize=4)
def _pool(seed: int) -> np.ndarray:
    return np.random.default_rng(seed & 0xFFFFFFFFFFFFFFFF).integers(0, 256, POOL_BYTES, dtype=np.uint8)


def _stamps(layer: int, code: int, expert: int, seed: int, nbytes: int, npages: int) -> np.ndarray:
    rec = np.empty((npages, 8), dtype="<u4")
    rec[:, 0] = STAMP_MAGIC
    rec[:, 1] = layer
    rec[:, 2] = code
    rec[:, 3] = expert
    rec[:, 4] = np.arange(npages, dtype="<u4")
    rec[:, 5] = seed & 0xFFFFFFFF
    rec[:, 6] = nbytes & 0xFFFFFFFF
    rec[:, 7] = (rec[:, 1] * 0x9E3779B1 ^ rec[:, 2] * 0x85EBCA77 ^ rec[:, 3] * 0xC2B2AE3D
                 ^ rec[:, 4] * 0x27D4EB2F ^ rec[:, 5] ^ rec[:, 6]) & 0xFFFFFFFF
    return rec.view(np.uint8).reshape(npages, STAMP_BYTES)


def fill_expert(out: np.ndarray, layer: int, part: str, expert: int, seed: int = 0) -> np.ndarray:
    """Fill ``out`` (1-D uint8 array, the whole slice: len == slice bytes) with the bytes
    block ``layer``'s expert ``expert`` part ``part`` carries in a synth file of ``seed``."""
    n = out.shape[0]
    code = part_code(part)
    pool = _pool(seed)
    p = zlib.crc32(struct.pack("<IIIQ", layer, code, expert, seed & 0xFFFFFFFFFFFFFFFF)) % POOL_BYTES
    done = 0
    while done < n:
        k = min(n - done, POOL_BYTES - p)
        out[done:done + k] = pool[p:p + k]
        done += k
        p = 0
    npages = -(-n // PAGE)
    if npages:
        st = _stamps(layer, code, expert, seed, n, npages)
        full = n // PAGE
        if full:
            out[: full * PAGE].reshape(full, PAGE)[:, :STAMP_BYTES] = st[:full]
        rest = n - full * PAGE
        if rest:
            m = min(STAMP_BYTES, rest)
            out[full * PAGE: full * PAGE + m] = st[full, :m]
    return out


def expected_expert_bytes(layer: int, part: str, expert: int, nbytes: int, seed: int = 0) -> bytes:
    """The exact ``nbytes`` bytes of (block ``layer``, ``part``, ``expert``) in a synth file
    written with ``seed``; ``nbytes`` is the part's per-expert bytes (``PartSpan.nbytes``)."""
    return fill_expert(np.empty(nbytes, dtype=np.uint8), layer, part, expert, seed).tobytes()


def decode_stamp(data) -> dict | None:
    """Decode the 32-byte stamp at the start of ``data`` (a page start of a slice);
    None if it is not a valid stamp. Keys: layer, part_code, part, expert, page, seed, nbytes."""
    b = bytes(data[:STAMP_BYTES])
    if len(b) < STAMP_BYTES:
        return None
    v = struct.unpack("<8I", b)
    if v[0] != STAMP_MAGIC:
        return None
    chk = (v[1] * 0x9E3779B1 ^ v[2] * 0x85EBCA77 ^ v[3] * 0xC2B2AE3D ^ v[4] * 0x27D4EB2F ^ v[5] ^ v[6]) & 0xFFFFFFFF
    if chk != v[7]:
        return None
    names = {c: p for p, c in PART_CODES.items()}
    return {"layer": v[1], "part_code": v[2], "part": names.get(v[2], f"#{v[2]:x}"), "expert": v[3],
            "page": v[4], "seed": v[5], "nbytes": v[6]}


def verify_expert_bytes(data, layer: int, part: str, expert: int, seed: int = 0) -> str | None:
    """None when ``data`` is exactly slice (layer, part, expert) of a seed-``seed`` synth file;
    otherwise a one-line description of the first difference (naming the slice it came from
    when a stamp can be read there)."""
    data = bytes(data)
    exp = expected_expert_bytes(layer, part, expert, len(data), seed)
    if data == exp:
        return None
    i = next(k for k in range(len(data)) if data[k] != exp[k])
    page_start = i - i % PAGE
    st = decode_stamp(data[page_start:page_start + STAMP_BYTES])
    where = (f"stamp there says block {st['layer']} part {st['part']} expert {st['expert']} page {st['page']}"
             if st else "no stamp there")
    return (f"block {layer} part {part} expert {expert}: first wrong byte at offset {i} "
            f"(page {i // PAGE}), {where}")


# ----------------------------------------------------------------------------------------- plan

class _T:
    __slots__ = ("name", "qtype", "shape", "nbytes", "kind", "layer", "part", "n_experts", "expert")

    def __init__(self, name, qtype, shape, kind="other", layer=-1, part="", n_experts=0, expert=-1):
        self.name, self.qtype, self.shape = name, qtype, tuple(int(x) for x in shape)
        self.nbytes = tensor_nbytes(qtype, self.shape)
        self.kind, self.layer, self.part, self.n_experts, self.expert = kind, layer, part, n_experts, expert


def _select_layers(layout: Layout, layers):
    n_blocks = layout.meta_int("block_count")
    if n_blocks is None:
        n_blocks = 1 + max((int(m.group(1)) for t in layout.tensors if (m := _BLK.match(t.name))), default=-1)
    if layers is None:
        return list(range(n_blocks)), n_blocks
    if isinstance(layers, int):
        if not 1 <= layers <= n_blocks:
            raise SynthError(f"{layout.source}: layers: found {layers}, expected 1..{n_blocks} (block_count)")
        return list(range(layers)), n_blocks
    src = sorted(set(int(x) for x in layers))
    if not src or src[0] < 0 or src[-1] >= n_blocks:
        raise SynthError(f"{layout.source}: layers: found {list(layers)}, expected block numbers in 0..{n_blocks - 1}")
    return src, n_blocks


def plan_model(layout: Layout, layers=None, experts=None, legacy=False):
    """Plan a (scaled) model: returns ``(tensors, metadata_items, info)``; tensors in file order.
    ``info``: ``src_layers``, ``n_experts``, ``orig_experts``, ``top_k``, ``expert_layers``."""
    src_layers, n_blocks = _select_layers(layout, layers)
    dst_of = {s: i for i, s in enumerate(src_layers)}
    orig_e = layout.meta_int("expert_count")
    if orig_e is None:
        for t in layout.tensors:
            m = _BLK.match(t.name)
            if m and _EXPS.match(m.group(2)):
                orig_e = t.shape[-1]
                break
    if not orig_e:
        raise SynthError(f"{layout.source}: tensors: found no routed-expert tensors (blk.N.ffn_*_exps.*), expected at least one")
    n_e = orig_e if experts is None else int(experts)
    if not 1 <= n_e <= orig_e:
        raise SynthError(f"{layout.source}: experts: found {experts}, expected 1..{orig_e} (expert_count)")

    out, expert_layers = [], set()
    for t in layout.tensors:
        qt = ggml_type_by_name(t.ggml_type)
        m = _BLK.match(t.name)
        if not m:
            out.append(_T(t.name, qt, t.shape))
            continue
        src, rest = int(m.group(1)), m.group(2)
        if src not in dst_of:
            continue
        dst = dst_of[src]
        name = f"blk.{dst}.{rest}"
        me = _EXPS.match(rest)
        if me:
            if len(t.shape) < 2 or t.shape[-1] != orig_e:
                raise SynthError(f"{layout.source}: tensor {t.name}: found shape {list(t.shape)}, "
                                 f"expected last dimension = expert_count {orig_e}")
            part = me.group(1) + ("" if me.group(2) == "weight" else "_bias")
            expert_layers.add(dst)
            if legacy:
                if me.group(2) != "weight" or me.group(1) not in ("gate", "up", "down"):
                    raise SynthError(f"{layout.source}: tensor {t.name}: found {rest}, expected only "
                                     f"ffn_{{gate,up,down}}_exps.weight for legacy per-expert tensors")
                for e in range(n_e):
                    out.append(_T(f"blk.{dst}.ffn_{me.group(1)}.{e}.weight", qt, t.shape[:-1], "legacy", dst, part, 1, e))
            else:
                out.append(_T(name, qt, (*t.shape[:-1], n_e), "experts", dst, part, n_e))
            continue
        if _ROUTER.match(rest) and t.shape[-1] == orig_e:
            out.append(_T(name, qt, (*t.shape[:-1], n_e)))
            continue
        out.append(_T(name, qt, t.shape))
    if not expert_layers:
        raise SynthError(f"{layout.source}: layers: found no routed experts in kept blocks {src_layers}, "
                         f"expected at least one block with blk.N.ffn_*_exps tensors")

    items, _skipped = layout.gguf_metadata()
    a = layout.arch
    top_k = layout.meta_int("expert_used_count", n_e)
    over = {f"{a}.block_count": len(src_layers), f"{a}.expert_count": n_e,
            f"{a}.expert_used_count": min(top_k, n_e)}
    lead = 0
    while lead < len(src_layers) and lead not in expert_layers:
        lead += 1
    if layout.meta_int("leading_dense_block_count") is not None or lead:
        over[f"{a}.leading_dense_block_count"] = lead
    meta, seen = [], set()
    for k, v, vt in items:
        if k in ("general.architecture", "general.alignment"):
            continue
        if k in over:
            v, vt = over[k], GGUFValueType.UINT32
        meta.append((k, v, vt))
        seen.add(k)
    for k, v in over.items():
        if k not in seen:
            meta.append((k, v, GGUFValueType.UINT32))
    if "general.quantization_version" not in seen:
        meta.append(("general.quantization_version", 2, GGUFValueType.UINT32))
    if layout.alignment != 32:
        meta.append(("general.alignment", layout.alignment, GGUFValueType.UINT32))
    info = {"src_layers": src_layers, "n_experts": n_e, "orig_experts": orig_e,
            "top_k": min(top_k, n_e), "expert_layers": sorted(expert_layers)}
    return out, meta, info


def model_disk_bytes(layout, layers=None, experts=None, legacy: bool = False, sparse: bool = True) -> int:
    """Bytes of tensor data :func:`write_model` really writes for these arguments: the expert
    tensors (plus every other tensor when not ``sparse``; holes take no space). Headers and
    alignment padding come on top (well under a MiB per file)."""
    if not isinstance(layout, Layout):
        layout = load_layout(layout)
    tensors, _meta, _info = plan_model(layout, layers, experts, legacy)
    return sum(t.nbytes for t in tensors if not sparse or t.kind != "other")


def _shard_bounds(tensors, k: int) -> list[int]:
    """Start index of each of k shards: contiguous runs of about n/k tensors each (as
    ``gguf-split --split-max-tensors``), none empty."""
    n = len(tensors)
    if not 1 <= k <= n:
        raise SynthError(f"split: found {k}, expected 1..{n} (number of tensors)")
    return [(n * j) // k for j in range(k)]


# ---------------------------------------------------------------------------------------- write

def _check_out(out: Path, make_dirs: bool) -> None:
    """Refuse (SynthError, one line) an output path that cannot be a file to write: a
    directory, a missing parent directory (created instead when ``make_dirs``), a parent that
    is not a directory."""
    if out.is_dir():
        raise SynthError(f"{out}: is a directory, expected a .gguf file path to write")
    parent = out.parent
    if parent.exists():
        if not parent.is_dir():
            raise SynthError(f"{out}: {parent} is not a directory, expected an existing directory")
        return
    if not make_dirs:
        raise SynthError(f"{out}: directory {parent} does not exist, expected an existing "
                         f"directory (create it first)")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SynthError(f"{out}: cannot create directory {e.filename or parent} "
                         f"({e.strerror or e})") from None


def _check_file(path: Path) -> None:
    """An existing output file must be a regular file (not /dev/null, a FIFO, ...)."""
    if path.is_dir():
        raise SynthError(f"{path}: is a directory, expected a .gguf file path to write")
    if path.exists() and not path.is_file():
        raise SynthError(f"{path}: not a regular file, expected a .gguf file path to write")


def write_model(layout, out, layers=None, experts=None, split=None, seed: int = 0, progress: bool = True,
                legacy: bool = False, sparse: bool = True, stats: dict | None = None,
                make_dirs: bool = True) -> list[str]:
    """Write a GGUF model (or split set) from ``layout`` (Layout, path or embedded name).

    ``out``: file path; with ``split=K > 1`` the shards are ``<stem>-0000i-of-0000K.gguf``
    beside it. ``layers``: None (all), N (first N blocks) or a list of source block numbers.
    ``experts``: None (all) or E (first E). ``seed``: selects the expert bytes (see
    :func:`expected_expert_bytes`). ``sparse``: leave non-expert tensor data as holes.
    ``stats``: if a dict, receives ``bytes_written`` (bytes really written, holes excluded),
    ``expert_bytes``, ``apparent_bytes``, ``seconds``.
    ``make_dirs``: create a missing parent directory of ``out`` (the CLI passes False and
    refuses it instead, like ``cp``).
    Returns the paths written, in shard order. Raises :class:`SynthError` /
    :class:`~moecached.facts.layout.LayoutError` (one line; also for an output path that is a
    directory or cannot be written: OSError is turned into SynthError naming the path).
    """
    if not isinstance(layout, Layout):
        layout = load_layout(layout)
    if int(seed) < 0:
        raise SynthError(f"seed: found {seed}, expected >= 0")
    tensors, meta, info = plan_model(layout, layers, experts, legacy)
    k = 1 if split is None else int(split)
    if k < 1:
        raise SynthError(f"split: found {split}, expected an integer >= 1 (1 = no split)")
    starts = _shard_bounds(tensors, k)
    out = Path(out)
    _check_out(out, make_dirs)
    try:
        return _write(layout, out, tensors, meta, info, starts, seed, progress, sparse, stats)
    except OSError as e:
        where = e.filename if e.filename else out
        raise SynthError(f"{where}: cannot write ({e.strerror or e}), expected a writable "
                         f".gguf file path") from None


def _write(layout, out, tensors, meta, info, starts, seed, progress, sparse, stats) -> list[str]:

    w = GGUFWriter(None, layout.arch)
    w.data_alignment = layout.alignment
    for key, val, vt in meta:
        w.add_key_value(key, val, vt)
    w.add_key_value("moecached.tools.synth.seed", int(seed), GGUFValueType.UINT64)
    w.add_key_value("moecached.tools.synth.layout", layout.name, GGUFValueType.STRING)
    w.add_key_value("moecached.tools.synth.source_blocks", [int(x) for x in info["src_layers"]], GGUFValueType.ARRAY,
                    GGUFValueType.INT32)
    shards = []
    for i, t in enumerate(tensors):
        if i in starts[1:]:
            w.tensors.append({})
        if not shards or i in starts[1:]:
            shards.append([])
        shards[-1].append(t)
        w.add_tensor_info(t.name, tuple(reversed(t.shape)), np.float32, t.nbytes, raw_dtype=t.qtype)
    paths = [str(p) for p in w.format_shard_names(out)]
    for p in paths:
        _check_file(Path(p))
    try:
        w.write_header_to_file(path=out)
    except BaseException:
        w.close()
        raise
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    total = sum(t.nbytes for t in tensors)
    t0 = time.monotonic()
    written = 0
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="iB", unit_scale=True, unit_divisor=1024, desc=out.name,   # GiB, as the docs say
                   file=sys.stderr)
    maxslice = max((t.nbytes // max(t.n_experts, 1) for t in tensors if t.kind != "other"), default=0)
    buf = np.empty(max(_CHUNK, maxslice), dtype=np.uint8)
    align = layout.alignment
    try:
        for fout, shard in zip(w.fout, shards):
            pos = fout.tell()
            for t in shard:
                pad = (-pos) % align
                if pad:
                    fout.write(b"\0" * pad)
                    pos += pad
                if t.kind == "other":
                    if sparse:
                        fout.seek(t.nbytes, os.SEEK_CUR)
                    else:
                        left = t.nbytes
                        zero = memoryview(np.zeros(min(_CHUNK, left), dtype=np.uint8))
                        while left:
                            n = min(left, len(zero))
                            fout.write(zero[:n])
                            left -= n
                        written += t.nbytes
                    if bar:
                        bar.update(t.nbytes)
                else:
                    n_e = t.n_experts
                    bpe = t.nbytes // n_e
                    per = max(1, len(buf) // bpe)
                    e = 0
                    while e < n_e:
                        m = min(per, n_e - e)
                        for j in range(m):
                            ex = t.expert if t.kind == "legacy" else e + j
                            fill_expert(buf[j * bpe:(j + 1) * bpe], t.layer, t.part, ex, seed)
                        fout.write(memoryview(buf[: m * bpe]))
                        written += m * bpe
                        if bar:
                            bar.update(m * bpe)
                        e += m
                pos += t.nbytes
            pad = (-pos) % align
            if pad:
                fout.write(b"\0" * pad)
                pos += pad
            fout.truncate(pos)
            fout.flush()
    finally:
        w.close()
        if bar:
            bar.close()
    if stats is not None:
        stats.update(bytes_written=written, apparent_bytes=total, seconds=time.monotonic() - t0,
                     expert_bytes=sum(t.nbytes for t in tensors if t.kind != "other"))
    return paths


def _parse_layers(s: str):
    s = s.strip()
    if re.fullmatch(r"\d+", s):
        return int(s)
    if re.fullmatch(r"\d+(,\d+)*", s):
        return [int(x) for x in s.split(",")]
    raise SynthError(f"--layers: found {s!r}, expected N or a comma list of block numbers")


def main(argv=None) -> int:
    """``moecache-ctl synth --layout LAYOUT --out PATH [--layers N|a,b,..] [--experts E] [--split K]
    [--seed S] [--legacy-experts] [--dense] [--quiet]``; with ``--runnable``, a model llama.cpp
    runs (:mod:`moecached.tools.synth_runnable`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--runnable" in args:
        from moecached.tools.synth_runnable import main as runnable_main
        args.remove("--runnable")
        return runnable_main(args)
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="moecache-ctl synth",
                                 description="write a real-layout GGUF model (or split set) whose "
                                             "expert bytes carry stamps that name their block, "
                                             "part and expert (test fixtures, the demo's model); "
                                             "with --runnable, a small model llama.cpp runs (see "
                                             "moecache-ctl synth --runnable --help)")
    ap.add_argument("--layout", required=True, help="layout JSON path or embedded layout name")
    ap.add_argument("--out", required=True,
                    help="output .gguf path (shards are named after it; an existing file is "
                         "overwritten); its directory must exist (it is not created)")
    ap.add_argument("--layers", help="keep the first N blocks, or the listed source blocks (renumbered)")
    ap.add_argument("--experts", type=int, help="keep the first E experts of every MoE block")
    ap.add_argument("--split", type=int, help="write a split set of K >= 1 shards (1 = one "
                                              "file, no split)")
    ap.add_argument("--seed", type=int, default=0, help="selects the expert bytes (default 0)")
    ap.add_argument("--legacy-experts", action="store_true", help="per-expert 2-D tensors (old Mixtral files)")
    ap.add_argument("--dense", action="store_true", help="write zeros for non-expert tensors instead of holes")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    a = ap.parse_args(args)
    if a.split is not None and a.split < 1:
        raise SynthError(f"--split {a.split}: expected an integer >= 1 (1 = no split)")
    st = {}
    paths = write_model(a.layout, a.out, layers=_parse_layers(a.layers) if a.layers else None,
                        experts=a.experts, split=a.split, seed=a.seed, progress=not a.quiet,
                        legacy=a.legacy_experts, sparse=not a.dense, stats=st, make_dirs=False)
    for p in paths:
        print(p)
    dt = max(st["seconds"], 1e-9)
    print(f"wrote {len(paths)} file(s): {st['apparent_bytes'] / 2**30:.3f} GiB of tensor data, "
          f"{st['bytes_written'] / 2**30:.3f} GiB written"
          f"{' (rest holes)' if st['bytes_written'] < st['apparent_bytes'] else ''} in {dt:.1f} s "
          f"({st['bytes_written'] / 1e6 / dt:.0f} MB/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
