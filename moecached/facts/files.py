"""What is wrong with a path that should be a readable, non-empty regular file.

Shared by every reader of user-given files (models, traces) so they refuse a directory, a
device, a FIFO or an empty file with the same words, before a library tries to map it.
"""
from __future__ import annotations

import os
import stat

NOT_FOUND = "file not found"

_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def file_problem(path: str) -> tuple[str | None, os.stat_result | None]:
    """``(problem, stat)``: ``problem`` is None for a non-empty regular file, else a short
    phrase (``NOT_FOUND``, ``"is a directory"``, ``"not a regular file (a FIFO)"``,
    ``"empty file (0 bytes)"``, ``"cannot read (Permission denied)"``) that callers put
    between the path and what they expected."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return NOT_FOUND, None
    except OSError as e:
        return f"cannot read ({e.strerror or e})", None
    if stat.S_ISDIR(st.st_mode):
        return "is a directory", st
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for f, k in _KINDS if f(st.st_mode)), "a special file")
        return f"not a regular file ({kind})", st
    if st.st_size == 0:
        return "empty file (0 bytes)", st
    return None, st


def read_head(path: str, n: int, error, expected: str, not_found: str) -> tuple[bytes, os.stat_result]:
    """``(first n bytes, stat)`` of ``path`` after :func:`file_problem` found nothing wrong.

    Raises ``error`` (an exception class taking one message) with one line:
    ``"{path}: {not_found}"`` for a missing path, ``"{path}: {problem}, {expected}"`` for
    anything else wrong (directory, device, empty, unreadable).
    """
    problem, st = file_problem(path)
    if problem == NOT_FOUND:
        raise error(f"{path}: {not_found}")
    if problem:
        raise error(f"{path}: {problem}, {expected}")
    try:
        with open(path, "rb") as f:
            return f.read(n), st
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e}), {expected}") from None
