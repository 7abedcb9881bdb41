"""The expert index: where every routed expert's bytes live in a GGUF model (or split set).

``open_index(path)`` reads the headers with the ``gguf`` package (``GGUFReader``; no tensor data
is touched), checks the file(s) thoroughly and returns an :class:`ExpertIndex` giving, for every
block with routed experts and every part of every expert: file, absolute byte offset, byte
length, ggml type and per-expert shape.

Recognised routed-expert tensors (N = block number, ``blk.N``):

* ``blk.N.ffn_{gate,up,down}_exps.weight`` -- merged 3-D tensors ``ne = [ne0, ne1, n_expert]``;
  expert e is slice e along the last ggml dimension: it starts at
  ``tensor_offset + e * bytes_per_expert``. Fused ``blk.N.ffn_gate_up_exps.weight`` is part
  ``gate_up``. Any other ``blk.N.ffn_X_exps.weight`` is part ``X``.
* ``blk.N.ffn_X_exps.bias`` -- per-expert biases (gpt-oss, ``ne = [n, n_expert]``), part ``X_bias``;
  they travel with the expert.
* legacy per-expert 2-D tensors ``blk.N.ffn_{gate,up,down}.E.weight`` (old Mixtral files).

Shared experts (``*_shexp``) and dense FFN tensors of blocks without routed experts are
reported in :attr:`ExpertIndex.shared`, not slotted.

Layer numbers everywhere are GGUF block numbers (``blk.N``). Routing traces count only MoE
layers: trace layer i is block ``index.expert_layers[i]``.

Every refusal is a :class:`GGUFError` whose text is one line:
``FILE: tensor/key X: found V, expected W``.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from importlib.metadata import version as _pkg_version

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from moecached import MoecacheError
from moecached.facts.files import read_head

try:
    GGUF_VERSION_STR = _pkg_version("gguf")
except Exception:  # pragma: no cover
    GGUF_VERSION_STR = "?"

PART_ORDER = ("gate", "up", "gate_up", "down", "gate_bias", "up_bias", "gate_up_bias", "down_bias")
SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
_EXPS = re.compile(r"^ffn_([a-z0-9_]+?)_exps\.(weight|bias)$")
_LEGACY = re.compile(r"^ffn_(gate|up|down|gate_up)\.(\d+)\.weight$")
_DENSE = re.compile(r"^ffn_(gate|up|down|gate_up)\.weight$")
_SHEXP = re.compile(r"^ffn_(gate|up|down|gate_up)_shexp\.weight$")


class GGUFError(MoecacheError):
    """A model file that moecached refuses; ``str(e)`` is ``FILE: tensor/key X: found V, expected W``."""


@dataclass(frozen=True)
class PartSpan:
    """One part of one expert: ``nbytes`` bytes at absolute byte ``offset`` of ``files[file]``."""
    part: str        # 'gate','up','down','gate_up','gate_bias','up_bias','down_bias', ...
    file: int        # index into ExpertIndex.files
    offset: int      # absolute byte offset in that file
    nbytes: int
    ggml_type: str   # e.g. 'Q4_K'
    shape: tuple     # per-expert ggml ne shape, e.g. (2048, 768)


@dataclass
class SizeClass:
    """Blocks whose experts have the same parts with the same (bytes, ggml type) per expert.
    A slot holds one expert: its parts back to back in ``parts`` order, ``slot_bytes`` in all."""
    id: int
    layers: list
    parts: list
    part_bytes: dict
    part_types: dict
    slot_bytes: int
    part_shapes: dict = field(default_factory=dict)


@dataclass
class _Tensor:
    name: str
    qtype: GGMLQuantizationType
    ne: tuple
    nbytes: int
    file: int
    offset: int  # absolute


class _Refuse(Exception):
    pass


class _HeaderReader(GGUFReader):
    """GGUFReader that parses the header, KV pairs and tensor infos but builds no tensor views;
    it checks ``general.alignment`` itself so that the refusal can say what was found."""

    def _build_tensor_info(self, offs, count):
        offs, fields = super()._build_tensor_info(offs, count)
        f = self.fields.get("general.alignment")
        if f is not None:
            if f.types != [GGUFValueType.UINT32]:
                shown = f.contents() if f.types and f.types[0] != GGUFValueType.ARRAY else "[...]"
                raise _Refuse(f"key general.alignment: found type {f.types[0].name} (value {shown!r}), expected UINT32")
            a = int(f.parts[-1][0])
            if a == 0 or a & (a - 1):
                raise _Refuse(f"key general.alignment: found {a}, expected a power of two")
        return offs, fields

    def _build_tensors(self, start_offs, fields):
        self.data_offset = start_offs
        self.tensor_fields = fields
        self.tensors = []


_GGUF_MIN_HEADER = 24  # magic u32, version u32, tensor count u64, KV count u64


def _not_gguf(path: str) -> GGUFError:
    """A file without the GGUF magic. Its bytes are not quoted: the daemon may read a file its
    client cannot (``moecache-ctl model add NAME /etc/shadow``)."""
    return GGUFError(f"{path}: not a GGUF file (expected the magic GGUF at its start)")



def _check_file(path: str) -> None:
    """Refuse (GGUFError, one line) what cannot be a GGUF file before gguf tries to map it:
    a missing path, a directory, a device / FIFO / socket, an empty or too short file, a
    file that cannot be opened."""
    head, st = read_head(path, 4, GGUFError, "expected a GGUF file",
                     not_found="file: found no such file, expected a GGUF model")
    if head != b"GGUF"[:len(head)]:
        raise _not_gguf(path)
    if st.st_size < _GGUF_MIN_HEADER:
        raise GGUFError(f"{path}: file too short ({st.st_size} bytes), expected a GGUF file "
                        f"(a GGUF header takes at least {_GGUF_MIN_HEADER} bytes)")


def _read_header(path: str) -> _HeaderReader:
    _check_file(path)
    try:
        r = _HeaderReader(path)
    except _Refuse as e:
        raise GGUFError(f"{path}: {e}") from None
    except FileNotFoundError:
        raise GGUFError(f"{path}: file: found no such file, expected a GGUF model") from None
    except Exception as e:
        msg = str(e)
        m = re.search(r"version (\d+)", msg)
        if m:
            raise GGUFError(f"{path}: key GGUF.version: found {m.group(1)}, expected one of [2, 3] "
                            f"(versions gguf {GGUF_VERSION_STR} reads)") from None
        if "magic" in msg:
            raise _not_gguf(path) from None
        raise GGUFError(f"{path}: header: found unreadable GGUF header ({e.__class__.__name__}: {msg}), "
                        f"expected a header gguf {GGUF_VERSION_STR} can read (truncated file?)") from None
    if r.byte_order != "I":
        raise GGUFError(f"{path}: header: found byte order swapped relative to this host "
                        f"({'big' if sys.byteorder == 'little' else 'little'}-endian GGUF), expected {sys.byteorder}-endian")
    return r


def _kv(r: _HeaderReader, key: str):
    f = r.fields.get(key)
    if f is None or not f.types:
        return None
    try:
        return f.contents()
    except Exception:
        return None


def _int_kv(r, path, key):
    v = _kv(r, key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise GGUFError(f"{path}: key {key}: found {v!r}, expected an integer")
    return v


def _fmt_layers(layers) -> str:
    out, i = [], 0
    layers = list(layers)
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        out.append(str(layers[i]) if i == j else f"{layers[i]}-{layers[j]}")
        i = j + 1
    return ",".join(out)


def _part_key(p: str):
    return (PART_ORDER.index(p), "") if p in PART_ORDER else (len(PART_ORDER), p)


class ExpertIndex:
    """Index of a model's routed experts (see module docstring).

    Attributes: ``files`` (absolute paths, shard order), ``file_sizes`` (bytes),
    ``file_mtimes_ns``, ``file_identity`` (``(ctime_ns, dev, ino)`` of each file as indexed:
    the readers compare with it, so a change before they open the files is seen), ``arch``, ``alignment``, ``n_layers`` (block_count),
    ``expert_layers`` (ascending block numbers with routed experts), ``n_experts``, ``top_k``
    (0 when the file does not say), ``n_shared_experts``, ``size_classes``, ``layer_class``
    (block -> size class id), ``routed_expert_bytes`` (all routed-expert bytes: sum over expert
    blocks of slot_bytes * n_experts), ``shared`` (list of dicts: name, layer, kind
    'shared_expert'|'dense_ffn', ggml_type, shape, nbytes, file, offset).
    """

    def __init__(self):
        self.files: list[str] = []
        self.file_sizes: list[int] = []
        self.file_mtimes_ns: list[int] = []
        self.file_identity: list[tuple[int, int, int]] = []   # (ctime_ns, dev, ino) per file
        self.arch = ""
        self.alignment = 32
        self.n_layers = 0
        self.expert_layers: list[int] = []
        self.n_experts = 0
        self.top_k = 0
        self.n_shared_experts = 0
        self.size_classes: list[SizeClass] = []
        self.layer_class: dict[int, int] = {}
        self.routed_expert_bytes = 0
        self.shared: list = []
        self._tables: dict[int, tuple] = {}   # layer -> (offsets[E,P] int64, file_ids[E,P] int32)
        self._tensor_table: list = []

    # ------------------------------------------------------------------ lookups
    def _check(self, layer: int, expert: int):
        if layer not in self.layer_class:
            raise KeyError(f"block {layer} has no routed experts (expert blocks: {_fmt_layers(self.expert_layers)})")
        if not 0 <= expert < self.n_experts:
            raise ValueError(f"expert {expert} out of range: block {layer} has experts 0..{self.n_experts - 1}")

    def parts(self, layer: int, expert: int) -> list[PartSpan]:
        """The parts of expert ``expert`` of block ``layer``, in its size class's ``parts`` order.
        Raises KeyError for a block without routed experts, ValueError for an expert out of range."""
        self._check(layer, expert)
        sc = self.size_classes[self.layer_class[layer]]
        offs, fids = self._tables[layer]
        return [PartSpan(p, int(fids[expert, j]), int(offs[expert, j]), sc.part_bytes[p], sc.part_types[p],
                         sc.part_shapes[p]) for j, p in enumerate(sc.parts)]

    def part_table(self, layer: int):
        """Fast path for readers: ``(offsets, file_ids)`` for block ``layer``: read-only int64 and
        int32 arrays of shape ``[n_experts, n_parts]`` (parts in size-class order; byte lengths
        are ``size_classes[layer_class[layer]].part_bytes``). Raises KeyError like :meth:`parts`."""
        if layer not in self._tables:
            self._check(layer, 0)
        return self._tables[layer]

    def file_facts(self) -> list[dict]:
        """Per file (shard order), as indexed: ``path``, ``size``, ``mtime_ns``, ``ctime_ns``,
        ``dev``, ``ino``: what a state file records and what the hello reply gives an engine to
        check that the file it loaded is the one served (``model_files``)."""
        return [{"path": str(getattr(f, "path", f)), "size": int(self.file_sizes[i]),
                 "mtime_ns": int(self.file_mtimes_ns[i]), "ctime_ns": int(self.file_identity[i][0]),
                 "dev": int(self.file_identity[i][1]), "ino": int(self.file_identity[i][2])}
                for i, f in enumerate(self.files)]

    def fingerprint(self) -> str:
        """Stable hex hash of the files' names, sizes and mtimes plus the tensor table
        (names, types, shapes, files, offsets); changes when any file is replaced or touched."""
        h = hashlib.sha256()
        h.update(json.dumps([[os.path.basename(f), s, m] for f, s, m in
                             zip(self.files, self.file_sizes, self.file_mtimes_ns)]).encode())
        h.update(json.dumps(self._tensor_table).encode())
        return h.hexdigest()[:32]

    def to_json(self) -> dict:
        """JSON-able summary (what ``moecache-ctl inspect --json`` prints)."""
        return {
            "files": list(self.files),
            "arch": self.arch,
            "n_layers": self.n_layers,
            "expert_layers": list(self.expert_layers),
            "n_experts": self.n_experts,
            "top_k": self.top_k,
            "n_shared_experts": self.n_shared_experts,
            "routed_expert_bytes": self.routed_expert_bytes,
            "size_classes": [{"id": c.id, "layers": list(c.layers), "parts": list(c.parts),
                              "part_bytes": dict(c.part_bytes), "part_types": dict(c.part_types),
                              "part_shapes": {k: list(v) for k, v in c.part_shapes.items()},
                              "slot_bytes": c.slot_bytes} for c in self.size_classes],
            "shared": [dict(s, shape=list(s["shape"])) for s in self.shared],
            "fingerprint": self.fingerprint(),
        }


# ---------------------------------------------------------------------- opening

def _resolve_set(path: str) -> tuple[list[str], int | None, str | None]:
    path = os.path.abspath(path)
    m = SPLIT_NAME.match(os.path.basename(path))
    if not m:
        return [path], None, None
    count, no = int(m.group("count")), int(m.group("no"))
    d, prefix = os.path.dirname(path), m.group("prefix")
    if count < 1 or not 1 <= no <= count:
        raise GGUFError(f"{path}: file name: found shard {no} of {count}, expected 1 <= shard <= count")
    files = [os.path.join(d, f"{prefix}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for i, f in enumerate(files, 1):
        if not os.path.exists(f):
            raise GGUFError(f"{f}: shard: found no such file, expected shard {i} of {count} "
                            f"of split set {prefix}-NNNNN-of-{count:05d}.gguf")
    return files, count, prefix


def _tensors_of(r: _HeaderReader, path: str, fid: int) -> list[_Tensor]:
    out = []
    for f in r.tensor_fields:
        _nl, name_data, n_dims, dims, raw_type, off = f.parts
        try:
            name = bytes(name_data).decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{path}: tensor {bytes(name_data)!r}: found a name that is not UTF-8, expected UTF-8") from None
        nd = int(n_dims[0])
        if not 1 <= nd <= 4:
            raise GGUFError(f"{path}: tensor {name}: found {nd} dimensions, expected 1..4")
        ne = tuple(int(x) for x in dims.tolist())
        try:
            qt = GGMLQuantizationType(int(raw_type[0]))
        except ValueError:
            raise GGUFError(f"{path}: tensor {name}: found ggml type {int(raw_type[0])}, expected a type known to "
                            f"gguf {GGUF_VERSION_STR} (0..{max(int(t) for t in GGMLQuantizationType)})") from None
        if qt not in GGML_QUANT_SIZES:
            raise GGUFError(f"{path}: tensor {name}: found ggml type {qt.name}, expected a type with a known block size")
        block, tsize = GGML_QUANT_SIZES[qt]
        if ne[0] % block:
            raise GGUFError(f"{path}: tensor {name}: found ne0 {ne[0]}, expected a multiple of {qt.name} block size {block}")
        n = 1
        for x in ne:
            n *= x
        rel = int(off[0])
        if rel % r.alignment:
            raise GGUFError(f"{path}: tensor {name}: found data offset {rel}, expected a multiple of alignment {r.alignment}")
        out.append(_Tensor(name, qt, ne, n // block * tsize, fid, r.data_offset + rel))
    return out


def _check_spans(path: str, size: int, tensors: list[_Tensor]):
    ts = sorted(tensors, key=lambda t: (t.offset, t.nbytes))
    for i, t in enumerate(ts):
        # overflow-safe: offsets/sizes are Python ints, compared without wrapping
        if t.offset > size or t.nbytes > size - t.offset:
            raise GGUFError(f"{path}: tensor {t.name}: found data end at byte {t.offset + t.nbytes}, "
                            f"expected at most the file size {size} (truncated file?)")
        if i + 1 < len(ts):
            nx = ts[i + 1]
            if nx.offset - t.offset < t.nbytes:
                raise GGUFError(f"{path}: tensor {t.name}: found span of {nx.offset - t.offset} bytes "
                                f"(next tensor {nx.name} starts at byte {nx.offset}), expected at least {t.nbytes} "
                                f"bytes for {t.qtype.name} {list(t.ne)}")


def open_index(path: str) -> ExpertIndex:
    """Index a GGUF model. ``path`` may be a single file or any shard of a split set
    (``PREFIX-NNNNN-of-MMMMM.gguf``: all shards are found and checked).

    Refuses (:class:`GGUFError`, one line): missing/unreadable files, bad magic, GGUF versions
    or byte orders gguf cannot read, bad ``general.alignment``, unknown ggml types, tensors
    past the end of their file or overlapping the next tensor, duplicate tensor names (also
    across shards), missing shards, shards of another split set, ``split.count`` /
    ``split.tensors.count`` disagreeing with what is found, expert counts disagreeing between
    tensors or with ``{arch}.expert_count``, and files without routed experts.
    """
    files, count, prefix = _resolve_set(path)
    idx = ExpertIndex()
    for f in files:   # before the headers are read: a change after this is a change
        try:
            st = os.stat(f)
        except OSError:
            _read_header(f)   # raises the one-line refusal (no such file, permissions)
            raise
        idx.files.append(f)
        idx.file_sizes.append(st.st_size)
        idx.file_mtimes_ns.append(st.st_mtime_ns)
        idx.file_identity.append((st.st_ctime_ns, st.st_dev, st.st_ino))
    readers = [_read_header(f) for f in files]
    first = files[0]

    # split-set consistency
    if count is None:
        r = readers[0]
        sc = _int_kv(r, first, "split.count")
        if sc is not None and sc != 1:
            raise GGUFError(f"{first}: key split.count: found {sc}, expected 1 for a file not named "
                            f"PREFIX-NNNNN-of-NNNNN.gguf")
    else:
        tc0 = None
        for i, (f, r) in enumerate(zip(files, readers)):
            for key in ("split.no", "split.count", "split.tensors.count"):
                if _int_kv(r, f, key) is None:
                    raise GGUFError(f"{f}: key {key}: found none, expected it in shard {i + 1} of {count}")
            sc, sn, tc = (_int_kv(r, f, "split.count"), _int_kv(r, f, "split.no"), _int_kv(r, f, "split.tensors.count"))
            if sc != count:
                raise GGUFError(f"{f}: key split.count: found {sc}, expected {count} (from the file name)")
            if sn != i:
                raise GGUFError(f"{f}: key split.no: found {sn}, expected {i} (shard {i + 1} of the file name)")
            if i == 0:
                tc0 = tc
            elif tc != tc0:
                raise GGUFError(f"{f}: key split.tensors.count: found {tc}, expected {tc0} as in "
                                f"{os.path.basename(first)} (shard of another split set?)")

    # tensor tables, spans, duplicates
    tensors: list[_Tensor] = []
    seen: dict[str, int] = {}
    for fid, (f, r) in enumerate(zip(files, readers)):
        ts = _tensors_of(r, f, fid)
        for t in ts:
            if t.name in seen:
                where = "in the same file" if seen[t.name] == fid else f"in {os.path.basename(files[seen[t.name]])}"
                raise GGUFError(f"{f}: tensor {t.name}: found a second tensor of this name ({where}), expected unique names")
            seen[t.name] = fid
        _check_spans(f, idx.file_sizes[fid], ts)
        tensors.extend(ts)
    if count is not None and tc0 != len(tensors):
        raise GGUFError(f"{first}: key split.tensors.count: found {tc0}, expected {len(tensors)} "
                        f"(tensors found in {count} shards)")
    if count is None:
        tc = _int_kv(readers[0], first, "split.tensors.count")
        if tc is not None and tc != len(tensors):
            raise GGUFError(f"{first}: key split.tensors.count: found {tc}, expected {len(tensors)} (tensors in the file)")

    # metadata
    r0 = readers[0]
    arch = _kv(r0, "general.architecture")
    idx.arch = arch if isinstance(arch, str) else ""
    idx.alignment = int(r0.alignment)

    def meta(suffix):
        return _int_kv(r0, first, f"{idx.arch}.{suffix}") if idx.arch else None

    blocks = {}
    for t in tensors:
        m = _BLK.match(t.name)
        if m:
            blocks.setdefault(int(m.group(1)), []).append((m.group(2), t))
    bc = meta("block_count")
    if bc is not None:
        for b, lst in blocks.items():
            if b >= bc:
                raise GGUFError(f"{files[lst[0][1].file]}: tensor {lst[0][1].name}: found block {b}, "
                                f"expected < {idx.arch}.block_count {bc}")
        idx.n_layers = bc
    else:
        idx.n_layers = max(blocks, default=-1) + 1

    # routed experts
    layers: dict[int, dict[str, object]] = {}
    ref = None  # the first routed-expert tensor: the expert count every other must match
    for b in sorted(blocks):
        merged, legacy = {}, {}
        for rest, t in blocks[b]:
            me = _EXPS.match(rest)
            if me:
                part = me.group(1) + ("" if me.group(2) == "weight" else "_bias")
                if len(t.ne) < 2 or t.ne[-1] < 1 or any(x < 1 for x in t.ne):
                    raise GGUFError(f"{files[t.file]}: tensor {t.name}: found shape {list(t.ne)}, "
                                    f"expected >= 2 positive dimensions (last = experts)")
                merged[part] = t
                continue
            ml = _LEGACY.match(rest)
            if ml:
                legacy.setdefault(ml.group(1), {})[int(ml.group(2))] = t
                continue
            if _SHEXP.match(rest):
                idx.shared.append({"name": t.name, "layer": b, "kind": "shared_expert", "ggml_type": t.qtype.name,
                                   "shape": t.ne, "nbytes": t.nbytes, "file": t.file, "offset": t.offset})
            elif _DENSE.match(rest):
                idx.shared.append({"name": t.name, "layer": b, "kind": "dense_ffn", "ggml_type": t.qtype.name,
                                   "shape": t.ne, "nbytes": t.nbytes, "file": t.file, "offset": t.offset})
        if not merged and not legacy:
            continue
        spans = {}  # part -> (E, bytes, type, shape, file_ids list, offsets list, ref tensor)
        for part, t in merged.items():
            e = t.ne[-1]
            spans[part] = (e, t.nbytes // e, t.qtype.name, t.ne[:-1],
                           [t.file] * e, [t.offset + i * (t.nbytes // e) for i in range(e)], t)
        for part, d in legacy.items():
            if part in spans:
                t = d[min(d)]
                raise GGUFError(f"{files[t.file]}: tensor {t.name}: found per-expert tensors next to "
                                f"{spans[part][6].name}, expected one form per part")
            e = max(d) + 1
            for i in range(e):
                if i not in d:
                    raise GGUFError(f"{files[d[min(d)].file]}: tensor blk.{b}.ffn_{part}.{i}.weight: found none, "
                                    f"expected experts 0..{e - 1} (blk.{b}.ffn_{part}.{e - 1}.weight exists)")
            t0 = d[0]
            for i in range(1, e):
                t = d[i]
                if t.qtype != t0.qtype or t.ne != t0.ne:
                    raise GGUFError(f"{files[t.file]}: tensor {t.name}: found {t.qtype.name} {list(t.ne)}, "
                                    f"expected {t0.qtype.name} {list(t0.ne)} as {t0.name}")
            spans[part] = (e, t0.nbytes, t0.qtype.name, t0.ne, [d[i].file for i in range(e)],
                           [d[i].offset for i in range(e)], t0)
        for part in sorted(spans, key=_part_key):
            e, *_rest, t = spans[part]
            if ref is None:
                idx.n_experts, ref = e, t
            if e != idx.n_experts:
                raise GGUFError(f"{files[t.file]}: tensor {t.name}: found {e} experts, "
                                f"expected {idx.n_experts} as {ref.name}")
        layers[b] = spans
    if not layers:
        raise GGUFError(f"{first}: tensors: found no routed-expert tensors (blk.N.ffn_*_exps.* or "
                        f"blk.N.ffn_*.E.weight) among {len(tensors)}, expected at least one")
    ec = meta("expert_count")
    if ec is not None and ec != idx.n_experts:
        b0 = min(layers)
        t = layers[b0][sorted(layers[b0], key=_part_key)[0]][6]
        raise GGUFError(f"{first}: key {idx.arch}.expert_count: found {ec}, expected {idx.n_experts} "
                        f"(experts in tensor {t.name})")
    k = meta("expert_used_count")
    if k is not None and not 0 <= k <= idx.n_experts:
        raise GGUFError(f"{first}: key {idx.arch}.expert_used_count: found {k}, expected 0..{idx.n_experts} (expert count)")
    idx.top_k = k or 0
    sh = meta("expert_shared_count")
    if sh is not None:
        idx.n_shared_experts = sh
    else:
        idx.n_shared_experts = 1 if any(s["kind"] == "shared_expert" for s in idx.shared) else 0

    # size classes and tables
    idx.expert_layers = sorted(layers)
    keys: dict[tuple, int] = {}
    for b in idx.expert_layers:
        spans = layers[b]
        parts = sorted(spans, key=_part_key)
        key = tuple((p, spans[p][1], spans[p][2], spans[p][3]) for p in parts)
        if key not in keys:
            keys[key] = len(idx.size_classes)
            idx.size_classes.append(SizeClass(
                id=len(idx.size_classes), layers=[], parts=parts,
                part_bytes={p: spans[p][1] for p in parts}, part_types={p: spans[p][2] for p in parts},
                slot_bytes=sum(spans[p][1] for p in parts), part_shapes={p: tuple(spans[p][3]) for p in parts}))
        c = idx.size_classes[keys[key]]
        c.layers.append(b)
        idx.layer_class[b] = c.id
        offs = np.array([spans[p][5] for p in parts], dtype=np.int64).T.copy()
        fids = np.array([spans[p][4] for p in parts], dtype=np.int32).T.copy()
        offs.flags.writeable = False
        fids.flags.writeable = False
        idx._tables[b] = (offs, fids)
        idx.routed_expert_bytes += c.slot_bytes * idx.n_experts
    idx._tensor_table = [[t.name, t.qtype.name, list(t.ne), t.file, t.offset] for t in tensors]
    return idx
