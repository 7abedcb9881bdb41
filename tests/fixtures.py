"""Shared model fixtures for tests (owned by the index/synth work; others import these).

Usage in any test module::

    from fixtures import make_model, layout_path      # tests/ is on sys.path via conftest.py

    def test_something(tmp_path):
        path = make_model(tmp_path, "qwen3-30b-a3b-Q4_K_M", layers=4, experts=8)
        idx = moecached.engine.index.open_index(path)

or, session-scoped, through the ``model_factory`` fixture of ``tests/conftest.py``::

    def test_other(model_factory):
        path = model_factory("olmoe-1b-7b-0924-Q4_K_M", layers=2, experts=4, split=3)

``make_model`` writes each distinct (layout, layers, experts, split, legacy, seed) once per
session (module-level cache; the files live in the first caller's tmp dir) and returns the path
to open (first shard for split sets). The models are large (tens to hundreds of MiB each),
so ``tests/conftest.py`` calls :func:`remove_models` when the session ends, whatever its
outcome. Expert bytes are ``moecached.tools.synth.expected_expert_bytes(block, part, expert, nbytes, seed)``; use
``read_and_verify`` to check every slice of an index.

Layouts: the embedded ``qwen3-30b-a3b-Q4_K_M`` always works; other names come from
``$MOECACHE_SHARED/layouts`` or ``<repo>/../shared/layouts`` and the test is skipped (with the
reason) when that directory is absent.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from moecached.facts.layout import DATA_DIR
from moecached.tools.synth import verify_expert_bytes, write_model

_CACHE: dict[tuple, str] = {}


def shared_dir() -> Path:
    """The project's shared data (``layouts/``, ``traces/``): ``$MOECACHE_SHARED`` if set, else
    ``<repo>/../shared``. It may be absent: use the helpers below, which skip or say so."""
    env = os.environ.get("MOECACHE_SHARED")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared"


def shared_traces() -> list[Path]:
    """The shared routing traces (``*.npz`` under ``shared_dir()/traces``), sorted; [] when absent."""
    return sorted((shared_dir() / "traces").glob("*.npz"))


def trace_path(name: str) -> Path:
    """Path of the shared trace ``name`` (file name); skips the calling test when it is absent."""
    p = shared_dir() / "traces" / name
    if not p.is_file():
        pytest.skip(f"shared trace {name} not found (set MOECACHE_SHARED or provide ../shared/traces)")
    return p


def shared_layouts_dir() -> Path | None:
    """Directory of the project's reference layouts: ``shared_dir()/layouts`` (or
    ``$MOECACHE_SHARED`` itself when it holds the layouts); None when absent."""
    env = os.environ.get("MOECACHE_SHARED")
    cands = [shared_dir() / "layouts"] + ([Path(env)] if env else [])
    cands.append(Path(__file__).resolve().parents[2] / "shared" / "layouts")
    for c in cands:
        if c.is_dir() and any(c.glob("*.json")):
            return c
    return None
_WRITTEN: list[Path] = []   # directories make_model wrote, removed by remove_models()


def layout_path(name: str) -> str:
    """Path of a layout by name (a shared layout without ``.json``, else the embedded default) or path;
    skips the calling test when a shared layout is needed but the directory is absent."""
    if os.path.isfile(name):
        return name
    d = shared_layouts_dir()
    if d is not None and (d / f"{name}.json").is_file():
        return str(d / f"{name}.json")
    emb = DATA_DIR / f"{name}.layout.json"
    if emb.is_file():
        return str(emb)
    if d is None:
        pytest.skip(f"shared layouts not found (set MOECACHE_SHARED or provide ../shared/layouts) for {name}")
    p = d / (name if name.endswith(".json") else f"{name}.json")
    if not p.is_file():
        pytest.skip(f"layout {name} not in {d}")
    return str(p)


def complete_layouts() -> list[str]:
    """Names of the complete layouts in the shared directory ([] when absent)."""
    d = shared_layouts_dir()
    if d is None:
        return []
    return sorted(p.name[:-5] for p in d.glob("*.json") if not p.name.endswith(".partial.json"))


def make_model(tmp_path, layout_name: str, layers=4, experts=8, split=None, legacy=False, seed=0) -> str:
    """Write (once per session) a scaled synth model and return the path to open.
    ``layers``: N or a list of source block numbers; see moecached.tools.synth.write_model."""
    key = (layout_name, tuple(layers) if isinstance(layers, (list, tuple)) else layers, experts, split, legacy, seed)
    p = _CACHE.get(key)
    if p and os.path.exists(p):
        return p
    lp = layout_path(layout_name)
    tag = f"{Path(lp).name.split('.')[0]}-L{'_'.join(map(str, key[1])) if isinstance(key[1], tuple) else key[1]}" \
          f"-E{experts}-S{split or 1}{'-legacy' if legacy else ''}-seed{seed}"
    out = Path(tmp_path) / "models" / tag / "model.gguf"
    _WRITTEN.append(out.parent)
    paths = write_model(lp, out, layers=layers, experts=experts, split=split, seed=seed, progress=False, legacy=legacy)
    _CACHE[key] = paths[0]
    return paths[0]


def remove_models() -> None:
    """Delete every model :func:`make_model` wrote during this pytest run (and forget them)."""
    while _WRITTEN:
        shutil.rmtree(_WRITTEN.pop(), ignore_errors=True)
    _CACHE.clear()


def file_bytes(idx, layer, expert) -> dict:
    """The bytes of expert ``expert`` of ``layer`` in the model file(s) of ``idx``, by part name
    (what a lease's ``parts(expert)`` must hold)."""
    out = {}
    for s in idx.parts(layer, expert):
        with open(idx.files[s.file], "rb") as f:
            f.seek(s.offset)
            out[s.part] = f.read(s.nbytes)
    return out


def read_and_verify(idx, seed=0, experts=None) -> list[str]:
    """Read every expert part of every expert block through ``idx`` (plain reads at
    PartSpan.offset) and return the list of mismatch descriptions (empty when all slices
    carry their own stamp and bytes)."""
    bad = []
    fs = [open(f, "rb") for f in idx.files]
    try:
        for layer in idx.expert_layers:
            for e in (range(idx.n_experts) if experts is None else experts):
                for s in idx.parts(layer, e):
                    fs[s.file].seek(s.offset)
                    r = verify_expert_bytes(fs[s.file].read(s.nbytes), layer, s.part, e, seed)
                    if r:
                        bad.append(r)
    finally:
        for f in fs:
            f.close()
    return bad
