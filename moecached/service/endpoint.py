"""A server's socket file and who is on the other end of it.

* The endpoint's lock (:func:`lock_endpoint`, :func:`unlock_endpoint`): an exclusive ``flock``
  on ``<socket>.lock`` holding the daemon's pid, taken before anything is indexed or reserved,
  so a second daemon on a live endpoint is refused at once.
* The socket file itself (:class:`ServerSocketFile`, a part of the server): bound with its
  mode and group, bound again when some process removed it.
* A client's process on this machine (:func:`process_start_time`, a pidfd; who connected:
  ``moecached.service.identity``): a local
  client is watched through its process, not its heartbeats (``moecached.service.clients``).
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket

import zmq

from moecached import MoecacheError

log = logging.getLogger("moecached.service.server")


class ServerError(MoecacheError):
    """Start-up problems: endpoint in use, bad endpoint, socket permissions."""


def process_start_time(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22),
    or None when there is no such process here. With the pid it names one process for good:
    a pid reused later has another start time."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _pidfd_open(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError, OverflowError):   # OverflowError: no pid_t holds it
        return None


def _ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None


def lock_endpoint(endpoint: str) -> int | None:
    """Take the endpoint's lock (exclusive ``flock`` on ``<socket>.lock``, holding our pid) and
    return its fd; None for a non-ipc endpoint. The daemon takes it before it indexes or
    reserves anything, so a second daemon on a live endpoint is refused at once, having touched
    nothing; :class:`Server` takes it over (``endpoint_lock=``) and releases it in ``close()``.
    Raises :class:`ServerError` when another daemon holds it or the directory is missing."""
    ipc = _ipc_path(endpoint)
    if not ipc:
        return None
    d = os.path.dirname(ipc) or "."
    if not os.path.isdir(d):
        raise ServerError(f"endpoint {endpoint}: directory {d} does not exist "
                          "(systemd creates /run/moecached via RuntimeDirectory=; create it or pick another path)")
    fd = os.open(ipc + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        try:
            other = os.pread(fd, 32, 0).decode().strip() or "?"
        except OSError:
            other = "?"
        os.close(fd)
        raise ServerError(f"endpoint {endpoint}: another moecached (pid {other}) is serving it; "
                          "stop it first or choose another --endpoint")
    if _listening(ipc):
        # the lock is ours only because someone removed the lock file of a live daemon
        os.close(fd)
        raise ServerError(f"endpoint {endpoint}: a process is listening on {ipc} although its lock "
                          f"file {ipc}.lock was removed (another moecached?); stop it first or "
                          "choose another --endpoint")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _listening(path: str) -> bool:
    """True when something accepts connections on the unix socket ``path`` (not a stale file)."""
    if not os.path.exists(path):
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def unlock_endpoint(endpoint: str, fd: int | None) -> None:
    """Release a lock from :func:`lock_endpoint` that no Server took over (start-up failed)."""
    if fd is None:
        return
    try:
        os.unlink(_ipc_path(endpoint) + ".lock")
    except (FileNotFoundError, TypeError):
        pass
    os.close(fd)


class ServerSocketFile:
    """The ipc socket file of :class:`moecached.service.server.Server` (a part of it): bound
    under the endpoint's lock with the configured mode and group, bound again when some
    process removed it."""

    def _bind(self, mode: int, gid: int | None) -> None:
        if self._ipc:
            fd = self._endpoint_lock if self._endpoint_lock is not None else lock_endpoint(self.endpoint)
            self._endpoint_lock = None
            self._lock_fd = fd
            if os.path.exists(self._ipc):
                # We hold the lock, so whoever made this socket file is gone: a crash left it.
                log.warning("removing stale socket %s left by a previous daemon", self._ipc)
                os.unlink(self._ipc)
            self._bind_ipc(mode, gid)
        else:
            try:
                self.sock.bind(self.endpoint)
            except zmq.ZMQError as e:
                raise ServerError(f"endpoint {self.endpoint}: cannot bind: {e}")

    def _bind_ipc(self, mode: int, gid: int | None) -> None:
        old = os.umask(0o777 & ~mode)
        try:
            self.sock.bind(self.endpoint)
        finally:
            os.umask(old)
        os.chmod(self._ipc, mode)
        if gid is not None:
            os.chown(self._ipc, -1, gid)
        self._bound = (mode, gid)

    def _check_socket_file(self) -> None:
        """Bind the ipc path again when some process removed the socket file (connected
        clients keep their connections; new ones could not reach the daemon otherwise)."""
        if not self._ipc or self._bound is None or os.path.lexists(self._ipc):
            return
        log.warning("socket %s was removed by some process; bound it again (new clients could "
                    "not connect meanwhile)", self._ipc)
        self.counters["socket_rebinds"] += 1
        try:   # a second bind (no unbind: that would drop every connection accepted on it)
            self._bind_ipc(*self._bound)
        except (zmq.ZMQError, OSError) as e:
            log.error("cannot bind %s again: %s; restart the daemon", self.endpoint, e)
            self._bound = None   # said once
