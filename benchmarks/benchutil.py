"""What the benchmarks share: a ``moecached`` process to measure, and the JSON results file.

Benchmarks run as scripts (``python benchmarks/NAME.py``), so this directory is on
``sys.path``: ``from benchutil import start_daemon, stop_daemon, write_json``.
"""
from __future__ import annotations

import json
import os
import subprocess

from moecached.tools import daemonproc


def start_daemon(model: str, sock: str, *args: str, env: dict | None = None,
                 wait: float = 60.0) -> subprocess.Popen:
    """``moecached.tools.daemonproc.start_daemon`` at log level warning (then ``args``), its
    output in ``SOCK.log``. ``env``: the daemon's environment (e.g. another source tree on
    PYTHONPATH). RuntimeError when it exits or does not answer within ``wait`` seconds."""
    with open(f"{sock}.log", "w") as log:
        return daemonproc.start_daemon(model, sock, "--log-level", "warning", *args, env=env, wait=wait,
                                       output=log)


def stop_daemon(p: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 15 s."""
    daemonproc.stop_daemon(p)


def write_json(path: str, results: dict) -> None:
    """Write ``results`` to ``path`` (directories made as needed) and say so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {path}")


def fixture_model(a, note: str = "writing") -> tuple:
    """(the model to read, the folder to remove at the end or None) for a benchmark's
    ``--model`` / ``--dir --layout --layers --experts --keep`` arguments: the given model, else
    a dense fixture written under ``--dir`` once (kept between runs with ``--keep``)."""
    if a.model:
        return a.model, None
    from pathlib import Path
    import sys
    from moecached.tools.synth import write_model
    out = Path(a.dir) / f"{a.layout}-L{a.layers}-E{a.experts}" / "model.gguf"
    if not out.exists():
        print(f"{note} {out} ...", file=sys.stderr)
        write_model(a.layout, out, layers=a.layers, experts=a.experts, progress=False, sparse=False)
    return str(out), (None if a.keep else out.parent)


def runnable_model(work, *, blocks: int, quant: str, arch: str = "qwen3moe",
                   geometry: str = "qwen3-30b-a3b", bin_dir=None) -> str:
    """A ``synth --runnable`` model under ``work`` (written once, reused by name). ``bin_dir``:
    the patched build, whose ``llama-quantize`` makes the quantizations synth does not write."""
    import sys
    from pathlib import Path
    from moecached.tools.synth_runnable import write_runnable
    model = str(Path(work) / f"runnable-{arch}-{geometry}-{blocks}b-{quant}.gguf")
    if not os.path.exists(model):
        print(f"writing {model} ...", file=sys.stderr)
        q = str(Path(bin_dir) / "llama-quantize") if bin_dir and quant.lower() not in ("f32", "q8_0") else None
        write_runnable(model + ".tmp", arch=arch, geometry=geometry, blocks=blocks, quant=quant,
                       quantize_bin=q)
        os.replace(model + ".tmp", model)
    return model


def at_least_one(ap, a, *names: str) -> None:
    """``ap.error`` in one line for the first of ``a``'s integer options ``names`` below 1."""
    for name in names:
        if getattr(a, name) < 1:
            ap.error(f"--{name} {getattr(a, name)}: must be at least 1")
