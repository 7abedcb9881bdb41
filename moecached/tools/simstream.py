"""The simulator's input: a routing trace flattened into the access stream its policies replay.

Owns which tokens are replayed and which count, and how they become sets (exact rules in
``docs/policies.md``, "How accesses are counted"): tokens are grouped into steps (one token
each unless the trace has ``step``); for each step and each MoE layer in order, the union of
the step's experts in that layer (first-appearance order, ``-1`` skipped) is one set, accessed
together as the daemon's cache grants one request. Prompt tokens warm the cache; only decode
tokens count. A trace without decode tokens counts every token after a warm-up prefix
(default ``min(256, T // 4)``), and the stream says so in ``note``. ``tokens=N`` cuts the trace
right after its N-th counted token (:func:`window_end`; ``moecache-ctl replay``'s window), so
the simulator can reproduce a replay or demo run.

Also :class:`SimulationError`, the one error of every simulator module.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from moecached import MoecacheError
from moecached.engine.policy import build_stream, next_use
from moecached.engine.trace import Trace, load_trace

__all__ = ["SimulationError", "Stream", "window_end", "prepare"]


class SimulationError(MoecacheError, ValueError):
    """Bad simulator input (size too small for a layer's experts, bad classes, ...)."""


@dataclass
class Stream:
    """A trace flattened into the access stream (see ``moecached.engine.policy.build_stream``).

    keys int64 [A] (key = layer * E + expert), set_start int64 [S+1], set_layer int64 [S],
    set_counted uint8 [S], set_tokens_before int64 [S] (tokens of earlier steps), set_prompt
    uint8 [S] (the set's step holds prompt tokens only),
    max_set int64 [L] (largest set per layer), counted_tokens, warmup (tokens), note.
    """
    keys: np.ndarray
    set_start: np.ndarray
    set_layer: np.ndarray
    set_counted: np.ndarray
    set_tokens_before: np.ndarray
    max_set: np.ndarray
    n_layers: int
    n_experts: int
    n_tokens: int
    counted_tokens: int
    warmup: int
    note: str
    set_prompt: Optional[np.ndarray] = None   # uint8 [S]: the set's step has only prompt tokens
    _next_use: Optional[np.ndarray] = None

    @property
    def next_use(self) -> np.ndarray:
        if self._next_use is None:
            self._next_use = next_use(self.keys, self.n_layers * self.n_experts)
        return self._next_use


def window_end(trace: Trace, warmup: int, tokens: int) -> int:
    """End (exclusive token index) of the window that holds the first ``tokens`` counted
    tokens: the index after the ``tokens``-th decode token at index >= ``warmup`` when the
    trace has decode tokens, else ``warmup + tokens``; capped at the trace's length. This is
    ``moecache-ctl replay``'s ``--tokens`` window (a step cut by it keeps its first tokens).
    Raises SimulationError when ``tokens < 1``."""
    if tokens < 1:
        raise SimulationError(f"tokens: found {tokens}, expected >= 1")
    T = trace.n_tokens
    if trace.n_decode > 0:
        dec = np.flatnonzero(~np.asarray(trace.is_prompt, bool))
        dec = dec[dec >= warmup]
        return T if tokens >= len(dec) else int(dec[tokens - 1]) + 1
    return min(T, warmup + tokens)


def prepare(trace, warmup: Optional[int] = None, tokens: Optional[int] = None) -> Stream:
    """Build the access stream of ``trace`` (a Trace or a path).

    Args:
        warmup: tokens at the start that never count. Default: 0 when the trace has decode
            tokens (prompt tokens never count anyway), else ``min(256, T // 4)`` (T of the
            whole trace, also with ``tokens``).
        tokens: when given, only the first :func:`window_end` ``(trace, warmup, tokens)``
            tokens are replayed: counting stops after ``tokens`` counted tokens (fewer when
            the trace ends first).
    Counted steps: first token index >= warmup and, when the trace has decode tokens, at least
    one decode token in the step.
    """
    t = load_trace(trace) if not isinstance(trace, Trace) else trace.validate()
    T = t.n_tokens
    has_decode = t.n_decode > 0
    if warmup is None:
        warmup = 0 if has_decode else min(256, T // 4)
    if warmup < 0:
        raise SimulationError(f"warmup: found {warmup}, expected >= 0 tokens")
    end = T if tokens is None else window_end(t, warmup, tokens)
    if end < T:
        t = t.window(0, end)
    T, L, E = t.n_tokens, t.n_layers, t.n_experts
    step_start = t.step_starts()
    starts = step_start[:-1]
    ex = np.ascontiguousarray(t.experts, dtype=np.int16)
    keys, ss, sl, st = build_stream(ex, step_start, E)
    decode = ~t.is_prompt
    step_has_decode = np.logical_or.reduceat(decode, starts) if T else np.zeros(0, bool)
    step_ok = step_start[:-1] >= warmup
    if has_decode:
        step_ok &= step_has_decode
    counted = step_ok[st].astype(np.uint8)
    tokens_before = step_start[:-1][st].astype(np.int64)
    sizes = np.diff(ss)
    max_set = np.zeros(L, np.int64)
    if len(sl):
        np.maximum.at(max_set, sl, sizes)
    ntok = np.diff(step_start)
    counted_tokens = int(ntok[step_ok].sum())
    if has_decode:
        note = "" if warmup == 0 else f"decode tokens after a warm-up prefix of {warmup} tokens"
    else:
        note = (f"no decode tokens: counting all {counted_tokens} tokens after a warm-up "
                f"prefix of {min(warmup, T)} tokens")
    set_prompt = (~step_has_decode[st]).astype(np.uint8)
    return Stream(keys=keys, set_start=ss, set_layer=sl, set_counted=counted,
                  set_tokens_before=tokens_before, max_set=max_set, n_layers=L, n_experts=E,
                  n_tokens=T, counted_tokens=counted_tokens, warmup=warmup, note=note,
                  set_prompt=set_prompt)

