"""A cold daemon's whole-model fill against the page cache's cold load of the same file.

    python benchmarks/whole_fill.py [--model PATH | --blocks 4] [--rounds 2]
        [--chunks 256KiB,1MiB,4MiB] [--threads 16] [--variant NAME=FLAGS ...]
        [--dir /work/bench-tmp] [--json out.json]

A memory-mapped engine's cold load reads the whole file through the page cache (big
sequential reads, the kernel's read-ahead); a cold daemon whose arena holds the whole model
reads all its experts in file order (``state_dir`` set, no state file). Per round, page cache
dropped before each (needs root), in rotating order:

* ``buffered``: ``read()`` of the whole file, 1 MiB at a time (``POSIX_FADV_SEQUENTIAL``);
* ``mmap populate``: ``mmap(MAP_POPULATE)`` of the whole file, as llama.cpp loads;
* ``direct C``: the file read front to back with O_DIRECT, ``--threads`` threads taking
  chunks of C bytes in order (the drive's rate for that read size);
* ``daemon C``: a fresh daemon (``--chunk C``, ``--readers`` threads, every expert fits)
  filling the whole model; its ``warm_bytes / warm_seconds`` and the time from start to the
  fill's end (the daemon's own start included); with ``--variant NAME=FLAGS`` once more per
  variant with those daemon flags (``daemon C NAME``), e.g. ``--fill-run=0``.

MiB/s for each; the daemon's rows read the routed experts only (the file less its other
tensors). Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "clients" / "python"), str(HERE)]

from benchutil import at_least_one, runnable_model, start_daemon, stop_daemon, write_json  # noqa: E402
from read_path import drop_caches  # noqa: E402
from moecached.facts.units import parse_size  # noqa: E402
from moecached.engine.index import open_index  # noqa: E402


def buffered(path: str) -> tuple:
    t0 = time.monotonic()
    n = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            n += len(b)
    finally:
        os.close(fd)
    return n, time.monotonic() - t0


def populate(path: str) -> tuple:
    t0 = time.monotonic()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        m.close()
    finally:
        os.close(fd)
    return size, time.monotonic() - t0


def direct(path: str, chunk: int, threads: int) -> tuple:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    size = os.fstat(fd).st_size
    nxt = [0]
    lock = threading.Lock()
    total = [0]

    def work():
        buf = mmap.mmap(-1, chunk)
        got = 0
        while True:
            with lock:
                off = nxt[0]
                nxt[0] += chunk
            if off >= size:
                break
            got += os.preadv(fd, [buf], off)
        with lock:
            total[0] += got
    t0 = time.monotonic()
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.monotonic() - t0
    os.close(fd)
    return total[0], dt


def daemon_fill(model: str, run_dir: Path, chunk: int, readers: int, n_all: int,
                extra: tuple = ()) -> tuple:
    from moecache_client import Client
    sock = str(run_dir / f"d{chunk}.sock")
    state = run_dir / f"state-{chunk}"
    state.mkdir(exist_ok=True)
    for f in state.iterdir():
        f.unlink()
    t0 = time.monotonic()
    d = start_daemon(model, sock, "--slots", str(n_all), "--state-dir", str(state),
                     "--state-interval", "0", "--readers", str(readers), "--chunk", str(chunk),
                     *extra)
    try:
        with Client(f"ipc://{sock}", name="whole-fill", map_arena=False) as c:
            deadline = time.monotonic() + 300
            while True:
                st = c.stats()
                if st["warm_wanted"] and st["warm_loaded"] >= st["warm_wanted"]:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the fill did not end in 300 s: {st['warm_loaded']} of "
                                       f"{st['warm_wanted']}")
                time.sleep(0.01)
            wall = time.monotonic() - t0
            return st["warm_bytes"], st["warm_seconds"], wall, st.get("run_reads", 0)
    finally:
        stop_daemon(d)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a MoE GGUF (default: a runnable one written under --dir)")
    ap.add_argument("--blocks", type=int, default=4, help="MoE blocks of the model written (default %(default)s)")
    ap.add_argument("--quant", default="q8_0", help="its quantization (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default %(default)s)")
    ap.add_argument("--chunks", default="256KiB,1MiB,4MiB",
                    help="read sizes, multiples of 4 KiB (default %(default)s)")
    ap.add_argument("--threads", type=int, default=16,
                    help="O_DIRECT threads and daemon readers (default %(default)s)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="daemon rows of each read size once more with these daemon flags "
                    "(space-separated), e.g. --variant 'run0=--fill-run=0' (repeatable; the "
                    "plain daemon rows always run)")
    ap.add_argument("--dir", default="/work/bench-tmp", help="the model and the runs' files (default %(default)s)")
    ap.add_argument("--json", help="where the results go (default: DIR/whole_fill.json; the committed "
                    "figures are in benchmarks/results/)")
    a = ap.parse_args(argv)
    at_least_one(ap, a, "rounds", "threads", "blocks")
    try:
        chunks = [parse_size(c) for c in a.chunks.split(",")]
    except Exception as e:
        ap.error(f"--chunks {a.chunks}: {e}")
    bad = [c for c in chunks if c < 4096 or c % 4096 or c > 64 << 20]
    if bad:
        ap.error(f"--chunks {a.chunks}: {bad[0]} bytes: each read size must be a multiple of 4 KiB, "
                 f"from 4 KiB to 64 MiB")
    variants = {"": ()}
    for v in a.variant:
        name, eq, flags = v.partition("=")
        if not eq or not name.strip() or " " in name.strip():
            ap.error(f"--variant {v}: expected NAME=FLAGS, e.g. run0=--fill-run=0")
        variants[name.strip()] = tuple(flags.split())
    if os.geteuid() != 0:
        sys.exit("whole_fill: needs root (dropping the page cache)")
    work = Path(a.dir)
    work.mkdir(parents=True, exist_ok=True)
    model = a.model or runnable_model(work, blocks=a.blocks, quant=a.quant)
    idx = open_index(model)
    n_all = len(idx.expert_layers) * idx.n_experts
    daemons = {f"daemon {c >> 10}K{' ' + n if n else ''}": (c, f) for n, f in variants.items()
               for c in chunks}
    kinds = ["buffered", "mmap populate"] + [f"direct {c >> 10}K" for c in chunks] + list(daemons)
    res = {k: [] for k in kinds}
    run_dir = Path(tempfile.mkdtemp(prefix="wf-", dir=str(work)))
    try:
        for r in range(a.rounds):
            order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
            for k in order:
                drop_caches()
                if k == "buffered":
                    n, dt = buffered(model)
                    x = dict(bytes=n, seconds=dt)
                elif k == "mmap populate":
                    n, dt = populate(model)
                    x = dict(bytes=n, seconds=dt)
                elif k.startswith("direct"):
                    c = chunks[[f"direct {c >> 10}K" for c in chunks].index(k)]
                    n, dt = direct(model, c, a.threads)
                    x = dict(bytes=n, seconds=dt)
                else:
                    c, flags = daemons[k]
                    n, dt, wall, runs = daemon_fill(model, run_dir, c, a.threads, n_all, flags)
                    x = dict(bytes=n, seconds=dt, start_to_end_s=wall, run_reads=runs,
                             flags=list(flags))
                x["mib_s"] = x["bytes"] / 2**20 / max(x["seconds"], 1e-9)
                res[k].append(x)
                print(f"round {r} {k:>16}: {x['bytes'] / 2**30:.2f} GiB in {x['seconds']:.2f} s, "
                      f"{x['mib_s']:.0f} MiB/s" + (f" (start to end {x['start_to_end_s']:.2f} s)"
                                                   if "start_to_end_s" in x else "")
                      + (f", {x['run_reads']} run reads" if x.get("run_reads") else ""), file=sys.stderr)
    finally:
        import shutil
        shutil.rmtree(run_dir, ignore_errors=True)
    print("| read | GiB | median s | median MiB/s | rounds MiB/s | start to end s |")
    print("|---|---|---|---|---|---|")
    for k in kinds:
        xs = res[k]
        per = " / ".join(f"{x['mib_s']:.0f}" for x in xs)
        ends = (f"{statistics.median(x['start_to_end_s'] for x in xs):.2f}"
                if "start_to_end_s" in xs[0] else "-")
        print(f"| {k} | {xs[0]['bytes'] / 2**30:.2f} | "
              f"{statistics.median(x['seconds'] for x in xs):.2f} | "
              f"{statistics.median(x['mib_s'] for x in xs):.0f} | {per} | {ends} |")
    write_json(a.json or str(work / "whole_fill.json"), dict(model=model, threads=a.threads, rounds=a.rounds,
                                                              argv=sys.argv[1:], results=res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
