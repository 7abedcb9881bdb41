"""The shared-memory hit path's session: the pin file, fetched from the daemon's door as a
sealed memfd (or opened by path) and mapped read-write, and the compiled ``Shm`` over it and
the arena's control block. The rules themselves are ``clients/c/include/moecache_shm.h``'s,
compiled into ``moecache_client._shm``."""
from __future__ import annotations

import mmap
import os

from .errors import ClientError


def fetch_pin_fd(pins: dict) -> int:
    """The pin file's fd from the daemon's door (docs/protocol.md, "Shared-memory hit path"):
    connect to the unix socket ``pins["door"]``, send the hello's one-time ``token``, receive
    the fd (``SCM_RIGHTS``) of a memfd whose size is sealed, so no process can truncate it
    under this client's mapping."""
    import socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(5.0)
        s.connect(pins["door"])
        s.sendall(str(pins["token"]).encode("ascii"))
        msg, fds, _, _ = socket.recv_fds(s, 16, 1)
    if msg != b"ok" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise OSError(f"the daemon's door refused the pin file ({msg!r})")
    return fds[0]


def fast_session(shm_mod, arena, rep: dict, want_fast: bool, endpoint: str):
    """(the session's ``shm_mod.Shm``: the arena's control block and the pin file when the
    hello reply offers one, the pin file's read-write mapping or None)."""
    pins = rep.get("pins") if want_fast else None
    pin_mm = None
    if pins is not None:
        try:
            fd = fetch_pin_fd(pins) if pins.get("door") else os.open(pins["path"], os.O_RDWR)
            try:
                pin_mm = mmap.mmap(fd, pins["size"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except (OSError, KeyError, TypeError, ValueError) as e:
            where = (pins.get("path") or pins.get("door")) if isinstance(pins, dict) else pins
            raise ClientError(f"pin file {where!r}: "
                              f"cannot map it read-write ({e}); pass fast_path=False to use the socket "
                              "only") from None
    try:
        shm = shm_mod.Shm(arena.mm, arena.desc, list(rep["expert_layers"]), int(rep["n_experts"]),
                          rep["session"], pin_mm, pins)
        limit = (rep.get("limits") or {}).get("max_request_experts")
        if limit is not None:
            shm.max_experts = int(limit)
        return shm, pin_mm
    except (ValueError, KeyError, TypeError) as e:
        raise ClientError(f"hello reply from {endpoint}: {e}") from None
