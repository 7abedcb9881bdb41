"""Daemons for tests, the two ways tests run one:

- :class:`Daemon`: in-process (an ``ExpertCache`` and a ``Server`` whose loop runs in a thread),
  for tests that look inside the cache or the server;
- :func:`start_daemon` / :func:`stop_daemon`: a real ``moecached`` process (own ipc socket),
  for tests of the daemon as operators run it (``moecached.tools.daemonproc``, which the
  benchmarks use too; its output is a pipe that ``stop_daemon`` returns).

Both honour ``MOECACHED_HOT_PATH`` (the ``hot_path`` fixture of tests/conftest.py sets it).
"""
from __future__ import annotations

import inspect
import threading
import time

from moecached.tools.daemonproc import start_daemon, stop_daemon

__all__ = ["Daemon", "start_daemon", "stop_daemon", "wait_for"]


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


def wait_for(cond, what: str, timeout: float = 30.0):
    """Poll ``cond()`` every 20 ms until it is truthy and return its value; AssertionError
    naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
