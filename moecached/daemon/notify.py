"""systemd readiness and watchdog notifications (sd_notify) without libsystemd.

Sends AF_UNIX datagrams to ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract
namespace). Every function is a silent no-op returning False when ``NOTIFY_SOCKET`` is unset
(not started by systemd with ``Type=notify``) or the send fails; notifications are advisory and
must never take the daemon down.

Typical use in the daemon::

    notify.status("indexing model")
    ...                                   # index built, arena reserved and locked
    notify.ready("serving 4096 slots")    # READY=1 + STATUS=
    iv = notify.watchdog_interval()       # seconds, or None when WatchdogSec= is not set
    ... every iv seconds: notify.watchdog_ping()
    on SIGHUP: notify.reloading(); ...; notify.ready()
    on exit:   notify.stopping()

"""
from __future__ import annotations

import os
import socket
import time
from typing import Optional

__all__ = ["notify", "ready", "status", "reloading", "stopping", "watchdog_ping",
           "watchdog_interval"]


def _address(path: str) -> str:
    return "\0" + path[1:] if path.startswith("@") else path


def notify(state: str, *, unset_environment: bool = False) -> bool:
    """Send ``state`` (newline-separated ``KEY=VALUE`` lines, e.g. ``"READY=1"``) to systemd.

    Returns True if sent; False when ``NOTIFY_SOCKET`` is unset, not a unix socket address
    (e.g. ``vsock:``), or the send fails. ``unset_environment`` removes ``NOTIFY_SOCKET`` from
    the environment afterwards so children do not inherit it.
    """
    path = os.environ.get("NOTIFY_SOCKET")
    if unset_environment:
        os.environ.pop("NOTIFY_SOCKET", None)
    if not path or not (path.startswith("/") or path.startswith("@")):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(_address(path))
            s.sendall(state.encode("utf-8"))
        return True
    except OSError:
        return False


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def status(text: str) -> bool:
    """``STATUS=text`` (shown by ``systemctl status``); newlines are folded to spaces."""
    return notify(f"STATUS={_one_line(text)}")


def ready(status_text: Optional[str] = None) -> bool:
    """``READY=1`` (plus ``STATUS=``): send once the index is built and the arena locked."""
    msg = "READY=1"
    if status_text is not None:
        msg += f"\nSTATUS={_one_line(status_text)}"
    return notify(msg)


def reloading() -> bool:
    """``RELOADING=1`` with ``MONOTONIC_USEC`` (systemd >= 253 wants it); send :func:`ready` after."""
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return notify(f"RELOADING=1\nMONOTONIC_USEC={usec}")


def stopping() -> bool:
    """``STOPPING=1``: the daemon is shutting down."""
    return notify("STOPPING=1")


def watchdog_ping() -> bool:
    """``WATCHDOG=1``: keep-alive; send at least every :func:`watchdog_interval` seconds."""
    return notify("WATCHDOG=1")


def watchdog_interval() -> Optional[float]:
    """Seconds between watchdog pings: half of ``$WATCHDOG_USEC`` (as sd_watchdog_enabled
    advises), or None when the watchdog is off, ``$WATCHDOG_PID`` names another process, or
    the values are malformed."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    try:
        n = int(usec)
    except ValueError:
        return None
    if n <= 0:
        return None
    return n / 1e6 / 2
