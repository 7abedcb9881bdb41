"""The other end of ``NOTIFY_SOCKET`` for tests: binds a datagram socket and collects what
the daemon sends (moecached/daemon/notify.py is the sending side)."""
from __future__ import annotations

import os
import socket
import tempfile
import time
from typing import Optional


class NotifyReceiver:
    """A ``NOTIFY_SOCKET`` for tests: binds a datagram socket and collects what is sent.

    ``with NotifyReceiver() as r: env["NOTIFY_SOCKET"] = r.address; ...; r.wait_for("READY=1")``.
    ``abstract=True`` binds in the abstract namespace (address ``@...``).
    """

    def __init__(self, abstract: bool = False):
        self.messages: list[str] = []
        self._dir = None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        if abstract:
            name = f"moecached-notify-test-{os.getpid()}-{id(self)}"
            self.sock.bind("\0" + name)
            self.address = "@" + name
        else:
            self._dir = tempfile.mkdtemp(prefix="moecached-notify-")
            self.address = os.path.join(self._dir, "notify.sock")
            self.sock.bind(self.address)

    def recv(self, timeout: float = 5.0) -> Optional[str]:
        """Next message, or None after ``timeout`` seconds."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except (socket.timeout, BlockingIOError):
            return None
        msg = data.decode("utf-8", "replace")
        self.messages.append(msg)
        return msg

    def wait_for(self, line: str, timeout: float = 10.0, since: int = 0) -> str:
        """Receive until a message has ``line`` as one of its lines; return that message
        (``since``: only messages from that index of :attr:`messages` on count).
        Raises TimeoutError naming what was received instead."""
        deadline = time.monotonic() + timeout
        for m in self.messages[since:]:
            if line in m.split("\n"):
                return m
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {line!r} within {timeout:g}s; got {self.messages!r}")
            m = self.recv(left)
            if m is not None and line in m.split("\n"):
                return m

    def close(self) -> None:
        self.sock.close()
        if self._dir:
            try:
                os.unlink(self.address)
            except OSError:
                pass
            os.rmdir(self._dir)
            self._dir = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
