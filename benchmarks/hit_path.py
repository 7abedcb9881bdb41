"""The hit path: acquire + release of resident experts, every way an engine can do it.

Part 1 times ``acquire`` + ``release`` of ``--experts`` (8) resident experts, p50/p99 in
microseconds, for:

* ``in-process``: ``ExpertCache.acquire`` / ``release`` in this process (no IPC at all);
* ``python fast path``: ``moecache_client.Client`` pinning through shared memory (the pin file;
  no message) against the daemon -- or, when this daemon offers no pin file, against a scripted
  daemon side (tests/fake_fastd.py: the same files, laid out as docs/protocol.md says; its ring
  is consumed between pairs, untimed, as the daemon would);
* ``python socket path``: the same client with ``fast_path=False`` (acquire over ZeroMQ,
  release noreply, pipelined into the next acquire);
* ``raw zmq floor``: a bare DEALER/ROUTER msgpack round trip of the same sizes (benchmarks/ipc_latency.py);
* ``C fast path``: ``mcshm_pin`` + ``mcshm_unpin`` from moecache_shm.h, compiled with ``cc``
  (benchmarks/hit_path_c.c), on the scripted daemon side's arena and pin file (the same layout;
  the C program does no hello), its ring consumed between pairs (skipped with a note when there
  is no C compiler);
* ``C client library``: libmoecache's ``mc_acquire`` + ``mc_release`` against the daemon
  (clients/c/examples/hit_bench.c, built with make; the library's whole hit path: the pin, its
  lease bookkeeping, the release store), when the C client builds here.

All kinds run in interleaved rounds (order rotating each round) in one run, so drift of a
shared machine hits them alike; the table gives the median over rounds of each round's p50/p99.

Part 2: the replay's daemon overhead per token (``moecached.tools.replay``'s all-resident pass: one
token's routed experts, every MoE layer, acquire + release) on a 48-layer Qwen3-30B-A3B model
driven by the first ``--replay-tokens`` tokens of a real trace, fast path on vs off, in
alternating rounds. The model keeps the layout's 48 layers and real expert sizes but only the
experts those tokens route to (ids renumbered per layer in order of first use), so it is small.

    python benchmarks/hit_path.py [--iters 2000] [--rounds 6] [--replay-rounds 4] [--json benchmarks/results/hit_path.json]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import zmq  # noqa: E402

from benchutil import start_daemon, stop_daemon, write_json  # noqa: E402
from ipc_latency import raw_echo_server  # noqa: E402

QWEN = "qwen3-30b-a3b-Q4_K_M"


def timed(fn, iters: int, between=None) -> np.ndarray:
    pc = time.perf_counter_ns
    out = np.empty(iters, dtype=np.int64)
    for i in range(iters):
        if between is not None:
            between()
        t = pc()
        fn()
        out[i] = pc() - t
    return out / 1000.0


def pct(us: np.ndarray, p: float) -> float:
    return float(np.percentile(us, p))


class CFast:
    """benchmarks/hit_path_c.c built with cc, run on an arena + pin file."""

    def __init__(self, tmp: str, fake, layer: int, experts):
        cc = shutil.which("cc") or shutil.which("gcc")
        self.note = None
        if cc is None:
            self.note = "no C compiler (cc): C fast path skipped"
            return
        self.exe = os.path.join(tmp, "hit_path_c")
        r = subprocess.run([cc, "-O2", "-std=c11", "-I", os.path.join(ROOT, "clients", "c", "include"),
                            os.path.join(HERE, "hit_path_c.c"), "-o", self.exe], capture_output=True, text=True)
        if r.returncode != 0:
            self.note = f"C fast path skipped: cc failed: {r.stderr.strip().splitlines()[-1:]}"
            return
        from fake_fastd import CLASSES, EXPERT_LAYERS, LAYER_CLASS, N_EXPERTS
        words = [fake.session, N_EXPERTS, len(EXPERT_LAYERS) * N_EXPERTS, len(CLASSES), fake.resmap_off // 8,
                 fake.pw[3], fake.pins_off // 4, fake.ring_off // 8, len(EXPERT_LAYERS)]
        for c in CLASSES:
            words += [fake.gen_off[c["id"]] // 8, c["n_slots"], fake.slot_base[c["id"]]]
        words += [LAYER_CLASS[l] for l in EXPERT_LAYERS]
        words += [len(experts)] + [fake.key(layer, e) for e in experts]
        self.layout = os.path.join(tmp, "hit_path_c.layout")
        with open(self.layout, "w") as f:
            f.write(" ".join(str(int(w)) for w in words) + "\n")
        self.files = (fake.path, fake.pin_path)

    def run(self, iters: int):
        r = subprocess.run([self.exe, self.layout, *self.files, str(iters)], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"hit_path_c failed: {r.stdout} {r.stderr}")
        p50, p99, _ = r.stdout.split()
        return int(p50) / 1000.0, int(p99) / 1000.0


class CLib:
    """clients/c/examples/hit_bench.c (libmoecache's own mc_acquire + mc_release) against the
    daemon, built with make; None-noted when the C client cannot be built here."""

    def __init__(self, endpoint: str, layer: int, experts):
        self.note = None
        cdir = os.path.join(ROOT, "clients", "c")
        if not (shutil.which("make") and shutil.which("cc")):
            self.note = "no make/cc: C client library row skipped"
            return
        r = subprocess.run(["make", "-C", cdir, "build/hit_bench"], capture_output=True, text=True)
        if r.returncode != 0:
            self.note = f"C client library row skipped: make failed: {r.stdout.strip().splitlines()[-1:]}"
            return
        self.cmd = [os.path.join(cdir, "build", "hit_bench"), endpoint, str(layer)]
        self.experts = [str(e) for e in experts]

    def run(self, iters: int):
        r = subprocess.run(self.cmd + [str(iters)] + self.experts, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"hit_bench failed: {r.stdout} {r.stderr}")
        p50, p99, fast = r.stdout.split()
        if fast != "1":
            raise RuntimeError("hit_bench: the C client's acquires did not take the fast path")
        return int(p50) / 1000.0, int(p99) / 1000.0


def part1(a, tmp):
    from moecached.engine.cache import ExpertCache
    from moecached.engine.index import open_index
    from moecached.tools.synth import write_model
    from moecache_client import Client
    from fake_fastd import FakeDaemon

    model = write_model(QWEN, os.path.join(tmp, "m.gguf"), layers=2, experts=16, progress=False)[0]
    idx = open_index(model)
    layer, experts = idx.expert_layers[0], list(range(a.experts))
    sock = os.path.join(tmp, "d.sock")
    notes = []
    dproc = start_daemon(model, sock, "--slots", "32")
    echo = fake = cache = None
    clients = []
    try:
        sockc = Client(f"ipc://{sock}", name="bench-socket", fast_path=False)
        clients.append(sockc)
        sockc.acquire(layer, experts).release()           # resident
        fastc = Client(f"ipc://{sock}", name="bench-fast")
        clients.append(fastc)
        fast_between = None
        if not fastc.fast_path:
            notes.append("this daemon offers no pin file: the Python and C fast paths ran against the "
                         "scripted daemon side (tests/fake_fastd.py), same client code, same file layout")
            fake = FakeDaemon(tmp)
            fastc.close()
            fastc = Client(fake.endpoint, name="bench-fast", heartbeat_s=60)
            clients.append(fastc)
            flayer, fexperts = 3, list(range(a.experts))
            for e in fexperts:
                fake.load(flayer, e)
            pw = fake.pw

            def fast_between():     # the daemon's part: consume the ring (untimed)
                pw[16] = pw[8]
        else:
            flayer, fexperts = layer, experts
        if not fastc.fast_path and IMPLEMENTATION_PURE():
            notes.append("moecache_client without its extension (MOECACHE_CLIENT_PURE or not built): "
                         "the 'fast path' row is the socket path")
        if fake is None:      # the C row always runs on the scripted side's files (no hello in C here)
            fake = FakeDaemon(tmp)
            for e in range(a.experts):
                fake.load(3, e)
        cfast = CFast(tmp, fake, 3, list(range(a.experts)))
        if cfast.note:
            notes.append(cfast.note)
            cfast = None
        # the C library against the real daemon, when it offers the fast path
        clib = CLib(f"ipc://{sock}", layer, experts) if fast_between is None else None
        if clib is not None and clib.note:
            notes.append(clib.note)
            clib = None

        cache = ExpertCache(idx, policy="global", readers=2, lock_memory=False)
        cache.release(cache.acquire(layer, experts, timeout=60))
        reply = {"v": 1, "id": 1, "ok": True, "session": sockc.session, "lease": 1,
                 "items": [[layer, e, 0, e] for e in experts], "gens": [0] * len(experts), "hits": 8,
                 "prefetch_hits": 0, "misses": 0, "stall_us": 0}
        reply_size = len(msgpack.packb(reply)) - len(msgpack.packb({"v": 1, "id": 1, "ok": True, "pad": ""}))
        raw_ep = f"ipc://{tmp}/raw.sock"
        ready = mp.Event()
        echo = mp.Process(target=raw_echo_server, args=(raw_ep, reply_size, ready))
        echo.start()
        ready.wait(10)
        rs = zmq.Context.instance().socket(zmq.DEALER)
        rs.setsockopt(zmq.LINGER, 0)
        rs.connect(raw_ep)
        req = {"v": 1, "id": 0, "op": "acquire", "layer": layer, "experts": experts}
        rel = msgpack.packb({"v": 1, "id": 0, "op": "release", "lease": 1, "noreply": True})
        ids = iter(range(1, 1 << 62))

        def raw():
            req["id"] = next(ids)
            rs.send(msgpack.packb(req))
            msgpack.unpackb(rs.recv(), raw=False)
            rs.send(rel)

        kinds = {
            "in-process ExpertCache": (lambda: cache.release(cache.acquire(layer, experts)), None),
            "python fast path": (lambda: fastc.acquire(flayer, fexperts).release(), fast_between),
            "python socket path": (lambda: sockc.acquire(layer, experts).release(), None),
            "raw zmq DEALER/ROUTER": (raw, None),
        }
        for fn, between in kinds.values():     # warm up
            timed(fn, 300, between)
        per = {k: [] for k in kinds}
        if cfast is not None:
            per["C fast path (moecache_shm.h)"] = []
        if clib is not None:
            per["C client library (libmoecache)"] = []
        names = list(per)
        for rnd in range(a.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for k in order:
                if k in kinds:
                    fn, between = kinds[k]
                    us = timed(fn, a.iters, between)
                    per[k].append((pct(us, 50), pct(us, 99)))
                elif k.startswith("C client library"):
                    per[k].append(clib.run(a.iters))
                else:
                    per[k].append(cfast.run(a.iters))
        assert fake.counts["acquire"] == 0, "fast path acquires went over the socket"
        rs.close(0)
        rows = {k: {"p50_us": statistics.median(x[0] for x in v), "p99_us": statistics.median(x[1] for x in v),
                    "rounds": [{"p50_us": p, "p99_us": q} for p, q in v]} for k, v in per.items()}
        return rows, notes
    finally:
        for c in clients:
            try:
                c.close()
            except Exception:
                pass
        if cache is not None:
            cache.close()
        if fake is not None:
            fake.close()
        if echo is not None:
            s = zmq.Context.instance().socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"ipc://{tmp}/raw.sock")
            s.send(msgpack.packb({"op": "stop"}))
            echo.join(5)
            s.close(0)
            if echo.is_alive():
                echo.terminate()
        stop_daemon(dproc)


def IMPLEMENTATION_PURE() -> bool:
    import moecache_client
    return moecache_client.IMPLEMENTATION != "cython"


def small_trace(path: str, tokens: int):
    """The first ``tokens`` tokens of a real trace, expert ids renumbered per layer in order of
    first use (so the model needs only the experts they route to)."""
    from moecached.engine.trace import Trace, load_trace
    t = load_trace(path)
    ex = np.array(t.window(0, tokens).experts, dtype=np.int16)
    n = 0
    for l in range(ex.shape[1]):
        ids: dict = {}
        for tok in range(ex.shape[0]):
            for j in range(ex.shape[2]):
                e = int(ex[tok, l, j])
                if e >= 0:
                    ex[tok, l, j] = ids.setdefault(e, len(ids))
        n = max(n, len(ids))
    meta = {"n_experts": n, "source": os.path.basename(path), "tokens": tokens}
    return Trace(experts=ex, is_prompt=np.zeros(ex.shape[0], dtype=bool), meta=meta), n


def part2(a, tmp):
    from moecached.tools.replay import replay
    from moecached.tools.synth import write_model
    from moecache_client import Client

    trace_path = a.trace
    if trace_path is None:   # ../shared/traces beside the repository
        trace_path = os.path.join(ROOT, os.pardir, "shared", "traces", "qwen3_30b_a3b_sharegpt_prefill_2050.npz")
    if trace_path is None or not os.path.exists(trace_path):
        return None, [f"replay overhead skipped: no real trace (--trace; looked for {trace_path})"]
    tr, n_exp = small_trace(trace_path, a.replay_tokens)
    model = write_model(QWEN, os.path.join(tmp, "r.gguf"), layers=tr.n_layers, experts=n_exp, progress=False)[0]
    sock = os.path.join(tmp, "r.sock")
    dproc = start_daemon(model, sock, "--slots", str(tr.n_layers * n_exp))
    notes = []
    try:
        with Client(f"ipc://{sock}", name="replay-fast") as fc, \
                Client(f"ipc://{sock}", name="replay-socket", fast_path=False) as sc:
            if not fc.fast_path:
                notes.append("replay: this daemon offers no pin file, so 'fast path on' ran over the socket too")
            res = {"fast path on": [], "fast path off": []}
            for rnd in range(a.replay_rounds):
                pairs = [("fast path on", fc), ("fast path off", sc)]
                for name, c in (pairs if rnd % 2 == 0 else pairs[::-1]):
                    r = replay(c, tr, overhead_tokens=a.overhead_tokens, simulate_check=False)
                    if not r.get("overhead_all_hits"):
                        notes.append(f"replay round {rnd + 1} ({name}): not every overhead acquire was a hit")
                    res[name].append(r["overhead_ms_per_token"])
        out = {k: {"overhead_ms_per_token": statistics.median(v), "rounds": v} for k, v in res.items()}
        out["model"] = {"layout": QWEN, "layers": tr.n_layers, "experts_per_layer": n_exp,
                        "trace": os.path.basename(trace_path), "tokens": a.replay_tokens,
                        "overhead_tokens": a.overhead_tokens}
        return out, notes
    finally:
        stop_daemon(dproc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=2000, help="pairs per kind per round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--trace", help="real routing trace for part 2 (default: ../shared/traces, Qwen3 sharegpt)")
    ap.add_argument("--replay-tokens", type=int, default=2, help="trace tokens the replay model covers")
    ap.add_argument("--replay-rounds", type=int, default=4)
    ap.add_argument("--overhead-tokens", type=int, default=50, help="all-resident tokens per replay round")
    ap.add_argument("--no-replay", action="store_true", help="part 1 only")
    ap.add_argument("--json", default=os.path.join(HERE, "results", "hit_path.json"))
    a = ap.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="moecache-hitpath-")
    try:
        rows, notes = part1(a, tmp)
        rep, n2 = (None, ["replay overhead skipped (--no-replay)"]) if a.no_replay else part2(a, tmp)
        notes += n2
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    import moecache_client
    print(f"hit path: acquire + release of {a.experts} resident experts, median over {a.rounds} interleaved "
          f"rounds of {a.iters} pairs (python {platform.python_version()}, {os.cpu_count()} cpus, "
          f"client {moecache_client.IMPLEMENTATION})")
    print(f"{'kind':32s} {'p50 us':>8s} {'p99 us':>8s}")
    for k, r in rows.items():
        print(f"{k:32s} {r['p50_us']:8.2f} {r['p99_us']:8.2f}")
    if rep is not None:
        m = rep["model"]
        print(f"replay daemon overhead per token ({m['layers']} layers, {m['trace']}, {m['tokens']} tokens' experts, "
              f"median of {a.replay_rounds} rounds of {m['overhead_tokens']} tokens)")
        for k in ("fast path on", "fast path off"):
            print(f"{k:32s} {rep[k]['overhead_ms_per_token']:8.3f} ms/token")
    for n in notes:
        print("note:", n)
    write_json(a.json, {"benchmark": "hit_path", "command": " ".join(["python", "benchmarks/hit_path.py"] +
                                                                     (argv if argv is not None else sys.argv[1:])),
                        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
                        "python": platform.python_version(), "client": moecache_client.IMPLEMENTATION,
                        "experts": a.experts, "iters": a.iters, "rounds": a.rounds, "hit_path": rows,
                        "replay_overhead": rep, "notes": notes})
    return 0


if __name__ == "__main__":
    sys.exit(main())
