"""The patched llama.cpp (clients/llama.cpp): where its build is, and a short checked decode.

The build (``clients/llama.cpp/build.sh``) puts its binaries in ``$MOECACHED_LLAMA_BIN``, else
``$MOECACHED_LLAMA_CACHE/bin``, else ``~/.cache/moecached-llama/bin``; :func:`llama_bin`
finds the first that holds ``mc-decode``. :func:`checked_decode` runs mc-decode on one model
resident and through a daemon and compares the logits byte for byte (the demo's engine step).
"""
from __future__ import annotations

import filecmp
import os
import re
import subprocess
from pathlib import Path

BUILD_HINT = "clients/llama.cpp/build.sh builds it (a few minutes; then set MOECACHED_LLAMA_BIN or use its default cache)"


def llama_bin() -> Path | None:
    """Directory of the patched build's binaries, or None when it is not built."""
    cands = [os.environ.get("MOECACHED_LLAMA_BIN")]
    if os.environ.get("MOECACHED_LLAMA_CACHE"):
        cands.append(os.path.join(os.environ["MOECACHED_LLAMA_CACHE"], "bin"))
    cands.append(os.path.expanduser("~/.cache/moecached-llama/bin"))
    for c in cands:
        if c and os.access(os.path.join(c, "mc-decode"), os.X_OK):
            return Path(c)
    return None


def decode(bin_dir: Path, model: str, dump: str, *, prompt: str, steps: int, threads: int = 2,
           endpoint: str | None = None, extra=(), env=None, timeout: float = 600,
           cpus=None) -> subprocess.CompletedProcess:
    """Run mc-decode (see clients/llama.cpp/README.md); the CompletedProcess, text mode. ``cpus``:
    the CPUs it may run on (``sched_setaffinity``; None: this process's)."""
    cmd = [str(bin_dir / "mc-decode"), "-m", model, "-p", prompt, "-n", str(steps), "-t", str(threads),
           "--dump", dump]
    if endpoint:
        cmd += ["--moecached", endpoint]
    cmd += list(extra)
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, timeout=timeout,
                          preexec_fn=pin)


def parse_stats(stdout: str) -> dict:
    """mc-decode's ``moecached acquires=N ...`` line as a dict ({} when served by no daemon)."""
    m = re.search(r"^moecached (acquires=.*)$", stdout, re.M)
    return {k: int(v) for k, v in (kv.split("=") for kv in m.group(1).split())} if m else {}


def parse_timing(stdout: str) -> dict:
    """mc-decode's ``timing`` line: prompt and decode tokens per second, and (from a driver that
    prints them) the decode steps' lower decile, median and upper decile in microseconds
    (``step_us_p10`` / ``_p50`` / ``_p90``)."""
    m = re.search(r"timing prompt_tokens=(\d+) prompt_s=([\d.]+) decode_tokens=(\d+) decode_s=([\d.]+)(.*)", stdout)
    if not m:
        raise ValueError("mc-decode printed no timing line")
    steps = {k: float(v) for k, v in re.findall(r"(step_us_p\d+)=([\d.]+)", m.group(5))}
    return {"prompt_tps": int(m.group(1)) / max(float(m.group(2)), 1e-9),
            "decode_tps": int(m.group(3)) / max(float(m.group(4)), 1e-9)} | steps


def checked_decode(bin_dir: Path, model: str, endpoint: str, workdir: str, *, steps: int = 16,
                   prompt: str = "moecached serves the experts.") -> dict:
    """Decode resident and through ``endpoint``; ``identical`` says whether the logits match."""
    ref, got = os.path.join(workdir, "resident.bin"), os.path.join(workdir, "served.bin")
    r0 = decode(bin_dir, model, ref, prompt=prompt, steps=steps)
    if r0.returncode != 0:
        raise RuntimeError(f"mc-decode (resident) failed: {r0.stderr.strip().splitlines()[-1:]}")
    r1 = decode(bin_dir, model, got, prompt=prompt, steps=steps, endpoint=endpoint)
    if r1.returncode != 0:
        raise RuntimeError(f"mc-decode (through the daemon) failed: {r1.stderr.strip().splitlines()[-1:]}")
    return {"steps": steps, "identical": filecmp.cmp(ref, got, shallow=False), "stats": parse_stats(r1.stdout)}
