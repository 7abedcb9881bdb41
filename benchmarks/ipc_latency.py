"""Acquire+release latency through the daemon vs a raw pyzmq DEALER/ROUTER + msgpack floor.

Measures, from a separate client process, the round trip of ``acquire`` of 8 resident
experts + ``release`` (noreply, pipelined into the next acquire) over the socket (the client's
shared-memory path off), p50/p99 in microseconds,
against a raw ping-pong between a DEALER and a ROUTER echo process exchanging msgpack
messages of the same sizes (a request the size of the acquire, a reply the size of the
lease). The machine is shared and noisy, so the comparison is paired: persistent client
processes of both kinds are started once, then batches of ``--iters`` pairs alternate
raw/daemon in ABBA order for ``--rounds`` rounds; the table reports each round's p50/p99 and
ratio, the summary the median of the per-round ratios and the ratio of all pairs pooled.
Then the same with 4 client processes of each kind at once.

``--baseline-tree DIR`` measures a second daemon run from another source tree (e.g. a git
worktree of an older commit; its ``moecached`` on PYTHONPATH, its Cython built there) in the
same rounds: raw, this tree's daemon and the baseline's take turns, the order rotating each
round, and each round also gives this daemon's p50 over the baseline's.

    python benchmarks/ipc_latency.py [--iters 1000] [--rounds 12] [--clients 4] [--baseline-tree DIR] [--json benchmarks/results/ipc_latency.json]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import msgpack
import numpy as np
import zmq

from benchutil import start_daemon, stop_daemon, write_json

HERE = os.path.dirname(os.path.abspath(__file__))


def raw_echo_server(endpoint: str, reply_size: int, ready):
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.bind(endpoint)
    ready.set()
    filler = "x" * reply_size
    while True:
        ident, data = s.recv_multipart()
        msg = msgpack.unpackb(data, raw=False)
        if msg.get("op") == "stop":
            s.send_multipart([ident, b"bye"])
            break
        if msg.get("noreply"):
            continue
        s.send_multipart([ident, msgpack.packb({"v": 1, "id": msg["id"], "ok": True, "pad": filler})])
    s.close(0)
    ctx.term()


def _raw_pair(s, req, rel, i):
    req["id"] = i
    s.send(msgpack.packb(req))
    msgpack.unpackb(s.recv(), raw=False)
    s.send(rel)


def worker(kind: str, endpoint: str, req: dict, layer: int, experts, conn):
    """A persistent client process: ``kind`` "raw" (bare DEALER against the echo server) or
    "daemon" (``moecache_client.Client``). Runs a batch of pairs per ("run", n) command and
    sends back the latencies (seconds), so raw and daemon batches can be interleaved finely
    without paying process start-up between them."""
    if kind == "raw":
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.connect(endpoint)
        rel = msgpack.packb({"v": 1, "id": 0, "op": "release", "lease": 1, "noreply": True})
        req = dict(req)
        counter = iter(range(1, 1 << 62))

        def pair():
            _raw_pair(s, req, rel, next(counter))
    else:
        from moecache_client import Client
        # the socket path: without fast_path=False the client pins resident experts through
        # the daemon's pin file and no message is sent (benchmarks/hit_path.py measures that)
        c = Client(endpoint, name=f"bench{os.getpid()}", fast_path=False)

        def pair():
            lease = c.acquire(layer, experts)
            lease.release()
    for _ in range(200):  # warm-up
        pair()
    conn.send("ready")
    pc = time.perf_counter
    while True:
        cmd = conn.recv()
        if cmd[0] != "run":
            break
        lat = []
        for _ in range(cmd[1]):
            t = pc()
            pair()
            lat.append(pc() - t)
        conn.send(lat)
    if kind == "raw":
        s.close(0)
        ctx.term()
    else:
        c.close()
    conn.send("bye")


class Workers:
    """``n`` persistent worker processes of one kind; ``run(iters)`` -> pooled latencies."""

    def __init__(self, kind, n, *args):
        self.conns, self.procs = [], []
        for _ in range(n):
            a, b = mp.Pipe()
            p = mp.Process(target=worker, args=(kind, *args, b), daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)
        for a in self.conns:
            if not a.poll(120) or a.recv() != "ready":
                raise RuntimeError(f"{kind} worker did not start")

    def run(self, iters: int) -> list[float]:
        for a in self.conns:
            a.send(("run", iters))
        out = []
        for a in self.conns:
            out += a.recv()
        return out

    def close(self):
        for a in self.conns:
            try:
                a.send(("stop",))
                a.poll(10) and a.recv()
            except (OSError, EOFError):
                pass
        for p in self.procs:
            p.join(10)


def pct(lat, p):
    return float(np.percentile(np.array(lat) * 1e6, p))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=1000, help="pairs per client per batch")
    ap.add_argument("--rounds", type=int, default=12, help="paired batches (raw, daemon) per client count")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--baseline-tree", help="source tree of a second daemon measured in the same rounds")
    ap.add_argument("--json", default=os.path.join(HERE, "results", "ipc_latency.json"))
    a = ap.parse_args(argv)

    from moecached.tools.synth import write_model
    from moecached.engine.index import open_index
    tmp = tempfile.mkdtemp(prefix="moecache-bench-")
    model = write_model("qwen3-30b-a3b-Q4_K_M", os.path.join(tmp, "m.gguf"), layers=2, experts=16, progress=False)[0]
    idx = open_index(model)
    layer, experts = idx.expert_layers[0], list(range(8))
    sock = os.path.join(tmp, "d.sock")
    dproc = start_daemon(model, sock, "--slots", "32")
    bsock = bproc = None
    if a.baseline_tree:
        bsock = os.path.join(tmp, "base.sock")
        bproc = start_daemon(model, bsock, "--slots", "32",
                             env=dict(os.environ, PYTHONPATH=os.path.abspath(a.baseline_tree)))
    from moecache_client import Client
    for s in (sock, bsock):
        if s is not None:
            with Client(f"ipc://{s}") as c:
                c.acquire(layer, experts).release()  # make them resident
    with Client(f"ipc://{sock}") as c:
        lease = c.acquire(layer, experts)
        reply = {"v": 1, "id": 1, "ok": True, "session": c.session, "lease": lease.id,
                 "items": [list(t) for t in lease.items], "hits": 8, "prefetch_hits": 0,
                 "misses": 0, "stall_us": 0}
        lease.release()
    reply_size = len(msgpack.packb(reply)) - len(msgpack.packb({"v": 1, "id": 1, "ok": True, "pad": ""}))
    req = {"v": 1, "id": 0, "op": "acquire", "layer": layer, "experts": experts}
    raw_ep = f"ipc://{tmp}/raw.sock"
    ready = mp.Event()
    echo = mp.Process(target=raw_echo_server, args=(raw_ep, reply_size, ready))
    echo.start()
    ready.wait(10)

    rows = []
    pooled = {}
    try:
        for nclients in (1, a.clients):
            kinds = {"raw": Workers("raw", nclients, raw_ep, req, layer, experts),
                     "daemon": Workers("daemon", nclients, f"ipc://{sock}", req, layer, experts)}
            if bsock is not None:
                kinds["base"] = Workers("daemon", nclients, f"ipc://{bsock}", req, layer, experts)
            names = list(kinds)
            pool = {k: [] for k in names}
            try:
                for rnd in range(a.rounds):
                    # the order rotates (ABBA with two kinds): drift of the shared machine
                    # within a round cancels out
                    order = names[rnd % len(names):] + names[:rnd % len(names)]
                    if len(names) == 2 and rnd % 2:
                        order = names[::-1]
                    got = {k: kinds[k].run(a.iters) for k in order}
                    for k in names:
                        pool[k] += got[k]
                    raw, dae = got["raw"], got["daemon"]
                    row = {"clients": nclients, "round": rnd + 1,
                           "raw_p50_us": pct(raw, 50), "raw_p99_us": pct(raw, 99),
                           "daemon_p50_us": pct(dae, 50), "daemon_p99_us": pct(dae, 99),
                           "ratio_p50": pct(dae, 50) / pct(raw, 50)}
                    if "base" in got:
                        b = got["base"]
                        row.update(base_p50_us=pct(b, 50), base_p99_us=pct(b, 99),
                                   base_ratio_p50=pct(b, 50) / pct(raw, 50),
                                   vs_base_p50=pct(dae, 50) / pct(b, 50))
                    rows.append(row)
            finally:
                for w in kinds.values():
                    w.close()
            allraw, alldae = pool["raw"], pool["daemon"]
            pooled[nclients] = {"raw_p50_us": pct(allraw, 50), "raw_p99_us": pct(allraw, 99),
                                "daemon_p50_us": pct(alldae, 50), "daemon_p99_us": pct(alldae, 99),
                                "ratio_p50": pct(alldae, 50) / pct(allraw, 50),
                                "pairs_per_kind": len(allraw)}
            if "base" in pool:
                b = pool["base"]
                pooled[nclients].update(base_p50_us=pct(b, 50), base_p99_us=pct(b, 99),
                                        vs_base_p50=pct(alldae, 50) / pct(b, 50))
    finally:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.connect(raw_ep)
        s.send(msgpack.packb({"op": "stop"}))
        echo.join(5)
        s.close(0)
        stop_daemon(dproc)
        if bproc is not None:
            stop_daemon(bproc)
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)

    base = bsock is not None
    print(f"{'clients':>7} {'round':>5} {'raw p50':>9} {'raw p99':>9} {'daemon p50':>10} {'daemon p99':>10} {'ratio p50':>9}"
          + (f" {'base p50':>9} {'base p99':>9} {'vs base':>7}" if base else ""))
    for r in rows:
        print(f"{r['clients']:>7} {r['round']:>5} {r['raw_p50_us']:>9.1f} {r['raw_p99_us']:>9.1f} "
              f"{r['daemon_p50_us']:>10.1f} {r['daemon_p99_us']:>10.1f} {r['ratio_p50']:>9.2f}"
              + (f" {r['base_p50_us']:>9.1f} {r['base_p99_us']:>9.1f} {r['vs_base_p50']:>7.2f}" if base else ""))
    summary = {}
    for n in sorted({r["clients"] for r in rows}):
        rs = [r for r in rows if r["clients"] == n]
        summary[n] = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k not in ("clients", "round")}
        summary[n]["pooled"] = pooled[n]
        pl = pooled[n]
        print(f"{n} client(s), median of {len(rs)} paired rounds: daemon p50 {summary[n]['daemon_p50_us']:.1f} us, "
              f"raw floor p50 {summary[n]['raw_p50_us']:.1f} us, ratio {summary[n]['ratio_p50']:.2f} (target <= 1.3); "
              f"all pairs pooled: daemon p50 {pl['daemon_p50_us']:.1f} / p99 {pl['daemon_p99_us']:.1f} us, "
              f"raw p50 {pl['raw_p50_us']:.1f} / p99 {pl['raw_p99_us']:.1f} us, ratio {pl['ratio_p50']:.2f}")
        if base:
            print(f"  baseline daemon ({a.baseline_tree}): p50 {summary[n]['base_p50_us']:.1f} us (median), "
                  f"this daemon / baseline p50 {summary[n]['vs_base_p50']:.2f} (median of rounds); pooled: "
                  f"baseline p50 {pl['base_p50_us']:.1f} / p99 {pl['base_p99_us']:.1f} us, "
                  f"this / baseline {pl['vs_base_p50']:.2f}")
    write_json(a.json, {"command": " ".join(["python", "benchmarks/ipc_latency.py"] + (argv or sys.argv[1:])),
                        "iters": a.iters, "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
