"""Layout files: a model's GGUF tensor table and metadata as JSON (format in docs/layout-format.md).

A layout describes a GGUF model without its weights: every tensor's name, ggml type and shape
(ggml ``ne`` order, fastest-varying dimension first), plus the metadata key/values. ``synth``
writes real GGUF files from a layout; users can describe their own model in the same format.

The default layout (Qwen3-30B-A3B Q4_K_M) ships as package data and loads by name::

    load_layout("qwen3-30b-a3b-Q4_K_M")           # embedded default
    load_layout("/path/to/my-model.json")          # any file in the documented format

Errors are :class:`LayoutError` with one line: ``LAYOUT: tensor/key X: found V, expected W``.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from moecached import MoecacheError

DATA_DIR = Path(__file__).resolve().parents[1] / "data"

# metadata keys whose values really are strings in GGUF files (everything else must be a number/bool)
_STRING_KEY_SUFFIXES = (".rope.scaling.type", "tokenizer.ggml.model", "tokenizer.ggml.pre")
_GENERAL_NUMERIC = {"general.file_type", "general.quantization_version", "general.alignment"}
_TYPE_NAMES = {
    "u8": GGUFValueType.UINT8, "i8": GGUFValueType.INT8, "u16": GGUFValueType.UINT16,
    "i16": GGUFValueType.INT16, "u32": GGUFValueType.UINT32, "i32": GGUFValueType.INT32,
    "u64": GGUFValueType.UINT64, "i64": GGUFValueType.INT64, "f32": GGUFValueType.FLOAT32,
    "f64": GGUFValueType.FLOAT64, "bool": GGUFValueType.BOOL, "str": GGUFValueType.STRING,
}
_INT_RANGES = {
    GGUFValueType.UINT8: (0, 2**8 - 1), GGUFValueType.INT8: (-2**7, 2**7 - 1),
    GGUFValueType.UINT16: (0, 2**16 - 1), GGUFValueType.INT16: (-2**15, 2**15 - 1),
    GGUFValueType.UINT32: (0, 2**32 - 1), GGUFValueType.INT32: (-2**31, 2**31 - 1),
    GGUFValueType.UINT64: (0, 2**64 - 1), GGUFValueType.INT64: (-2**63, 2**63 - 1),
}


class LayoutError(MoecacheError):
    """A layout file is unreadable, incomplete or inconsistent (one line: where, found, expected)."""


def ggml_type_by_name(name: str) -> GGMLQuantizationType:
    """'Q4_K' / 'q4_k' / 'MXFP4' -> GGMLQuantizationType. Raises KeyError for unknown names."""
    try:
        return GGMLQuantizationType[name.upper()]
    except KeyError:
        for t in GGMLQuantizationType:
            if t.name.upper() == name.upper():
                return t
        raise


def tensor_nbytes(ggml_type: GGMLQuantizationType, shape) -> int:
    """Bytes of a tensor of ``ggml_type`` with ggml ne ``shape``. Raises ValueError when ne0 is
    not a multiple of the type's block size."""
    block, tsize = GGML_QUANT_SIZES[ggml_type]
    if not shape or shape[0] % block:
        raise ValueError(f"ne0 {shape[0] if shape else None} is not a multiple of {ggml_type.name} block size {block}")
    n = 1
    for d in shape:
        n *= int(d)
    return n // block * tsize


@dataclass
class LayoutTensor:
    """One tensor of a layout: ``shape`` in ggml ne order (ne0 first), ``nbytes`` computed."""
    name: str
    ggml_type: str
    shape: tuple
    nbytes: int

    @property
    def qtype(self) -> GGMLQuantizationType:
        return ggml_type_by_name(self.ggml_type)


