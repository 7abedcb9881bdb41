"""Start and stop a real ``moecached`` process for tests (subprocess, own ipc socket)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def start_daemon(model: str, sock: str, *args: str, env=None, wait: float = 30.0) -> subprocess.Popen:
    """Run ``python -m moecached.daemon --model MODEL --endpoint ipc://SOCK ARGS`` and wait
    until the socket answers a ping. Memory locking is off unless ARGS turn it on."""
    cmd = [sys.executable, "-P", "-m", "moecached.daemon", "--model", model, "--endpoint", f"ipc://{sock}"]
    if not any(a.startswith("--lock-memory") for a in args):
        cmd.append("--no-lock-memory")
    cmd += list(args)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    from moecache_client import Client
    deadline = time.time() + wait
    while time.time() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"daemon exited {p.returncode}: {p.stdout.read()}")
        if os.path.exists(sock):
            try:
                Client(f"ipc://{sock}", connect_timeout=2).close()
                return p
            except Exception:
                pass
        time.sleep(0.1)
    p.kill()
    raise RuntimeError("daemon did not come up: " + (p.stdout.read() if p.stdout else ""))


def stop_daemon(p: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 15.0) -> str:
    if p.poll() is None:
        p.send_signal(sig)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return p.stdout.read() if p.stdout else ""
