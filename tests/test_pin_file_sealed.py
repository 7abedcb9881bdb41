"""Truncating a fast-path client's pin file cannot kill the client.

The pin file was a path under /dev/shm owned by the client's uid: any process able to open it
for writing (another of that uid, the daemon's) could truncate it, and the client died of
SIGBUS at its next pin through shared memory. Now it is a sealed memfd: every truncation is
refused by the kernel, whichever fd it goes through, and the client lives on.
"""
import errno
import os
import subprocess
import sys
import textwrap

import pytest

import moecache_client
from daemon_util import Daemon

pytestmark = pytest.mark.skipif(moecache_client.IMPLEMENTATION != "cython",
                                reason="the shared-memory hit path needs the compiled client")

VICTIM = textwrap.dedent("""
    import sys
    from moecache_client import Client
    c = Client(sys.argv[1], name="victim")
    assert c.fast_path
    L = c.expert_layers
    c.acquire(L[0], [1, 2]).release()               # resident now
    print((c.info["pins"] or {}).get("path") or "-", flush=True)
    sys.stdin.readline()                            # the pin file is being cut short meanwhile
    for _ in range(200):                            # pins and ring entries through shared memory
        c.acquire(L[0], [1, 2]).release()
    print("alive", flush=True)
""")


def _pin_fds(pid):
    """Paths under /proc that reach the pin files of process ``pid`` (fds and mappings)."""
    out = []
    for d in (f"/proc/{pid}/fd", f"/proc/{pid}/map_files"):
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in names:
            try:
                t = os.readlink(f"{d}/{n}")
            except OSError:
                continue
            if "moecached-pins-" in t:
                out.append(f"{d}/{n}")
    return out


def test_truncating_a_pin_file_cannot_kill_its_client(model_factory, tmp_path):
    with Daemon(model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=8), tmp_path) as d:
        p = subprocess.Popen([sys.executable, "-c", VICTIM, d.endpoint], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        try:
            path = p.stdout.readline().strip()
            theirs = ([path] if path != "-" else []) + _pin_fds(p.pid)
            # the daemon's own ways to the same file (this process also holds the pin files of
            # other tests' daemons and clients: only those of the victim's file count)
            ids = {(s.st_dev, s.st_ino) for s in map(os.stat, theirs)}
            routes = theirs + [r for r in _pin_fds(os.getpid()) if (os.stat(r).st_dev, os.stat(r).st_ino) in ids]
            assert routes, "no way found to the victim's pin file"
            cut = 0
            for r in routes:
                try:
                    os.truncate(r, 0)
                    cut += 1
                except PermissionError as e:
                    assert e.errno == errno.EPERM, r
            p.stdin.write("\n")
            p.stdin.flush()
            out = p.stdout.readline().strip()
            rc = p.wait(60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert rc == 0 and out == "alive", f"the client died: exit {rc} ({out!r})"
        assert cut == 0, f"{cut} of {len(routes)} truncations went through"
