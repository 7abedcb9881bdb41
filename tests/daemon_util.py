"""Daemons for tests, the two ways tests run one:

- :class:`Daemon`: in-process (an ``ExpertCache`` and a ``Server`` whose loop runs in a thread),
  for tests that look inside the cache or the server;
- :func:`start_daemon` / :func:`stop_daemon`: a real ``moecached`` process (own ipc socket),
  for tests of the daemon as operators run it (``moecached.tools.daemonproc``, which the
  benchmarks use too; its output is a pipe that ``stop_daemon`` returns).

Memory pressure for real (the memory floor, ``moecache-ctl guard``): :data:`HOG` is a process
that touches memory until it holds what it was asked for; :func:`memory_hog` holds it while a
``with`` block runs.

Both honour ``MOECACHED_HOT_PATH`` (the ``hot_path`` fixture of tests/conftest.py sets it).
"""
from __future__ import annotations

import contextlib
import inspect
import subprocess
import sys
import textwrap
import threading
import time

from moecached.tools.daemonproc import start_daemon, stop_daemon

__all__ = ["Daemon", "HOG", "memory_hog", "start_daemon", "stop_daemon", "wait_for"]


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
        from moecached.engine.cache import ExpertCache
        from moecached.engine.index import open_index
        from moecached.service.server import Server
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


class Gate:
    """Stands in for readers.read_many: every read waits until ``open()``."""

    def __init__(self, real):
        self.real = real
        self.ev = threading.Event()

    def __call__(self, *a):
        assert self.ev.wait(30), "gate never opened"
        return self.real(*a)

    def open(self):
        self.ev.set()


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


#: ``python -c HOG BYTES [PIDFILE]``: touches BYTES of memory 64 MiB at a time, prints
#: ``HOG-SURVIVED`` once it holds them all, then sleeps; with PIDFILE it first starts a sleeping
#: grandchild in its process group and writes the grandchild's pid there.
HOG = textwrap.dedent("""
    import os, sys, time, subprocess
    total, step = int(sys.argv[1]), 64 << 20
    child = None
    if len(sys.argv) > 2:   # a grandchild in the same process group, to check the group is killed
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        with open(sys.argv[2], "w") as f:
            f.write(str(child.pid))
    held = []
    for _ in range(total // step):
        held.append(b"\\x01" * step)   # touches every page
        time.sleep(0.02)
    print("HOG-SURVIVED", flush=True)
    time.sleep(60)
""")


@contextlib.contextmanager
def memory_hog(nbytes: int):
    """Hold ``nbytes`` of memory (:data:`HOG`, in multiples of 64 MiB) for the ``with`` block:
    entered once every page is touched, given back (the process killed) on leaving."""
    p = subprocess.Popen([sys.executable, "-c", HOG, str(int(nbytes))], stdout=subprocess.PIPE,
                         text=True)
    try:
        line = p.stdout.readline()
        if line.strip() != "HOG-SURVIVED":
            raise AssertionError(f"memory hog of {nbytes} bytes exited {p.poll()} before holding them")
        yield p
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
