"""What the llama.cpp engine tests on the trained model share: its files, the patched build
(the tests skip with one line without it), the prompt, and mc-decode runs, alone or through a
fresh daemon."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from daemon_util import start_daemon, stop_daemon
from moecache_client import Client
from moecached.tools import engine_llama

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "benchmarks" / "models" / "qwen3moe-stdlib-8x32-q8_0.gguf"   # 8 blocks x 32 experts, top-4
HELDOUT = ROOT / "benchmarks" / "models" / "qwen3moe-stdlib-heldout.txt"
BIN = engine_llama.llama_bin()
NEEDS_BUILD = [pytest.mark.skipif(BIN is None, reason="patched llama.cpp not built: run clients/llama.cpp/build.sh "
                                                      "(or set MOECACHED_LLAMA_BIN to its bin directory)"),
               pytest.mark.timeout(900)]


def prompt() -> str:
    return HELDOUT.read_text(encoding="utf-8", errors="replace")[:300]


class Runner:
    """mc-decode of ``steps`` greedy steps on :func:`prompt` (or ``text``), from ``bin_dir``
    (default: the CPU build, :data:`BIN`)."""

    def __init__(self, steps: int, bin_dir=None):
        self.steps = steps
        self.bin_dir = bin_dir or BIN

    def decode(self, model, dump, *extra, endpoint=None, text=None, check=True):
        r = engine_llama.decode(self.bin_dir, str(model), str(dump), prompt=text or prompt(), steps=self.steps,
                                endpoint=endpoint, extra=extra, timeout=300)
        if check:
            assert r.returncode == 0, f"mc-decode failed ({r.returncode}): {r.stderr[-2000:]}"
        return r

    def served(self, model, tmp_path, name, slots, *extra, text=None):
        """mc-decode through a fresh daemon of `slots` slots: (the run, the daemon's stats)."""
        sock = str(tmp_path / f"{name}.sock")
        p = start_daemon(str(model), sock, "--slots", str(slots))
        try:
            r = self.decode(model, tmp_path / f"{name}.bin", *extra, endpoint=f"ipc://{sock}", text=text)
            with Client(f"ipc://{sock}", name="test", map_arena=False) as c:
                st = c.stats()
        finally:
            stop_daemon(p)
        return r, st


def across_restart(cmd, under_way, restart, *, env=None, timeout=600) -> tuple:
    """Run the engine ``cmd``; once ``under_way()`` returns (it waits until the engine is at work
    and asserts so), ``restart()`` stops the daemon and returns the one started after it (or
    None). ``(returncode, stdout, stderr)`` of the engine; the engine (if still running) and that
    daemon are stopped at the end."""
    eng = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    p2 = None
    try:
        under_way(eng)
        p2 = restart()
        out, err = eng.communicate(timeout=timeout)
    finally:
        if eng.poll() is None:
            eng.kill()
        if p2:
            stop_daemon(p2)
    return eng.returncode, out, err
