"""Daemons for tests, the two ways tests run one:

- :class:`Daemon`: in-process (an ``ExpertCache`` and a ``Server`` whose loop runs in a thread),
  for tests that look inside the cache or the server;
- :func:`start_daemon` / :func:`stop_daemon`: a real ``moecached`` process (own ipc socket),
  for tests of the daemon as operators run it.

Both honour ``MOECACHED_HOT_PATH`` (the ``hot_path`` fixture of tests/conftest.py sets it).
"""
from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import threading
import time


class Daemon:
    """An in-process daemon: ``ExpertCache`` on the model at ``path`` served by a ``Server`` on
    ``ipc://TMP/SOCK``, its loop in a thread. Keyword arguments go to whichever of the two takes
    them (ExpertCache: ``slots`` (16), ``readers`` (4), ``chunk_bytes``,
    ``max_prefetch_loads``...; Server: ``heartbeat_s``, ``max_message_bytes``...); memory is not
    locked. ``fast``: ``Server.fast_path`` (None: the Server's default, from
    ``MOECACHED_HOT_PATH``). Attributes: ``idx``, ``cache``, ``server``, ``endpoint``, ``t``
    (the loop's thread). ``stop()`` (or leaving a ``with`` block) stops the loop and closes the
    cache."""

    def __init__(self, path, tmp, *, sock: str = "d.sock", fast: bool | None = None, **kw):
        from moecached.cache import ExpertCache
        from moecached.index import open_index
        from moecached.server import Server
        cache_keys = set(inspect.signature(ExpertCache).parameters)
        cache_kw = {"slots": 16, "readers": 4, "lock_memory": False}
        cache_kw.update({k: kw.pop(k) for k in list(kw) if k in cache_keys})
        self.idx = open_index(str(path))
        self.cache = ExpertCache(self.idx, **cache_kw)
        self.endpoint = f"ipc://{tmp}/{sock}"
        try:
            self.server = Server(self.cache, endpoint=self.endpoint, model_path=str(path), **kw)
        except BaseException:
            self.cache.close()
            raise
        if fast is not None:
            self.server.fast_path = fast
        self.t = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.t.start()

    def stop(self) -> None:
        self.server.stop()
        self.t.join(10)
        self.cache.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


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
