"""What the host gives the arena: whether the tmpfs it lies on backs it with huge pages, and
how much memory this process may still lock (the arena checks both before it reserves)."""
from __future__ import annotations

import os
import resource

CAP_IPC_LOCK = 14


def tmpfs_huge(dir: str) -> str | None:
    """The ``huge=`` option of the tmpfs ``dir`` is on (``never``, ``always``, ``within_size``,
    ``advise``; tmpfs without the option: ``never``), from ``/proc/self/mountinfo``; None when
    ``dir`` is not on a tmpfs (or the table cannot be read)."""
    path = os.path.realpath(dir)
    best, opts = -1, None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rf = left.split(), right.split()
                if len(fields) < 5 or len(rf) < 3:
                    continue
                mp = fields[4].replace("\\040", " ")
                if (path == mp or path.startswith(mp.rstrip("/") + "/")) and len(mp) > best:
                    best, opts = len(mp), (rf[0], rf[2])
    except OSError:
        return None
    if opts is None or opts[0] != "tmpfs":
        return None
    for o in opts[1].split(","):
        if o.startswith("huge="):
            return o[5:]
    return "never"


def _has_cap_ipc_lock() -> bool:
    """True if this process may lock memory past RLIMIT_MEMLOCK (effective CAP_IPC_LOCK)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except OSError:
        pass
    return False


def memlock_room() -> int | None:
    """Bytes this process may still mlock: RLIMIT_MEMLOCK minus what it has locked, or None
    when there is no limit (RLIM_INFINITY, or CAP_IPC_LOCK, which makes the kernel ignore it)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or _has_cap_ipc_lock():
        return None
    return soft - _memlock_locked_now()


def _memlock_locked_now() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmLck:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
