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