@dataclass
class Layout:
    """A validated layout. ``metadata`` holds the raw JSON values (notes included);
    :meth:`gguf_metadata` gives the keys that can be written into a GGUF file."""
    name: str
    source: str
    arch: str
    alignment: int
    metadata: dict
    tensors: list  # list[LayoutTensor], file order
    complete: bool = True
    model: str = ""
    quant: str = ""
    extra: dict = field(default_factory=dict)

    def meta_int(self, suffix: str, default=None):
        """Integer value of the key ``{arch}.{suffix}``, else default (notes and strings ignored)."""
        v = self.metadata.get(f"{self.arch}.{suffix}")
        if isinstance(v, dict):
            v = v.get("value")
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        return default

    def gguf_metadata(self) -> tuple[list, list]:
        """Metadata to write into a GGUF file.

        Returns ``(items, skipped)``: items are ``(key, value, GGUFValueType)`` for real namespaced
        keys (``general.*``, ``{arch}.*``, ``tokenizer.*``) with properly typed values; skipped are
        ``(key, reason)`` for notes (un-namespaced keys, strings where numbers belong, split keys).
        A string that starts with an integer where a number belongs gives that integer.
        Values may be plain JSON scalars (int -> u32 when it fits, else i64/u64; float -> f32;
        bool; str) or explicit ``{"type": "u16", "value": 3}``.
        """
        items, skipped = [], []
        prefixes = ("general.", f"{self.arch}.", "tokenizer.")
        for key, raw in self.metadata.items():
            if not key.startswith(prefixes) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", key):
                skipped.append((key, "not a namespaced GGUF key"))
                continue
            if key.startswith("split."):
                skipped.append((key, "split keys are written per shard"))
                continue
            if isinstance(raw, dict):
                t = _TYPE_NAMES.get(str(raw.get("type", "")).lower())
                if t is None or "value" not in raw:
                    raise LayoutError(f"{self.source}: key {key}: found {raw!r}, expected "
                                      f"{{'type': one of {sorted(_TYPE_NAMES)}, 'value': V}}")
                items.append((key, _coerce(self.source, key, raw["value"], t), t))
                continue
            string_key = (key.startswith("general.") and key not in _GENERAL_NUMERIC) or key.endswith(_STRING_KEY_SUFFIXES)
            if isinstance(raw, bool):
                items.append((key, raw, GGUFValueType.BOOL))
            elif isinstance(raw, int):
                if 0 <= raw < 2**32:
                    items.append((key, raw, GGUFValueType.UINT32))
                elif -2**63 <= raw < 0:
                    items.append((key, raw, GGUFValueType.INT64))
                else:
                    items.append((key, raw, GGUFValueType.UINT64))
            elif isinstance(raw, float):
                items.append((key, raw, GGUFValueType.FLOAT32))
            elif isinstance(raw, str):
                if string_key:
                    items.append((key, raw, GGUFValueType.STRING))
                else:
                    m = re.match(r"\s*(\d+)\b", raw)
                    if m:
                        items.append((key, int(m.group(1)), GGUFValueType.UINT32))
                    else:
                        skipped.append((key, "note where a number belongs"))
            elif isinstance(raw, list) and raw and all(isinstance(x, (int, float, str)) and not isinstance(x, bool) for x in raw):
                items.append((key, raw, GGUFValueType.ARRAY))
            else:
                skipped.append((key, f"unsupported value {raw!r}"))
        return items, skipped


def _coerce(source, key, value, t):
    if t == GGUFValueType.STRING:
        if not isinstance(value, str):
            raise LayoutError(f"{source}: key {key}: found {value!r}, expected a string")
        return value
    if t == GGUFValueType.BOOL:
        if not isinstance(value, bool):
            raise LayoutError(f"{source}: key {key}: found {value!r}, expected true/false")
        return value
    if t in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise LayoutError(f"{source}: key {key}: found {value!r}, expected a number")
        return float(value)
    lo, hi = _INT_RANGES[t]
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise LayoutError(f"{source}: key {key}: found {value!r}, expected an integer in [{lo}, {hi}]")
    return value


def layout_names() -> list[str]:
    """Names of the embedded layouts (loadable by name)."""
    return sorted(p.name[: -len(".layout.json")] for p in DATA_DIR.glob("*.layout.json"))


