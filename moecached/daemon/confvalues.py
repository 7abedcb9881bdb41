"""What each configuration value may be: the validators of ``moecached.daemon.config.KEYS`` (value
-> parsed value, or ``_Bad(expected)`` saying what was expected), sizes and their limits, and
the model names of ``[[models]]``.
"""
from __future__ import annotations

import grp
import os
import re
from typing import Callable, Optional

from moecached.facts.units import SIZE_EXPECTED, SizeError, parse_size

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
#: Longest ipc:// path: sizeof(sockaddr_un.sun_path) - 1.
MAX_IPC_PATH = 107


# -- validators: value -> parsed value, or raise _Bad(expected) -----------------------------------

class _Bad(Exception):
    def __init__(self, expected: str):
        super().__init__(expected)
        self.expected = expected


def _int_range(lo: int, hi: int) -> Callable:
    def v(x):
        if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
            raise _Bad(f"an integer from {lo} to {hi}")
        return x
    return v


def _float_range(lo: float, hi: float, lo_open: bool = False) -> Callable:
    desc = f"a number of seconds {'>' if lo_open else '>='} {lo:g} and <= {hi:g}"

    def v(x):
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise _Bad(desc)
        x = float(x)
        if not (x > lo if lo_open else x >= lo) or not x <= hi:
            raise _Bad(desc)
        return x
    return v


def _rate(x):
    desc = "a number of requests per second from 0 (off) to 1e9"
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1e9:
        raise _Bad(desc)
    return float(x)


def _hit_rate(x):
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1e9:
        raise _Bad("a number of ring entries per second from 0 (no limit) to 1e9")
    return float(x)


def _fraction(x):
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1:
        raise _Bad("a number from 0 to 1")
    return float(x)


def _bool(x):
    if not isinstance(x, bool):
        raise _Bad("true or false")
    return x


def _admit_cold(x):
    """``admit_cold``: "off", "prompt" or a width N >= 1 (int, or its digits as a string)."""
    if isinstance(x, str) and x.strip().lower() in ("off", "prompt"):
        return x.strip().lower()
    if isinstance(x, str) and x.strip().isdigit():
        x = int(x.strip())
    if isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= 1 << 24:
        raise _Bad('"off", "prompt" or a width from 1 to 16777216 (experts of one layer in '
                   'one acquire)')
    return x


def _choice(*opts: str) -> Callable:
    desc = " or ".join(f'"{o}"' for o in opts)

    def v(x):
        if not isinstance(x, str) or x.lower() not in opts:
            raise _Bad(desc)
        return x.lower()
    return v


#: no size key takes more than this (1 EiB): larger values are typos, and stats carry sizes
#: as msgpack integers (< 2**64)
MAX_SIZE = 1 << 60


def _size(lo: int = 0, multiple: int = 1, hi: Optional[int] = None, optional_zero: bool = False) -> Callable:
    extra = []
    if lo == 1:
        extra.append("more than 0 bytes")
    elif lo > 0:
        extra.append(f"at least {_human(lo)}")
    if hi is not None:
        extra.append(f"at most {_human(hi)}")
    if multiple > 1:
        extra.append(f"a multiple of {_human(multiple)}")
    desc = SIZE_EXPECTED + (", " + ", ".join(extra) if extra else "")
    if optional_zero:
        desc += "; 0 or false turns it off"

    def v(x):
        if optional_zero and (x is False or x == 0 or x == "0"):
            return None
        try:
            n = parse_size(x)
        except SizeError:
            raise _Bad(desc) from None
        if n < lo or (hi is not None and n > hi) or n % multiple:
            raise _Bad(desc)
        if n > MAX_SIZE:
            raise _Bad(f"{desc}, at most {_human(MAX_SIZE)}")
        return n
    return v


