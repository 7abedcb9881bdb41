"""A ``moecached`` process for tests and benchmarks: start it, wait until it serves, stop it.

``start_daemon(model, sock, *args)`` runs ``python -P -m moecached.daemon --model MODEL
--endpoint ipc://SOCK --no-lock-memory ARGS`` (memory locking off unless ARGS turn it on) and
returns once the socket answers a hello; ``stop_daemon(p)`` sends SIGTERM (SIGKILL after a
timeout) and returns what the process wrote when its output was a pipe.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def start_daemon(model, sock: str, *args: str, env: dict | None = None, wait: float = 30.0,
                 output=subprocess.PIPE) -> subprocess.Popen:
    """Start the daemon on ``model`` at ``ipc://SOCK`` and wait (``wait`` seconds at most) until
    it answers. ``env``: its environment (default: this one). ``output``: where its stdout and
    stderr go: ``subprocess.PIPE`` (read by :func:`stop_daemon`) or an open file.

    Raises:
        RuntimeError: it exited, or did not answer in time (with what it wrote, when a pipe).
    """
    from moecache_client import Client
    cmd = [sys.executable, "-P", "-m", "moecached.daemon", "--model", str(model), "--endpoint", f"ipc://{sock}"]
    if not any(a.startswith("--lock-memory") for a in args):
        cmd.append("--no-lock-memory")
    cmd += list(args)
    p = subprocess.Popen(cmd, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         env=env, text=True)

    def said() -> str:
        if p.stdout:
            return p.stdout.read()
        try:   # a file: its last lines
            with open(output.name, errors="replace") as f:
                return " | ".join(f.read().strip().splitlines()[-5:]) + f" (all in {output.name})"
        except (AttributeError, OSError):
            return "(output not kept)"
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"daemon exited {p.returncode}: {said()}")
        if os.path.exists(sock):
            try:
                Client(f"ipc://{sock}", connect_timeout=2).close()
                return p
            except Exception:
                pass
        time.sleep(0.1)
    p.kill()
    p.wait()
    raise RuntimeError(f"daemon did not come up within {wait:.0f} s: {said()}")


def stop_daemon(p: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 15.0) -> str:
    """Send ``sig`` (SIGKILL after ``timeout`` seconds); returns its output when it was a pipe."""
    if p.poll() is None:
        p.send_signal(sig)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return p.stdout.read() if p.stdout else ""