def resolve_layout_path(name_or_path: str | os.PathLike) -> Path:
    """Path of a layout given a file path or the name of an embedded layout."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    cand = DATA_DIR / f"{name_or_path}.layout.json"
    if cand.is_file():
        return cand
    raise LayoutError(f"{name_or_path}: layout: found no such file or embedded layout, expected a path "
                      f"or one of {layout_names()}")


def load_layout(name_or_path: str | os.PathLike, allow_incomplete: bool = False) -> Layout:
    """Load and validate a layout (path to a JSON file, or an embedded layout's name).

    Checks: JSON object with ``metadata`` (including ``general.architecture``) and ``tensors``
    (each ``name``, ``ggml_type`` known to gguf, ``shape`` of 1-4 positive ints in ne order with
    ne0 a multiple of the type's block size, optional ``nbytes`` equal to the computed size),
    unique names, ``alignment`` a power of two, and ``complete`` not false (partial layouts lack
    types; pass allow_incomplete=True only to read their metadata).
    Raises :class:`LayoutError` (one line) on any violation.
    """
    path = resolve_layout_path(name_or_path)
    src = str(path)
    try:
        with open(path, "rb") as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise LayoutError(f"{src}: file: found unreadable JSON ({e.__class__.__name__}: {e}), expected a layout object") from None
    if not isinstance(d, dict):
        raise LayoutError(f"{src}: file: found {type(d).__name__}, expected a JSON object")
    complete = d.get("complete", True)
    if complete is False and not allow_incomplete:
        raise LayoutError(f"{src}: key complete: found false (partial layout, tensor types unknown), expected true")
    meta = d.get("metadata")
    if not isinstance(meta, dict):
        raise LayoutError(f"{src}: key metadata: found {type(meta).__name__}, expected an object")
    arch = meta.get("general.architecture", d.get("arch"))
    if isinstance(arch, dict):
        arch = arch.get("value")
    if not isinstance(arch, str) or not arch:
        raise LayoutError(f"{src}: key general.architecture: found {arch!r}, expected a non-empty string")
    align = d.get("alignment", meta.get("general.alignment", 32))
    if isinstance(align, dict):
        align = align.get("value")
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise LayoutError(f"{src}: key alignment: found {align!r}, expected a power of two")
    raw_tensors = d.get("tensors")
    if not isinstance(raw_tensors, list) or not raw_tensors:
        raise LayoutError(f"{src}: key tensors: found {type(raw_tensors).__name__}, expected a non-empty list")
    tensors, seen = [], set()
    for i, t in enumerate(raw_tensors):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise LayoutError(f"{src}: tensors[{i}]: found {t!r:.80}, expected an object with a name")
        name = t["name"]
        if name in seen:
            raise LayoutError(f"{src}: tensor {name}: found a second entry, expected unique names")
        seen.add(name)
        tname = t.get("ggml_type")
        if not isinstance(tname, str):
            if allow_incomplete:
                continue
            raise LayoutError(f"{src}: tensor {name}: found ggml_type {tname!r}, expected a ggml type name")
        try:
            qt = ggml_type_by_name(tname)
        except KeyError:
            raise LayoutError(f"{src}: tensor {name}: found ggml_type {tname!r}, expected one of gguf's "
                              f"types ({', '.join(x.name for x in GGMLQuantizationType)})") from None
        shape = t.get("shape")
        if (not isinstance(shape, list) or not 1 <= len(shape) <= 4
                or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in shape)):
            raise LayoutError(f"{src}: tensor {name}: found shape {shape!r}, expected 1-4 positive ints (ggml ne order)")
        try:
            nb = tensor_nbytes(qt, shape)
        except ValueError as e:
            raise LayoutError(f"{src}: tensor {name}: found shape {shape} ({e}), expected ne0 a multiple of the block size") from None
        if "nbytes" in t and t["nbytes"] != nb:
            raise LayoutError(f"{src}: tensor {name}: found nbytes {t['nbytes']!r}, expected {nb} for {qt.name} {shape}")
        tensors.append(LayoutTensor(name, qt.name, tuple(shape), nb))
    stem = path.name
    for suf in (".layout.json", ".json"):
        if stem.endswith(suf):
            stem = stem[: -len(suf)]
            break
    return Layout(name=stem, source=src, arch=arch, alignment=align, metadata=dict(meta),
                  tensors=tensors, complete=bool(complete), model=str(d.get("model", "")),
                  quant=str(d.get("quant", "")))
