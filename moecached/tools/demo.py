"""``moecache-ctl demo``: the whole system doing its job, in minutes, with no downloads.

1. Model: write a scaled real-layout GGUF from the embedded Qwen3-30B-A3B Q4_K_M layout
   (real per-expert sizes and types, all 128 experts, the first ``--layers`` blocks; non-expert
   tensors are sparse holes) -- or use ``--model``.
2. Workload: the synthetic routing generator of :mod:`moecached.tools.workload` (locality fitted to
   real Qwen3-30B-A3B traces; labelled SYNTHETIC) -- or a real trace with ``--trace``.
3. For each cache size (default a quarter, a half and three quarters of the experts): start
   ``moecached`` as a subprocess on its own socket, wait until it answers, replay the workload
   through it as a batch-1 decode engine (:mod:`moecached.tools.replay`), stop it.
4. Print one results table (a column per size), check that the daemon's hits equal the
   simulator's g-lru on the same window (``moecache-ctl policy TRACE --policies g-lru --sizes
   SLOTS --warmup W --tokens N`` on a prefill-only trace with the model's layers), clean up (daemon stopped, files removed unless ``--keep``).

Memory locking: the daemon mlocks its arena only when ``RLIMIT_MEMLOCK`` allows the whole arena
or the process holds CAP_IPC_LOCK (root); otherwise it runs with ``--no-lock-memory`` and the demo says
so. A size whose arena does not fit in MemAvailable (minus 2 GiB) is skipped, with a message.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np

from moecached import MoecacheError
from moecached.engine.trace import load_trace

__all__ = ["DemoError", "main", "run_demo"]

LAYOUT = "qwen3-30b-a3b-Q4_K_M"
DEFAULT_LAYERS = 16
SYN_WARM, SYN_TOKENS = 64, 256
TRACE_WARM, TRACE_TOKENS = 64, 128


class DemoError(MoecacheError):
    """The demo cannot run as asked (one line)."""


def _mem_available() -> int | None:
    """MemAvailable in bytes (psutil), None when it cannot be read."""
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except Exception:
        return None


def _memlock_ok(nbytes: int) -> bool:
    """True when the daemon may lock ``nbytes``: RLIMIT_MEMLOCK allows it, or the process
    holds CAP_IPC_LOCK (root usually does), which makes the kernel ignore the limit."""
    from moecached.engine.hostmem import memlock_room  # the same rule the arena applies when it locks
    room = memlock_room()
    return room is None or room >= nbytes + (64 << 20)


def _check_free_space(where: str, workdir: str, n_layers: int) -> None:
    """Refuse (one line) to write the scaled model where it does not fit: the space it takes
    (:func:`moecached.tools.synth.model_disk_bytes`) plus 64 MiB against what the filesystem has free."""
    from moecached.tools.synth import model_disk_bytes
    need = model_disk_bytes(LAYOUT, layers=n_layers) + (64 << 20)
    free = shutil.disk_usage(workdir).free
    if free < need:
        raise DemoError(f"{where}: the {n_layers}-block model needs {need / 2**30:.1f} GiB, "
                        f"{free / 2**30:.1f} GiB available: pass --workdir DIR on a filesystem "
                        f"with room (or fewer --layers)")


class Daemon:
    """A moecached subprocess on its own ipc socket in ``workdir``."""

    def __init__(self, model, workdir, *, slots=None, budget=None, lock=False, readers=16,
                 name="d", args=()):
        self.endpoint = f"ipc://{workdir}/{name}.sock"
        self.log_path = os.path.join(workdir, f"{name}.log")
        cmd = [sys.executable, "-P", "-m", "moecached.daemon", "--model", str(model),
               "--endpoint", self.endpoint, "--group", "", "--log-level", "warning",
               "--readers", str(readers), "--lock-memory" if lock else "--no-lock-memory"]
        cmd += ["--slots", str(slots)] if slots is not None else ["--budget", str(budget)]
        cmd += list(args)                 # further daemon options, e.g. ["--admit-cold", "7"]
        self.cmd = cmd
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)

    def connect(self, timeout=120.0, name="moecache-demo"):
        from moecache_client import Client, ClientError, ServerError
        t_end = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise DemoError(f"moecached exited with status {self.proc.returncode}: "
                                f"{self.tail()}")
            try:
                return Client(self.endpoint, name=name, timeout=300, connect_timeout=1.0)
            except ServerError:
                raise
            except ClientError:  # not up yet: no socket file, or no hello within 1 s
                if time.monotonic() > t_end:
                    raise DemoError(f"moecached did not answer on {self.endpoint} within "
                                    f"{timeout:.0f} s: {self.tail()}") from None
                time.sleep(0.1)

    def tail(self, n=3):
        try:
            with open(self.log_path) as fh:
                lines = [l.strip() for l in fh if l.strip()]
            return " | ".join(lines[-n:]) or "(no output)"
        except OSError:
            return "(no log)"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _parse_sizes(s):
    out = []
    for x in s.split(","):
        x = x.strip()
        if not x:
            continue
        try:
            f = float(x[:-1]) / 100 if x.endswith("%") else float(x)
        except ValueError:
            raise DemoError(f"--sizes: found {x!r}, expected fractions like 0.25 or 25%") from None
        if not 0 < f <= 1:
            raise DemoError(f"--sizes: found {x}, expected a fraction in (0, 1]")
        out.append(f)
    if not out:
        raise DemoError("--sizes: empty")
    return out


def fit(text: str) -> str:
    """``text`` folded to lines of at most 100 columns (the table's width), continuation lines
    indented."""
    from moecached.tools.replay import WIDTH
    out = []
    for line in text.split("\n"):
        lead = line[:len(line) - len(line.lstrip())]
        out += textwrap.wrap(line.lstrip(), WIDTH, initial_indent=lead, subsequent_indent=lead + "    ",
                             break_on_hyphens=False) or [line]
    return "\n".join(out)


def run_demo(a, out=sys.stdout) -> dict:
    from moecached.engine.index import open_index
    from moecached.tools.replay import probe_drive, replay, format_table
    stream = sys.stderr if a.json else out

    def say(text):
        print(fit(text), file=stream, flush=True)
    t_all = time.perf_counter()
    base = a.workdir or None
    workdir = tempfile.mkdtemp(prefix="moecache-demo-", dir=base)
    daemon = None
    try:
        # ---- workload (trace part 1)
        real = None
        if a.trace:
            real = load_trace(a.trace)
            real.meta["path"] = a.trace
        # ---- model
        if a.model:
            model = a.model
            idx = open_index(model)
            say(f"model: {model} (given)")
        else:
            n_layers = a.layers or (real.n_layers if real is not None else DEFAULT_LAYERS)
            model = os.path.join(workdir, "qwen3-30b-a3b-scaled.gguf")
            _check_free_space(base or tempfile.gettempdir(), workdir, n_layers)
            say(f"model: writing a scaled Qwen3-30B-A3B Q4_K_M ({n_layers} of 48 blocks, all "
                f"128 experts, real per-expert sizes; non-expert tensors are sparse holes) to "
                f"{model}")
            from moecached.tools.synth import write_model
            t0 = time.perf_counter()
            write_model(LAYOUT, model, layers=n_layers, progress=not a.no_progress)
            say(f"  written in {time.perf_counter() - t0:.1f} s")
            idx = open_index(model)
        L, E, k = len(idx.expert_layers), int(idx.n_experts), int(idx.top_k)
        slot_bytes = {tuple(sc.layers): int(sc.slot_bytes) for sc in idx.size_classes}
        expert_bytes = sum(len(ls) * E * b for ls, b in slot_bytes.items())
        say(f"  {L} MoE layers x {E} experts, top-{k}, {len(idx.size_classes)} size class(es), "
            f"{expert_bytes / 2**30:.2f} GiB of experts")
        # ---- workload (part 2)
        if real is not None:
            t = real
            if t.n_experts > E:
                raise DemoError(f"{a.trace}: {t.n_experts} experts per layer, the model has {E}")
            if t.n_layers > L:
                say(f"workload: REAL trace {a.trace}, its first {L} of {t.n_layers} MoE layers "
                    f"(the model has {L})")
                t = t.window(layers=L)
            elif t.n_layers < L:
                raise DemoError(f"{a.trace}: {t.n_layers} MoE layers, the model has {L} "
                                "(pass --layers to write a smaller model)")
            else:
                say(f"workload: REAL trace {a.trace} ({t.meta.get('model', '?')}, "
                    f"{t.n_tokens} tokens)")
            warm = TRACE_WARM if a.warm_tokens is None else a.warm_tokens
            ntok = TRACE_TOKENS if a.tokens is None else a.tokens
        else:
            warm = SYN_WARM if a.warm_tokens is None else a.warm_tokens
            ntok = SYN_TOKENS if a.tokens is None else a.tokens
            from moecached.tools.workload import generate, DEFAULT_PARAMS
            t = generate(warm + ntok, L, E, k, seed=a.seed, name="synthetic-qwen3-like")
            t.meta["path"] = "synthetic"
            # all tokens are decode: warm-up = the first `warm` of them, as prompt tokens
            t.is_prompt[:warm] = True
            say(f"workload: SYNTHETIC routing (moecached.tools.workload, locality fitted to real "
                f"Qwen3-30B-A3B traces: prev-token overlap ~0.46, LRU@25% ~0.83; params "
                f"{DEFAULT_PARAMS}, seed {a.seed}) -- not a real trace; --trace for one")
        # ---- sizes
        fracs = _parse_sizes(a.sizes)
        n_keys = L * E
        plans = []
        for f in fracs:
            per_layer = int(np.floor(f * E + 0.5))
            slots = max(per_layer, 1) * L
            arena = sum(len(ls) * max(per_layer, 1) * b for ls, b in slot_bytes.items())
            plans.append((f, slots, arena))
        gbps, src = a.gbps, "given"
        if gbps is None:
            say("drive: measuring O_DIRECT read bandwidth on random experts (1 s) ...")
            gbps, src = probe_drive(model, seconds=1.0), "measured"
            say(f"  {gbps:.2f} GB/s" if gbps else "  could not measure (no drive ceiling)")
        results = []
        lock_msgs = set()
        for f, slots, arena in plans:
            avail = _mem_available()
            if avail is not None and arena > avail - (2 << 30):
                say(f"size {f:.0%}: skipped, its arena ({arena / 2**30:.1f} GiB) does not fit in "
                    f"MemAvailable ({avail / 2**30:.1f} GiB) minus 2 GiB")
                continue
            lock = _memlock_ok(arena)
            if not lock:
                soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
                lock_msgs.add(f"memory lock off (--no-lock-memory): RLIMIT_MEMLOCK "
                              f"{soft / 2**20:.0f} MiB < arena; the kernel may page the cache out "
                              f"under pressure (raise the limit, e.g. as root, to lock it)")
            say(f"size {f:.0%}: moecached --slots {slots} ({slots / n_keys:.0%} of {n_keys} "
                f"experts, {arena / 2**30:.2f} GiB), {'memory locked' if lock else 'not locked'}")
            daemon = Daemon(model, workdir, slots=slots, lock=lock, readers=a.readers)
            try:
                c = daemon.connect()
                try:
                    r = replay(c, t, compute_ms=a.compute_ms, attn_frac=a.attn_frac,
                               lookahead=a.lookahead, predictor=a.predictor, warm_tokens=warm,
                               tokens=ntok, gbps=gbps, gbps_source=src, seed=a.seed,
                               progress=not a.no_progress, label=f"{f:.0%} cache")
                finally:
                    c.close()
            finally:
                daemon.stop()
                daemon = None
            r["memory_locked"] = lock
            r["size_fraction"] = f
            results.append(r)
            say(f"  {r['counted_tokens']} tokens in {r['wall_s']:.1f} s: hit rate "
                f"{r['hit_rate']:.2%}, {r['tok_s']:.2f} tok/s")
        if not results:
            raise DemoError("no cache size could run (see messages above)")
        title = (f"moecached demo: {'REAL trace ' + os.path.basename(a.trace) if a.trace else 'SYNTHETIC workload'}"
                 f" on {os.path.basename(model)} ({L} MoE layers x {E} experts, "
                 f"{expert_bytes / 2**30:.2f} GiB of experts)")
        table = format_table(results, title=title)
        for m in sorted(lock_msgs):
            table += f"\nnote: {m}"
        checks = []
        for r in results:
            s = r.get("sim")
            if not s:
                continue
            g = s.get("glru_hit_rate")
            checks.append(f"{r['label']}: daemon {r['hit_rate']:.4%} "
                          + (f"{'==' if s.get('daemon_equals_simulator') else '!='} simulator "
                             f"g-lru {g:.4%} ({r['hits']} vs {s['glru_hits']} hits)"
                             if g is not None else f"simulator g-lru {s.get('glru_error', 'n/a')}")
                          + f"; daemon-LRU reference {s['reference_hit_rate']:.4%} "
                          f"({'same' if s.get('daemon_equals_reference') else 'DIFFERS'})")
        if checks:
            table += fit("\nconsistency (prefetch off, same tokens, same warm-up, same slots per "
                         "size class; equal hits expected):\n  " + "\n  ".join(checks))
        total = time.perf_counter() - t_all
        table += f"\ndemo finished in {total:.0f} s" + (
            f"; files kept in {workdir}" if a.keep else "")
        return {"results": results, "table": table, "model": model, "workdir": workdir,
                "seconds": total}
    finally:
        if daemon is not None:
            daemon.stop()
        if not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def build_parser():
    from moecached.tools.replay import add_engine_args
    ap = argparse.ArgumentParser(allow_abbrev=False,
        prog="moecache-ctl demo",
        description="write a scaled Qwen3-30B-A3B model, run moecached with a quarter, a half "
                    "and three quarters of its experts cached, replay a routing workload through "
                    "it as a batch-1 decode engine, print results, clean up",
        epilog=f"Defaults: a {DEFAULT_LAYERS}-block model (~{DEFAULT_LAYERS * 0.37:.0f} GiB on "
               f"disk) and the SYNTHETIC workload, {SYN_WARM} warm-up + {SYN_TOKENS} counted "
               f"tokens; with --trace the model has the trace's layer count (48 for Qwen3: "
               f"~17.5 GiB on disk, the 75% arena ~13 GiB in /dev/shm) and {TRACE_WARM} + "
               f"{TRACE_TOKENS} tokens. Compute time 0 and prefetch off by default, so the "
               f"table shows what the drive, the cache and the daemon alone allow, and the hit "
               f"rate can be checked against the simulator's g-lru.")
    ap.add_argument("--model", help="an existing GGUF model (default: write a scaled one)")
    ap.add_argument("--trace", help="a real routing trace .npz (default: synthetic workload)")
    ap.add_argument("--layers", type=int,
                    help=f"blocks of the written model (default {DEFAULT_LAYERS}; with --trace, "
                         "the trace's MoE layers; fewer uses the trace's first N layers)")
    ap.add_argument("--sizes", default="0.25,0.5,0.75",
                    help="cache sizes as fractions of each layer's experts (default "
                         "0.25,0.5,0.75)")
    ap.add_argument("--warm-tokens", type=int,
                    help=f"warm-up tokens, uncounted (default {SYN_WARM}; {TRACE_WARM} with "
                         "--trace)")
    add_engine_args(ap)
    ap.set_defaults(tokens=None)
    ap.add_argument("--readers", type=int, default=16, help="daemon reader threads (default 16)")
    ap.add_argument("--workdir", help="where the model and sockets go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the written files")
    ap.add_argument("--json", action="store_true", help="print JSON results")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    return ap


def engine_step(a, say) -> dict:
    """llama.cpp decoding through a daemon (small runnable model, tight cache), checked
    bit-identical to the resident model; one line saying how to build it when it is not."""
    from moecached.tools import engine_llama
    b = engine_llama.llama_bin()
    if b is None:
        say(f"engine: llama.cpp through moecached is not built here; {engine_llama.BUILD_HINT}")
        return {"built": False}
    from moecached.tools.synth_runnable import write_runnable
    workdir = tempfile.mkdtemp(prefix="moecache-demo-engine-", dir=a.workdir or None)
    d = None
    try:
        model = write_runnable(os.path.join(workdir, "engine.gguf"), blocks=2, experts=16, top_k=4,
                               quant="q8_0", hidden=64, expert_ff=64)
        d = Daemon(model, workdir, slots=12, name="engine")
        d.connect().close()
        r = engine_llama.checked_decode(b, model, d.endpoint, workdir)
    finally:
        if d is not None:
            d.stop()
        if not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    st = r["stats"]
    say(f"engine: llama.cpp decoded {r['steps']} tokens through moecached (2 blocks x 16 experts, "
        f"12 slots: {st.get('misses', 0)} misses, {st.get('hits', 0)} hits): logits "
        f"{'bit-identical to' if r['identical'] else 'DIFFERENT FROM'} the resident model's")
    if not r["identical"]:
        raise DemoError("llama.cpp through moecached gave other logits than the resident model")
    return {"built": True, **r}


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.tokens is not None and a.tokens < 1:
        raise DemoError(f"--tokens: found {a.tokens}, expected >= 1")
    res = run_demo(a)
    if a.json:
        res["engine"] = engine_step(a, lambda x: print(fit(x), file=sys.stderr, flush=True))
        js = {k: v for k, v in res.items() if k != "table"}
        json.dump(js, sys.stdout, indent=1, default=float)
        print()
    else:
        print()
        print(res["table"])
        print()
        res["engine"] = engine_step(a, lambda x: print(fit(x), flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
