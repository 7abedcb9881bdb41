"""Routing traces: the ``.npz`` format, its validation, a JSONL converter and the recorder.

A trace is the routing decision of an MoE model, token by token (see ``docs/trace-format.md``):

================  ===============================  ==============================================
array             dtype / shape                    meaning
================  ===============================  ==============================================
``experts``       int16 ``[T, L, k]``              expert ids per token and MoE layer, router rank
                                                   order; ``-1`` = missing / padding
``is_prompt``     bool ``[T]``                     True for prompt (prefill) tokens
``weights``       float32 ``[T, L, k]`` (opt.)     gate weights, 0 where ``experts == -1``
``predicted``     int16 ``[T, L, kp]`` (opt.)      expert ids a gate-ahead predictor expected
                                                   before routing; ``-1`` padded
``scores``        float32 ``[T, L, k]`` (opt.)     router scores of ``experts`` (substitution)
``candidates``    int16 ``[T, L, kc]`` (opt.)      substitution candidates per token and layer,
                                                   ``-1`` padded; needs ``scores`` and
                                                   ``candidate_scores``
``candidate_scores`` float32 ``[T, L, kc]`` (opt.) router scores of ``candidates``
``step``          int32 ``[T]`` (opt.)             tokens verified together (one multi-token step,
                                                   e.g. MTP drafts) share a step id; each id is
                                                   one contiguous run of tokens
``meta``          0-d str (JSON object)            ``n_experts``, ``top_k``, ``n_moe_layers``,
                                                   counts, provenance ...
================  ===============================  ==============================================

``L`` counts MoE layers only: trace layer ``i`` is the model's ``i``-th block with routed experts.

Every validation error is a :class:`TraceError` (a ``MoecacheError`` and ``ValueError``) whose
message is one line naming the file, the array, the offending value and what was expected.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from moecached import MoecacheError
from moecached.facts.files import read_head

__all__ = ["Trace", "TraceError", "load_trace", "save_trace", "convert_jsonl",
           "TraceRecorder"]


class TraceError(MoecacheError, ValueError):
    """A trace file or array is malformed; ``str(e)`` is one line naming file, array, value."""


@dataclass
class Trace:
    """One routing trace (arrays as in the module docstring).

    Attributes:
        experts: int16 ``[n_tokens, n_layers, top_k]``, ``-1`` = missing.
        is_prompt: bool ``[n_tokens]``.
        weights: optional float32 ``[n_tokens, n_layers, top_k]``.
        predicted: optional int16 ``[n_tokens, n_layers, k_pred]``, ``-1`` padded.
        step: optional int32 ``[n_tokens]``; equal ids = one multi-token step (contiguous).
        scores: optional float32 ``[n_tokens, n_layers, top_k]``: router score of each expert.
        candidates: optional int16 ``[n_tokens, n_layers, k_cand]``, ``-1`` padded: experts
            the router ranked below the routed ones, offered as substitutes.
        candidate_scores: optional float32, shape of ``candidates``: their router scores.
        meta: JSON-able dict; ``n_experts`` is read from here (else inferred as max id + 1).
    """

    experts: np.ndarray
    is_prompt: np.ndarray
    weights: Optional[np.ndarray] = None
    predicted: Optional[np.ndarray] = None
    step: Optional[np.ndarray] = None
    meta: dict = field(default_factory=dict)
    scores: Optional[np.ndarray] = None
    candidates: Optional[np.ndarray] = None
    candidate_scores: Optional[np.ndarray] = None

    @property
    def n_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def n_layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[2])

    @property
    def n_experts(self) -> int:
        """Experts per layer: ``meta['n_experts']`` or, when absent, the largest id + 1."""
        n = self.meta.get("n_experts")
        if n is not None:
            return int(n)
        m = int(self.experts.max()) if self.experts.size else -1
        if self.predicted is not None and self.predicted.size:
            m = max(m, int(self.predicted.max()))
        if self.candidates is not None and self.candidates.size:
            m = max(m, int(self.candidates.max()))
        return max(m + 1, 1)

    @property
    def n_decode(self) -> int:
        return int(self.n_tokens - np.count_nonzero(self.is_prompt))

    def window(self, start: int = 0, end: Optional[int] = None, *, layers: Optional[int] = None) -> "Trace":
        """Tokens ``[start, end)`` (and, with ``layers``, only the first ``layers`` MoE layers)
        as a trace of their own: every per-token array sliced alike (contiguous), ``meta``
        kept but for the per-trace token counts, ``n_experts`` pinned (a window's ids need not
        reach the largest), ``n_moe_layers`` set when ``layers`` is given. The one way
        ``simulate``, ``replay`` and ``demo`` cut a trace."""
        end = self.n_tokens if end is None else min(int(end), self.n_tokens)
        start = max(0, int(start))
        lay = slice(None) if layers is None else slice(0, int(layers))

        def cut(a, per_layer=True):
            if a is None:
                return None
            return np.ascontiguousarray(a[start:end, lay] if per_layer else a[start:end])
        meta = {k: v for k, v in self.meta.items()
                if k not in ("n_tokens", "n_prompt_tokens", "n_decode_tokens")}
        meta["n_experts"] = self.n_experts
        if layers is not None:
            meta["n_moe_layers"] = int(layers)
        return Trace(experts=cut(self.experts), is_prompt=cut(self.is_prompt, False),
                     weights=cut(self.weights), predicted=cut(self.predicted),
                     step=cut(self.step, False), meta=meta, scores=cut(self.scores),
                     candidates=cut(self.candidates),
                     candidate_scores=cut(self.candidate_scores))

    def step_starts(self) -> np.ndarray:
        """int64 ``[n_steps + 1]``: the first token of every step (one token, or a run of equal
        ``step`` ids), then ``n_tokens``."""
        T = self.n_tokens
        if self.step is not None and T:
            starts = np.flatnonzero(np.r_[True, self.step[1:] != self.step[:-1]])
        else:
            starts = np.arange(T)
        return np.r_[starts, T].astype(np.int64)

    def validate(self, name: str = "<trace>") -> "Trace":
        """Check shapes, dtypes and id ranges; returns self. Raises TraceError (one line)."""
        _validate(self, name)
        return self


def _err(name, array, found, expected):
    return TraceError(f"{name}: {array}: found {found}, expected {expected}")


def _check_ids(name, array, a, n_experts):
    if a.size == 0:
        return
    lo, hi = int(a.min()), int(a.max())
    if lo < -1:
        idx = tuple(int(i) for i in np.argwhere(a < -1)[0])
        raise _err(name, f"{array}{list(idx)}", lo, "-1 (missing) or an expert id >= 0")
    if hi > 32767:
        idx = tuple(int(i) for i in np.argwhere(a > 32767)[0])
        raise _err(name, f"{array}{list(idx)}", hi, "an expert id < 32768 (ids are int16)")
    if n_experts is not None and hi >= n_experts:
        idx = tuple(int(i) for i in np.argwhere(a >= n_experts)[0])
        raise _err(name, f"{array}{list(idx)}", hi, f"an expert id < n_experts = {n_experts}")


def _check_scores(name, array, a, shape, shape_txt):
    if a.shape != shape:
        raise _err(name, array, f"shape {a.shape}", shape_txt)
    if not np.issubdtype(a.dtype, np.floating):
        raise _err(name, array, f"dtype {a.dtype}", "float32")
    bad = ~(np.isfinite(a) & (a >= 0))
    if bad.any():
        idx = [int(i) for i in np.argwhere(bad)[0]]
        raise _err(name, f"{array}{idx}", float(a[tuple(idx)]),
                   "a finite router score >= 0")


def _validate(t: Trace, name: str) -> None:
    e = t.experts
    if not isinstance(e, np.ndarray) or e.ndim != 3:
        raise _err(name, "experts", f"shape {getattr(e, 'shape', type(e).__name__)}",
                   "3 dimensions [tokens, moe_layers, top_k]")
    if not np.issubdtype(e.dtype, np.integer):
        raise _err(name, "experts", f"dtype {e.dtype}", "an integer dtype (int16)")
    T, L, k = e.shape
    if L < 1 or k < 1:
        raise _err(name, "experts", f"shape {e.shape}", "at least 1 layer and top_k >= 1")
    if not isinstance(t.meta, dict):
        raise _err(name, "meta", type(t.meta).__name__, "a JSON object")
    ne = t.meta.get("n_experts")
    if ne is not None and (not isinstance(ne, (int, np.integer)) or ne < 1):
        raise _err(name, "meta.n_experts", repr(ne), "an int >= 1")
    for key, want in (("n_moe_layers", L), ("n_tokens", T)):
        v = t.meta.get(key)
        if v is not None and v != want:
            raise _err(name, f"meta.{key}", v, f"{want} (experts.shape)")
    _check_ids(name, "experts", e, ne)
    p = t.is_prompt
    if not isinstance(p, np.ndarray) or p.shape != (T,):
        raise _err(name, "is_prompt", f"shape {getattr(p, 'shape', None)}", f"({T},)")
    if p.dtype != np.bool_:
        raise _err(name, "is_prompt", f"dtype {p.dtype}", "bool")
    if t.weights is not None:
        w = t.weights
        if w.shape != e.shape:
            raise _err(name, "weights", f"shape {w.shape}", f"{e.shape} (experts.shape)")
        if not np.issubdtype(w.dtype, np.floating):
            raise _err(name, "weights", f"dtype {w.dtype}", "float32")
    if t.predicted is not None:
        q = t.predicted
        if q.ndim != 3 or q.shape[:2] != (T, L):
            raise _err(name, "predicted", f"shape {q.shape}", f"({T}, {L}, k_pred)")
        if not np.issubdtype(q.dtype, np.integer):
            raise _err(name, "predicted", f"dtype {q.dtype}", "int16")
        _check_ids(name, "predicted", q, ne)
    if t.scores is not None:
        _check_scores(name, "scores", t.scores, e.shape, f"{e.shape} (experts.shape)")
    if t.candidates is not None:
        c = t.candidates
        if not isinstance(c, np.ndarray) or c.ndim != 3 or c.shape[:2] != (T, L):
            raise _err(name, "candidates", f"shape {getattr(c, 'shape', None)}", f"({T}, {L}, k_cand)")
        if not np.issubdtype(c.dtype, np.integer):
            raise _err(name, "candidates", f"dtype {c.dtype}", "int16")
        _check_ids(name, "candidates", c, ne)
        for other in ("scores", "candidate_scores"):
            if getattr(t, other) is None:
                raise _err(name, other, "no such array",
                           f"'{other}' beside 'candidates' (substitution needs both scores)")
    if t.candidate_scores is not None:
        if t.candidates is None:
            raise _err(name, "candidates", "no such array",
                       "'candidates' beside 'candidate_scores'")
        _check_scores(name, "candidate_scores", t.candidate_scores, t.candidates.shape,
                      f"{t.candidates.shape} (candidates.shape)")
    if t.step is not None:
        s = t.step
        if s.shape != (T,):
            raise _err(name, "step", f"shape {s.shape}", f"({T},)")
        if not np.issubdtype(s.dtype, np.integer):
            raise _err(name, "step", f"dtype {s.dtype}", "int32")
        if T:
            runs = s[np.r_[True, s[1:] != s[:-1]]]
            if len(np.unique(runs)) != len(runs):
                _, first = np.unique(runs, return_index=True)
                dup = runs[np.setdiff1d(np.arange(len(runs)), first)[0]]
                raise _err(name, "step", f"id {int(dup)} in two separate runs",
                           "each step id on one contiguous run of tokens")


_NOT_A_TRACE = "expected a .npz archive (docs/trace-format.md)"


def _one_line(ex: BaseException) -> str:
    msg = " ".join(str(ex).split()) or "no detail"
    return f"{type(ex).__name__}: {msg[:160]}"


def _open_npz(name: str):
    """``np.load`` of ``name`` after checking that it is a regular, non-empty zip file;
    TraceError (one line) for anything else."""
    head, _ = read_head(name, 6, TraceError, _NOT_A_TRACE, not_found="file not found, expected a trace .npz")
    if head.startswith(b"\x93NUMPY"):
        raise TraceError(f"{name}: not a trace: a single .npy array, {_NOT_A_TRACE}")
    if not head.startswith(b"PK"):
        raise TraceError(f"{name}: not a trace: {_NOT_A_TRACE}")
    try:
        return np.load(name, allow_pickle=False)
    except Exception as ex:  # zipfile.BadZipFile, OSError, ...
        raise TraceError(f"{name}: not a trace: unreadable archive ({_one_line(ex)}), "
                         f"{_NOT_A_TRACE}") from None


def _read_array(z, name: str, key: str) -> np.ndarray:
    try:
        return z[key]
    except ValueError as ex:
        if "pickle" in str(ex).lower() or "object" in str(ex).lower():
            raise _err(name, key, "an object (pickled) array",
                       "a numeric array (pickles are never loaded)") from None
        raise _err(name, key, f"an unreadable array ({_one_line(ex)})",
                   "an array written by numpy.savez") from None
    except Exception as ex:  # BadZipFile (CRC), zlib.error, EOFError, OSError
        raise _err(name, key, f"an unreadable array ({_one_line(ex)})",
                   "an array written by numpy.savez") from None


def load_trace(path) -> Trace:
    """Read and validate a trace ``.npz`` (no pickles).

    Returns:
        Trace with ``experts`` as int16, ``is_prompt`` bool, optional arrays as stored.
    Raises:
        TraceError: missing file, a directory / empty / non-zip / corrupt file, a pickled or
        unreadable array, missing arrays, bad JSON meta, bad shape/dtype/value (one line).
    """
    name = os.fspath(path)
    z = _open_npz(name)
    with z:
        files = set(z.files)
        if "experts" not in files and "is_prompt" not in files:
            shown = ", ".join(sorted(files)[:5]) + (", ..." if len(files) > 5 else "")
            raise TraceError(f"{name}: not a trace: found arrays [{shown}], expected arrays "
                             "experts and is_prompt (docs/trace-format.md)")
        for req in ("experts", "is_prompt"):
            if req not in files:
                raise _err(name, req, "no such array", "arrays experts and is_prompt")
        meta = {}
        if "meta" in files:
            raw = _read_array(z, name, "meta")
            try:
                meta = json.loads(str(raw[()] if raw.ndim == 0 else raw))
            except (ValueError, TypeError, RecursionError) as ex:
                raise _err(name, "meta", f"invalid JSON ({_one_line(ex)})",
                           "a 0-d str holding a JSON object") from None
        get = (lambda k: _read_array(z, name, k) if k in files else None)
        t = Trace(experts=get("experts"), is_prompt=get("is_prompt"), weights=get("weights"),
                  predicted=get("predicted"), step=get("step"), meta=meta, scores=get("scores"),
                  candidates=get("candidates"), candidate_scores=get("candidate_scores"))
    _validate(t, name)
    t.experts = t.experts.astype(np.int16, copy=False)
    if t.predicted is not None:
        t.predicted = t.predicted.astype(np.int16, copy=False)
    if t.step is not None:
        t.step = t.step.astype(np.int32, copy=False)
    if t.candidates is not None:
        t.candidates = t.candidates.astype(np.int16, copy=False)
    return t


def save_trace(path, trace: Trace) -> None:
    """Validate and write ``trace`` as a compressed ``.npz``.

    ``meta`` gains/updates ``n_tokens``, ``n_prompt_tokens``, ``n_decode_tokens``,
    ``n_moe_layers``, ``top_k`` and, when absent, ``n_experts`` (inferred).
    Raises TraceError when the trace is invalid.
    """
    name = os.fspath(path)
    _validate(trace, name)
    meta = dict(trace.meta)
    meta.setdefault("n_experts", trace.n_experts)
    meta.update(n_tokens=trace.n_tokens, n_prompt_tokens=int(np.count_nonzero(trace.is_prompt)),
                n_decode_tokens=trace.n_decode, n_moe_layers=trace.n_layers, top_k=trace.top_k)
    arrays = dict(experts=trace.experts.astype(np.int16), is_prompt=trace.is_prompt.astype(bool),
                  meta=np.array(json.dumps(meta)))
    if trace.weights is not None:
        arrays["weights"] = trace.weights.astype(np.float32)
    if trace.predicted is not None:
        arrays["predicted"] = trace.predicted.astype(np.int16)
    if trace.step is not None:
        arrays["step"] = trace.step.astype(np.int32)
    for key in ("scores", "candidate_scores"):
        if getattr(trace, key) is not None:
            arrays[key] = getattr(trace, key).astype(np.float32)
    if trace.candidates is not None:
        arrays["candidates"] = trace.candidates.astype(np.int16)
    d = os.path.dirname(os.path.abspath(name))
    os.makedirs(d, exist_ok=True)
    tmp = name + ".tmp.npz"
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, name)


# ----------------------------------------------------------------------------- JSONL form

def _build(tokens, n_layers, top_k, n_experts, meta, name="<jsonl>") -> Trace:
    """tokens: list of dicts {prompt, step, layers: {l: (experts, weights|None, predicted|None)}}."""
    T = len(tokens)
    L = n_layers if n_layers is not None else 1 + max(
        (l for t in tokens for l in t["layers"]), default=0)
    k = max([top_k or 0] + [len(v[0]) for t in tokens for v in t["layers"].values()]) or 1
    kp = max([0] + [len(v[2]) for t in tokens for v in t["layers"].values() if v[2] is not None])
    has_w = any(v[1] is not None for t in tokens for v in t["layers"].values())
    has_s = any(t.get("step") is not None for t in tokens)
    experts = np.full((T, L, k), -1, np.int16)
    weights = np.zeros((T, L, k), np.float32) if has_w else None
    predicted = np.full((T, L, kp), -1, np.int16) if kp else None
    ok_ne = isinstance(n_experts, (int, np.integer)) and not isinstance(n_experts, bool) and n_experts >= 1
    hi = min(32767, int(n_experts) - 1) if ok_ne else 32767  # a bad n_experts: _validate says so
    for i, t in enumerate(tokens):
        for l, entry in t["layers"].items():
            ex, w, pr = entry[:3]
            # where the entry came from: "file:line" for JSONL, else the token index
            src = entry[3] if len(entry) > 3 else f"{name}: token {i}"
            if not 0 <= l < L:
                raise _err(src, "layer", l, f"0..{L - 1} (the trace has {L} MoE layers)")
            for field_, row in (("experts", ex), ("predicted", pr or ())):
                for x in row:
                    if not -1 <= x <= hi:
                        raise _err(src, f"{field_} of layer {l}", x,
                                   f"an expert id 0..{hi}" + (f" (n_experts = {n_experts})" if ok_ne
                                                              else " (ids are int16)"))
            experts[i, l, :len(ex)] = ex
            if w is not None:
                if not isinstance(w, list) or len(w) != len(ex):
                    raise _err(src, f"weights of layer {l}",
                               f"{len(w)} values" if isinstance(w, list) else type(w).__name__,
                               f"{len(ex)} numbers (one per expert)")
                try:
                    weights[i, l, :len(w)] = w
                except (TypeError, ValueError):
                    raise _err(src, f"weights of layer {l}", repr(w)[:60], "a list of numbers") from None
            if pr is not None and len(pr):
                predicted[i, l, :len(pr)] = pr
    step = None
    if has_s:
        step = np.array([t["step"] if t.get("step") is not None else -1 for t in tokens], np.int32)
        if (step < 0).any():
            raise _err(name, "step", "missing on some tokens", "a step id on every token or none")
    meta = dict(meta)
    if n_experts is not None:
        meta["n_experts"] = int(n_experts)
    tr = Trace(experts=experts, is_prompt=np.array([bool(t["prompt"]) for t in tokens], bool),
               weights=weights, predicted=predicted, step=step, meta=meta)
    _validate(tr, name)
    return tr


def convert_jsonl(in_path, n_experts=None, n_layers=None, top_k=None, meta=None) -> Trace:
    """Read the JSONL form (see docs/trace-format.md) into a validated Trace.

    Lines (blank lines and lines starting with ``#`` are skipped):
      * ``{"meta": {...}}`` -- optional, merged into meta (``n_experts`` etc.).
      * token form: ``{"experts": [[ids of layer 0], [ids of layer 1], ...], "prompt": bool,
        "weights": [[...]...]?, "predicted": [[...]...]?, "step": int?}``.
      * layer form: ``{"layer": l, "experts": [ids], "prompt": bool, "token": int?,
        "weights": [...]?, "predicted": [...]?, "step": int?}``; without ``token``, a new
        token starts whenever ``layer`` does not increase (the way engines log forward passes).
    Args override meta: n_experts, n_layers (MoE layers), top_k (minimum row width).
    Raises:
        TraceError: unreadable line (names file:line), bad field, ids out of range.
    """
    name = os.fspath(in_path)
    meta = dict(meta or {})
    tokens = []
    by_index = {}
    last_layer = None
    try:
        fh = open(name, encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(f"{name}: file not found, expected a JSONL trace") from None
    with fh:
        for lineno, line in enumerate(fh, 1):
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            where = f"{name}:{lineno}"
            try:
                rec = json.loads(s)
            except json.JSONDecodeError as ex:
                raise TraceError(f"{where}: invalid JSON ({ex.msg}), expected one object per line")
            if not isinstance(rec, dict):
                raise _err(where, "line", type(rec).__name__, "a JSON object")
            if "meta" in rec and "experts" not in rec:
                if not isinstance(rec["meta"], dict):
                    raise _err(where, "meta", type(rec["meta"]).__name__, "a JSON object")
                meta.update(rec["meta"])
                continue
            if "experts" not in rec:
                raise _err(where, "experts", "absent", "an 'experts' field (or a 'meta' line)")
            prompt = rec.get("prompt", rec.get("is_prompt"))
            if not isinstance(prompt, bool):
                raise _err(where, "prompt", repr(prompt), "true or false")
            step = rec.get("step")
            if step is not None and not isinstance(step, int):
                raise _err(where, "step", repr(step), "an int")
            ex = rec["experts"]

            def ids(v, field_):
                if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                      for x in v):
                    raise _err(where, field_, repr(v)[:60], "a list of ints")
                return v

            if "layer" in rec:
                l = rec["layer"]
                if not isinstance(l, int) or l < 0:
                    raise _err(where, "layer", repr(l), "an int >= 0")
                entry = (ids(ex, "experts"), rec.get("weights"),
                         ids(rec["predicted"], "predicted") if "predicted" in rec else None, where)
                if "token" in rec:
                    ti = rec["token"]
                    if ti not in by_index:
                        by_index[ti] = {"prompt": prompt, "step": step, "layers": {}}
                        tokens.append(by_index[ti])
                    tok = by_index[ti]
                else:
                    if last_layer is None or l <= last_layer:
                        tokens.append({"prompt": prompt, "step": step, "layers": {}})
                    tok = tokens[-1]
                    last_layer = l
                if l in tok["layers"]:
                    raise _err(where, "layer", l, "each layer once per token")
                tok["layers"][l] = entry
            else:
                if not isinstance(ex, list):
                    raise _err(where, "experts", type(ex).__name__, "a list (one list per layer)")
                w = rec.get("weights")
                pr = rec.get("predicted")
                for field_, v in (("weights", w), ("predicted", pr)):
                    if v is not None and (not isinstance(v, list) or len(v) != len(ex)):
                        raise _err(where, field_, f"{len(v)} rows" if isinstance(v, list) else type(v).__name__,
                                   f"{len(ex)} rows (one per layer, as 'experts')")
                layers = {}
                for l, row in enumerate(ex):
                    layers[l] = (ids(row, f"experts[{l}]"), None if w is None else w[l],
                                 None if pr is None else ids(pr[l], f"predicted[{l}]"), where)
                tokens.append({"prompt": prompt, "step": step, "layers": layers})
    n_experts = n_experts if n_experts is not None else meta.get("n_experts")
    n_layers = n_layers if n_layers is not None else meta.get("n_moe_layers")
    top_k = top_k if top_k is not None else meta.get("top_k")
    meta.pop("n_moe_layers", None)
    meta.pop("top_k", None)
    meta.pop("n_tokens", None)
    meta.setdefault("source_path", os.path.basename(name))
    return _build(tokens, n_layers, top_k, n_experts, meta, name)


# ----------------------------------------------------------------------------- recorder

class TraceRecorder:
    """Collects the daemon's acquires into a trace; thread-safe.

    Usage::

        rec = TraceRecorder("/tmp/run.npz", n_layers=48, top_k=8, n_experts=128, client=None)
        rec.record(layer_idx, [3, 17, ...], is_prompt=False, client="llama")  # per acquire
        rec.record(layer_idx, [3, 17], False, "llama", scores=[0.6, 0.3],
                   candidates=[(5, 0.2), (9, 0.1)])          # with substitution candidates
        rec.close()                                                           # writes the file

    Args:
        path: output ``.npz``.
        n_layers: MoE layers of the model (trace layer = MoE-layer index).
        top_k: row width; an acquire of more experts (e.g. a batched prefill) widens every row
            (padded with -1).
        n_experts: experts per layer (ids must be below it).
        client: record only this client's acquires (None = every client).
    Tokens: each client has its own current token; it ends when that client's layer index does
    not increase (wraps to a lower or the same layer). Tokens are written in the order they end
    (pending ones at ``close``). A token's prompt tag is that of its first acquire.
    ``scores`` / ``candidates`` (an acquire's substitution offer, docs/protocol.md) become the
    trace's ``scores``, ``candidates`` and ``candidate_scores`` arrays once any acquire carried
    them; other rows get ``-1`` candidates and ``0`` scores.
    With more than one client, ``meta['clients']`` lists names and ``meta['token_client']`` the
    index of each token's client.
    """

    def __init__(self, path, n_layers: int, top_k: int, n_experts: int, client=None, meta=None):
        if n_layers < 1 or top_k < 1 or n_experts < 1:
            raise TraceError(f"TraceRecorder: n_layers/top_k/n_experts: found "
                             f"{n_layers}/{top_k}/{n_experts}, expected all >= 1")
        self.path = os.fspath(path)
        self.n_layers, self.top_k, self.n_experts = int(n_layers), int(top_k), int(n_experts)
        self.client = client
        self.meta = dict(meta or {})
        self._lock = threading.Lock()
        self._tokens = []       # (client_idx, is_prompt, {layer: tuple(experts)})
        self._cur = {}          # client -> [is_prompt, last_layer, {layer: experts}]
        self._clients = {}
        self._closed = False
        self.width = self.top_k
        self.cand_width = 0     # widest candidate list seen
        self.has_scores = False

    def record(self, layer_idx: int, experts, is_prompt: bool, client=None, scores=None,
               candidates=None) -> None:
        """Append one acquire: MoE-layer ``layer_idx``, expert ids (sequence of ints);
        optionally ``scores`` (one per expert) and ``candidates`` (``(expert, score)`` pairs).

        Raises TraceError on a layer, id or score out of range, or after ``close()``.
        """
        if self.client is not None and client != self.client:
            return
        l = int(layer_idx)
        if not 0 <= l < self.n_layers:
            raise TraceError(f"TraceRecorder.record: layer_idx: found {l}, expected "
                             f"0..{self.n_layers - 1}")
        ex = tuple(int(e) for e in experts)
        for e in ex:
            if not 0 <= e < self.n_experts:
                raise TraceError(f"TraceRecorder.record: expert: found {e}, expected "
                                 f"0..{self.n_experts - 1}")
        sc = None if scores is None else tuple(float(v) for v in scores)
        if sc is not None and len(sc) != len(ex):
            raise TraceError(f"TraceRecorder.record: scores: found {len(sc)}, expected "
                             f"{len(ex)} (one per expert)")
        cands = () if candidates is None else tuple((int(e), float(v)) for e, v in candidates)
        for e, _ in cands:
            if not 0 <= e < self.n_experts:
                raise TraceError(f"TraceRecorder.record: candidate: found {e}, expected "
                                 f"0..{self.n_experts - 1}")
        if cands and sc is None:
            raise TraceError("TraceRecorder.record: scores: found none, expected one per "
                             "expert beside candidates")
        with self._lock:
            if self._closed:
                raise TraceError(f"TraceRecorder.record: {self.path}: recorder closed, expected "
                                 "record() before close()")
            cur = self._cur.get(client)
            if cur is not None and l <= cur[1]:
                self._finish(client)
                cur = None
            if cur is None:
                cur = self._cur[client] = [bool(is_prompt), -1, {}]
            cur[1] = l
            cur[2][l] = ex if sc is None else (ex, sc, cands)
            self.width = max(self.width, len(ex))
            self.cand_width = max(self.cand_width, len(cands))
            self.has_scores = self.has_scores or sc is not None

    def _finish(self, client):
        cur = self._cur.pop(client)
        ci = self._clients.setdefault(client, len(self._clients))
        self._tokens.append((ci, cur[0], cur[2]))

    @property
    def n_tokens(self) -> int:
        """Tokens finished so far (pending per-client tokens not counted)."""
        return len(self._tokens)

    def to_trace(self) -> Trace:
        """The trace recorded so far, pending tokens included (does not close)."""
        with self._lock:
            toks = list(self._tokens)
            for c, cur in self._cur.items():
                ci = self._clients.get(c, len(self._clients))
                toks.append((ci, cur[0], cur[2]))
            clients = dict(self._clients)
            for c in self._cur:
                clients.setdefault(c, len(clients))
        T = len(toks)
        experts = np.full((T, self.n_layers, self.width), -1, np.int16)
        scores = cands = cscores = None
        if self.has_scores:
            scores = np.zeros(experts.shape, np.float32)
        if self.cand_width:
            cands = np.full((T, self.n_layers, self.cand_width), -1, np.int16)
            cscores = np.zeros(cands.shape, np.float32)
        for i, (_, _, layers) in enumerate(toks):
            for l, ex in layers.items():
                if len(ex) == 3 and isinstance(ex[0], tuple):   # (experts, scores, candidates)
                    ex, sc, cl = ex
                    scores[i, l, :len(sc)] = sc
                    if cl:
                        cands[i, l, :len(cl)] = [e for e, _ in cl]
                        cscores[i, l, :len(cl)] = [v for _, v in cl]
                experts[i, l, :len(ex)] = ex
        meta = dict(self.meta, n_experts=self.n_experts, recorded_by="moecached",
                    prompt_marking="client tag")
        names = sorted(clients, key=clients.get)
        meta["clients"] = [None if c is None else str(c) for c in names]
        if len(names) > 1:
            meta["token_client"] = [t[0] for t in toks]
        return Trace(experts=experts, is_prompt=np.array([t[1] for t in toks], bool), meta=meta,
                     scores=scores, candidates=cands, candidate_scores=cscores)

    def save(self) -> Trace:
        """Write everything recorded so far to ``path``; returns the written Trace."""
        t = self.to_trace()
        save_trace(self.path, t)
        return t

    def close(self) -> Trace:
        """Write the file and stop recording (later ``record`` raises). Returns the Trace."""
        t = self.save()
        with self._lock:
            self._closed = True
        return t