def _human(n: int) -> str:
    for unit, f in (("EiB", MAX_SIZE), ("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= f and n % f == 0:
            return f"{n // f} {unit}"
    return f"{n} B"


def _mode(x):
    desc = 'a file mode from 0o000 to 0o777: 0o660 (a TOML octal integer) or "0660"'
    if isinstance(x, str) and re.fullmatch(r"(0o|0)?[0-7]{1,4}", x.strip()):
        s = x.strip()
        n = int(s[2:] if s.startswith("0o") else s, 8)
    elif isinstance(x, int) and not isinstance(x, bool):
        n = x
    else:
        raise _Bad(desc)
    if not 0 <= n <= 0o777:
        raise _Bad(desc)
    return n


def _abs_path(x):
    if not isinstance(x, str) or not x.startswith("/") or "\0" in x:
        raise _Bad("an absolute path")
    return os.path.normpath(x)


def _arena_dir(x):
    """An absolute path, or a list of them (the config file's form): the first usable one is taken
    (load_config resolves it: ``config.arena_dir_refusal``)."""
    if isinstance(x, list):
        if not x:
            raise _Bad("an absolute path, or a list of them")
        out = []
        for i, d in enumerate(x):
            try:
                out.append(_abs_path(d))
            except _Bad:
                raise _Bad(f"an absolute path, or a list of them (entry {i + 1}, {d!r}, is not an absolute "
                           "path)") from None
        return out
    return _abs_path(x)


def _state_dir(x):
    if not isinstance(x, str) or (x and not x.startswith("/")) or "\0" in x:
        raise _Bad('an absolute path, or "" for no warm starts')
    return os.path.normpath(x) if x else ""


def _model(x):
    if not isinstance(x, str) or not x or "\0" in x:
        raise _Bad("the path of a GGUF file")
    return x


MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")
_MODEL_FIELDS = ("name", "path", "min_budget", "max_budget", "weight")


def _models(x):
    """``[[models]]`` tables (or ``--model NAME=PATH`` flags): a list of dicts with ``name``,
    ``path`` and optional ``min_budget``/``max_budget`` (sizes) and ``weight`` (> 0)."""
    want = ("a list of tables with name (letters, digits, _ . -, at most 32), path (a GGUF "
            "file) and optional min_budget, max_budget (sizes) and weight (> 0)")
    if not isinstance(x, list):
        raise _Bad(want)
    out, seen = [], set()
    for i, t in enumerate(x):
        if not isinstance(t, dict):
            raise _Bad(want)
        extra = [k for k in t if k not in _MODEL_FIELDS]
        if extra:
            raise _Bad(f"{want}; models[{i}] has unknown field {extra[0]!r}")
        name, path = t.get("name"), t.get("path")
        if not isinstance(name, str) or not MODEL_NAME.fullmatch(name):
            raise _Bad(f"{want}; models[{i}].name = {name!r} is not such a name")
        if name in seen:
            raise _Bad(f"{want}; model name {name!r} appears twice")
        seen.add(name)
        if not isinstance(path, str) or not path or "\0" in path:
            raise _Bad(f"{want}; models[{i}].path is missing")
        m = {"name": name, "path": path, "min_budget": None, "max_budget": None, "weight": 1.0}
        for k in ("min_budget", "max_budget"):
            if t.get(k) is not None:
                try:
                    m[k] = _size(lo=1)(t[k])
                except _Bad as e:
                    raise _Bad(f"models[{i}].{k} = {t[k]!r}: {e.expected}") from None
        w = t.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w <= 1e6:
            raise _Bad(f"{want}; models[{i}].weight = {w!r} is not a number > 0")
        m["weight"] = float(w)
        if m["min_budget"] and m["max_budget"] and m["min_budget"] > m["max_budget"]:
            raise _Bad(f"models[{i}] ({name}): min_budget above max_budget; lower min_budget")
        out.append(m)
    return out


def _hysteresis(x):
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 100:
        raise _Bad("a number from 0 to 100 (0.25: a move must gain 25 % more than it loses)")
    return float(x)


def _endpoint(x):
    desc = (f"ipc:///absolute/path (at most {MAX_IPC_PATH} bytes) or tcp://HOST:PORT")
    if not isinstance(x, str):
        raise _Bad(desc)
    if x.startswith("ipc://"):
        p = x[len("ipc://"):]
        if not p.startswith("/") or len(p.encode()) > MAX_IPC_PATH or "\0" in p:
            raise _Bad(desc)
        return x
    if re.fullmatch(r"tcp://(\*|\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):[0-9]{1,5}", x) and \
            0 < int(x.rsplit(":", 1)[1]) < 65536:
        return x
    raise _Bad(desc)


def _group(x):
    if x is None or x == "" or x is False:
        return None
    if isinstance(x, int) and not isinstance(x, bool):
        try:
            return grp.getgrgid(x).gr_name
        except KeyError:
            raise _Bad("an existing group (name or gid), or \"\" for none") from None
    if isinstance(x, str):
        try:
            grp.getgrnam(x)
            return x
        except KeyError:
            raise _Bad("an existing group (name or gid), or \"\" for none") from None
    raise _Bad("an existing group (name or gid), or \"\" for none")


def _log_level(x):
    if isinstance(x, str) and x.lower() == "warn":
        return "warning"
    return _choice("debug", "info", "warning", "error")(x)


def _dirs(x):
    """model_dirs: absolute directory paths (a TOML array of strings; on the command line one
    string, the paths separated by ``:``)."""
    desc = "absolute directory paths (a list of strings, or one string of paths separated by ':')"
    if isinstance(x, str):
        x = [p for p in x.split(":") if p]
    if not isinstance(x, (list, tuple)):
        raise _Bad(desc)
    out = []
    for p in x:
        if not isinstance(p, str) or not p.startswith("/") or "\0" in p:
            raise _Bad(desc)
        out.append(os.path.normpath(p))
    return out
