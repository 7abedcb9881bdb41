"""Pin files no one can cut short: sealed memfds, handed to their clients over a unix socket.

A fast-path client maps its pin file read-write (it writes pins and its hit ring there). A pin
file that is a path (``/dev/shm/...``, owned by the client so it can write it) can be
truncated by any process that can open it for writing -- the client's own uid, the daemon's --
and every mapping of it then faults (SIGBUS) at the next pin: a client could be killed from
outside. Write access and truncation cannot be told apart by file permissions, so the pin file
is a ``memfd`` instead: no path at all, its size fixed by ``F_SEAL_SHRINK | F_SEAL_GROW`` (and
``F_SEAL_SEAL``: no one can lift them), enforced by the kernel against every fd of it, the
daemon's included.

An fd reaches another process only by ``SCM_RIGHTS``, so each server with pin files listens on
a small unix socket beside its endpoint (the *door*, ``<socket>.pins``, the endpoint's mode and
group). The hello reply names the door and a one-time token; the client connects, sends the
token, and gets the fd of its pin file. The door hands it over only to the process the kernel
says is the one that said hello (``SO_PEERCRED``: the same pid and uid as the ZeroMQ
connection), once, within :data:`TOKEN_TTL_S`.

:func:`sealed_pin_fd` makes the memfd; :class:`PinDoor` is the door (one thread, blocking
``accept`` with a timeout; it never touches the server's state, only its own token table).
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import threading
import time

log = logging.getLogger("moecached.service.server")

#: seconds a token stays valid (the client fetches its pin file right after the hello reply)
TOKEN_TTL_S = 30.0
#: bytes of a token (sent as hex)
TOKEN_BYTES = 16
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def sealed_pin_fd(name: str, size: int, header: bytes) -> int:
    """A memfd of ``size`` bytes starting with ``header``, its size sealed for good."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        os.pwrite(fd, header, 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def door_path(ipc_path: str) -> str:
    return ipc_path + ".pins"


class PinDoor:
    """The unix socket that hands pin files to their clients.

    Args:
        path: the socket file (made with ``mode``, group ``gid``; a stale one is removed: the
            caller holds the endpoint's lock).
    """

    def __init__(self, path: str, mode: int = 0o660, gid: int | None = None):
        self.path = path
        self._lock = threading.Lock()
        self._tokens: dict[str, tuple] = {}   # token -> (fd dup, uid, pid, deadline)
        self.handed = self.refused = 0
        if os.path.lexists(path):
            os.unlink(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o777 & ~mode)
        try:
            self._sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, mode)
        if gid is not None:
            os.chown(path, -1, gid)
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self._stop = False
        self._t = threading.Thread(target=self._run, name="moecached-pin-door", daemon=True)
        self._t.start()

    def offer(self, fd: int, uid: int, pid: int) -> str:
        """A token for which the door hands a dup of ``fd`` to process ``pid`` of ``uid``."""
        token = os.urandom(TOKEN_BYTES).hex()
        now = time.monotonic()
        with self._lock:
            for t, (dfd, _, _, dl) in list(self._tokens.items()):
                if dl < now:
                    del self._tokens[t]
                    os.close(dfd)
            self._tokens[token] = (os.dup(fd), uid, pid, now + TOKEN_TTL_S)
        return token

    def _run(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                if self._stop:
                    return
                time.sleep(0.05)
                continue
            try:
                self._serve(conn)
            except Exception as e:   # one bad client must not close the door
                log.debug("pin door: %s", e)
            finally:
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(2.0)
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
        want = b""
        while len(want) < 2 * TOKEN_BYTES:
            got = conn.recv(2 * TOKEN_BYTES - len(want))
            if not got:
                break
            want += got
        token = want.decode("ascii", "replace")
        with self._lock:
            entry = self._tokens.get(token)
            ok = entry is not None and entry[1] == uid and entry[2] == pid and entry[3] >= time.monotonic()
            if ok:
                del self._tokens[token]
        if not ok:
            self.refused += 1
            conn.sendall(b"no")
            return
        fd = entry[0]
        try:
            socket.send_fds(conn, [b"ok"], [fd])
            self.handed += 1
        finally:
            os.close(fd)

    def close(self) -> None:
        self._stop = True
        self._t.join(2)
        self._sock.close()
        with self._lock:
            for dfd, *_ in self._tokens.values():
                os.close(dfd)
            self._tokens.clear()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
