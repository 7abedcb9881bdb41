"""Byte sizes: parse what people type (``8GiB``, ``512M``, ``1.5G``) and print them back.

Units (case-insensitive, optional space between number and unit):

* ``B`` or no unit: bytes.
* ``K``, ``M``, ``G``, ``T``, ``P`` and ``KiB``, ``MiB``, ``GiB``, ``TiB``, ``PiB``: binary,
  powers of 1024 (as in systemd, docker and ``sort -S``).
* ``KB``, ``MB``, ``GB``, ``TB``, ``PB`` (and ``kB``): decimal, powers of 1000.

A fractional number is allowed with a unit (``1.5G``) and the result is rounded down to a whole
byte; a plain byte count must be a whole number. Errors are :class:`SizeError` (a
:class:`moecached.MoecacheError` and a :class:`ValueError`) with one line saying what was
given and what is expected.
"""
from __future__ import annotations

import math
import re

from moecached import MoecacheError

__all__ = ["SizeError", "parse_size", "format_bytes", "SIZE_EXPECTED"]

#: The phrase every size error ends with; config errors reuse it.
SIZE_EXPECTED = ("a size such as 8GiB, 512M, 1.5G or a byte count "
                 "(units B, K/KiB, M/MiB, G/GiB, T/TiB binary; KB, MB, GB, TB decimal)")

_BINARY = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_DECIMAL = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12, "p": 10 ** 15}

_SIZE_RE = re.compile(r"^\s*(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>[a-z]*)\s*$",
                      re.IGNORECASE)


class SizeError(MoecacheError, ValueError):
    """A size that cannot be parsed, or is out of range; ``str(e)`` is one line."""


def _unit_factor(unit: str):
    u = unit.lower()
    if u in ("", "b"):
        return 1
    if u.endswith("ib") and len(u) == 3 and u[0] in _BINARY:
        return _BINARY[u[0]]
    if u.endswith("b") and len(u) == 2 and u[0] in _DECIMAL:
        return _DECIMAL[u[0]]
    if len(u) == 1 and u in _BINARY:
        return _BINARY[u]
    return None


def parse_size(value, *, what: str = "size", allow_zero: bool = True) -> int:
    """Return ``value`` as a whole number of bytes.

    ``value`` is an ``int`` (bytes), a ``float`` holding a whole number, or a string such as
    ``"8GiB"``, ``"512M"``, ``"1.5G"``, ``"4096"``. ``what`` names the quantity in errors.

    Raises :class:`SizeError` for anything else: booleans, negative numbers, unknown units,
    fractional byte counts, zero when ``allow_zero`` is false.
    """
    if isinstance(value, bool):
        raise SizeError(f"invalid {what} {value!r}: expected {SIZE_EXPECTED}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise SizeError(f"invalid {what} {value!r}: expected {SIZE_EXPECTED}")
        n = int(value)
    elif isinstance(value, str):
        if value.strip().startswith("-"):
            raise SizeError(f"invalid {what} {value!r}: a size cannot be negative")
        m = _SIZE_RE.match(value)
        factor = _unit_factor(m.group("unit")) if m else None
        if m is None or factor is None:
            raise SizeError(f"invalid {what} {value!r}: expected {SIZE_EXPECTED}")
        num = m.group("num")
        if "." in num:
            if factor == 1:
                raise SizeError(f"invalid {what} {value!r}: a byte count must be a whole number")
            # exact decimal arithmetic: "1.5" * 2**30 without float rounding
            whole, _, frac = num.partition(".")
            scale = 10 ** len(frac)
            n = (int(whole or "0") * scale + int(frac or "0")) * factor // scale
        else:
            n = int(num) * factor
    else:
        raise SizeError(f"invalid {what} {value!r}: expected {SIZE_EXPECTED}")
    if n < 0:
        raise SizeError(f"invalid {what} {value!r}: a size cannot be negative")
    if n == 0 and not allow_zero:
        raise SizeError(f"invalid {what} {value!r}: must be more than 0 bytes")
    return n


def format_bytes(n: int | float, *, precision: int = 1) -> str:
    """Human-readable binary size: ``format_bytes(8 << 30) == "8.0 GiB"``, ``"512 B"``.

    Negative values (deltas) keep their sign. Picks the largest unit whose value is >= 1.
    """
    sign = "-" if n < 0 else ""
    v = abs(n)
    if v < 1024:
        return f"{sign}{int(v)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        v /= 1024.0
        if v < 1024 or unit == "PiB":
            return f"{sign}{v:.{precision}f} {unit}"
    raise AssertionError("unreachable")
