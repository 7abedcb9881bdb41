"""What the benchmarks share: a ``moecached`` process to measure, and the JSON results file.

Benchmarks run as scripts (``python benchmarks/NAME.py``), so this directory is on
``sys.path``: ``from benchutil import start_daemon, stop_daemon, write_json``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def start_daemon(model: str, sock: str, *args: str, env: dict | None = None,
                 wait: float = 60.0) -> subprocess.Popen:
    """Run ``python -m moecached.daemon --model MODEL --endpoint ipc://SOCK`` (memory not locked,
    log level warning, then ``args``) and wait until it answers a hello. Its output goes to
    ``SOCK.log``, whose tail a daemon that exits or never answers raises with (RuntimeError).
    ``env``: the daemon's environment (e.g. another source tree on PYTHONPATH)."""
    from moecache_client import Client
    cmd = [sys.executable, "-P", "-m", "moecached.daemon", "--model", str(model), "--endpoint",
           f"ipc://{sock}", "--no-lock-memory", "--log-level", "warning", *args]
    log_path = f"{sock}.log"
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def tail() -> str:
        with open(log_path, errors="replace") as f:
            return " | ".join(f.read().strip().splitlines()[-5:]) or "(no output)"
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"daemon exited {p.returncode}: {tail()}")
        if os.path.exists(sock):
            try:
                Client(f"ipc://{sock}", connect_timeout=2).close()
                return p
            except Exception:
                pass
        time.sleep(0.1)
    stop_daemon(p)
    raise RuntimeError(f"daemon did not come up within {wait:.0f} s: {tail()}")


def stop_daemon(p: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def write_json(path: str, results: dict) -> None:
    """Write ``results`` to ``path`` (directories made as needed) and say so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {path}")
