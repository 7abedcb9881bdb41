"""Acquire+release latency through the daemon vs a raw pyzmq DEALER/ROUTER + msgpack floor.

Measures, from a separate client process, the round trip of ``acquire`` of 8 resident
experts + ``release`` (noreply, pipelined into the next acquire), p50/p99 in microseconds,
against a raw ping-pong between a DEALER and a ROUTER echo process exchanging msgpack
messages of the same sizes (a request the size of the acquire, a reply the size of the
lease). Rounds interleave (raw, daemon, raw, daemon, ...) because the machine is shared and
noisy; the table reports each round and the median ratio. Then the same with 4 client
processes at once.

    python benchmarks/ipc_latency.py [--iters 3000] [--rounds 3] [--json benchmarks/results/ipc_latency.json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time

import msgpack
import numpy as np
import zmq

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


def raw_client(endpoint: str, iters: int, req: dict, out):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(endpoint)
    lat = []
    rel = msgpack.packb({"v": 1, "id": 0, "op": "release", "lease": 1, "noreply": True})
    for i in range(iters + 200):
        t = time.perf_counter()
        req["id"] = i
        s.send(msgpack.packb(req))
        msgpack.unpackb(s.recv(), raw=False)
        s.send(rel)
        if i >= 200:
            lat.append(time.perf_counter() - t)
    s.close(0)
    ctx.term()
    out.put(lat)


def daemon_client(endpoint: str, iters: int, layer: int, experts, out):
    from moecache_client import Client
    c = Client(endpoint, name=f"bench{os.getpid()}")
    lat = []
    for i in range(iters + 200):
        t = time.perf_counter()
        lease = c.acquire(layer, experts)
        lease.release()
        if i >= 200:
            lat.append(time.perf_counter() - t)
    c.close()
    out.put(lat)


def run_clients(target, args, n: int) -> list[float]:
    q = mp.Queue()
    ps = [mp.Process(target=target, args=(*args, q)) for _ in range(n)]
    for p in ps:
        p.start()
    lats = []
    for _ in ps:
        lats += q.get(timeout=600)
    for p in ps:
        p.join()
    return lats


def pct(lat, p):
    return float(np.percentile(np.array(lat) * 1e6, p))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--json", default=os.path.join(HERE, "results", "ipc_latency.json"))
    a = ap.parse_args(argv)

    from moecached.synth import write_model
    from moecached.index import open_index
    tmp = tempfile.mkdtemp(prefix="moecache-bench-")
    model = write_model("qwen3-30b-a3b-Q4_K_M", os.path.join(tmp, "m.gguf"), layers=2, experts=16, progress=False)[0]
    idx = open_index(model)
    layer, experts = idx.expert_layers[0], list(range(8))
    sock = os.path.join(tmp, "d.sock")
    dproc = subprocess.Popen([sys.executable, "-P", "-m", "moecached.daemon", "--model", model, "--slots", "32",
                              "--endpoint", f"ipc://{sock}", "--no-lock-memory", "--log-level", "warning"])
    from moecache_client import Client
    for _ in range(300):
        try:
            with Client(f"ipc://{sock}", connect_timeout=1) as c:
                c.acquire(layer, experts).release()  # make them resident
                lease = c.acquire(layer, experts)
                reply = {"v": 1, "id": 1, "ok": True, "session": c.session, "lease": lease.id,
                         "items": [list(t) for t in lease.items], "hits": 8, "prefetch_hits": 0,
                         "misses": 0, "stall_us": 0}
                lease.release()
            break
        except Exception:
            time.sleep(0.1)
    reply_size = len(msgpack.packb(reply)) - len(msgpack.packb({"v": 1, "id": 1, "ok": True, "pad": ""}))
    req = {"v": 1, "id": 0, "op": "acquire", "layer": layer, "experts": experts}
    raw_ep = f"ipc://{tmp}/raw.sock"
    ready = mp.Event()
    echo = mp.Process(target=raw_echo_server, args=(raw_ep, reply_size, ready))
    echo.start()
    ready.wait(10)

    rows = []
    try:
        for nclients in (1, a.clients):
            for rnd in range(a.rounds):
                raw = run_clients(raw_client, (raw_ep, a.iters, dict(req)), nclients)
                dae = run_clients(daemon_client, (f"ipc://{sock}", a.iters, layer, experts), nclients)
                rows.append({"clients": nclients, "round": rnd + 1,
                             "raw_p50_us": pct(raw, 50), "raw_p99_us": pct(raw, 99),
                             "daemon_p50_us": pct(dae, 50), "daemon_p99_us": pct(dae, 99),
                             "ratio_p50": pct(dae, 50) / pct(raw, 50)})
    finally:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.connect(raw_ep)
        s.send(msgpack.packb({"op": "stop"}))
        echo.join(5)
        s.close(0)
        dproc.terminate()
        dproc.wait(15)
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"{'clients':>7} {'round':>5} {'raw p50':>9} {'raw p99':>9} {'daemon p50':>10} {'daemon p99':>10} {'ratio p50':>9}")
    for r in rows:
        print(f"{r['clients']:>7} {r['round']:>5} {r['raw_p50_us']:>9.1f} {r['raw_p99_us']:>9.1f} "
              f"{r['daemon_p50_us']:>10.1f} {r['daemon_p99_us']:>10.1f} {r['ratio_p50']:>9.2f}")
    summary = {}
    for n in sorted({r["clients"] for r in rows}):
        rs = [r for r in rows if r["clients"] == n]
        summary[n] = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k not in ("clients", "round")}
        print(f"median over rounds, {n} client(s): daemon p50 {summary[n]['daemon_p50_us']:.1f} us, "
              f"p99 {summary[n]['daemon_p99_us']:.1f} us; raw floor p50 {summary[n]['raw_p50_us']:.1f} us; "
              f"ratio {summary[n]['ratio_p50']:.2f} (target <= 1.3)")
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"command": " ".join(["python", "benchmarks/ipc_latency.py"] + (argv or sys.argv[1:])),
                   "iters": a.iters, "rows": rows, "summary": summary}, f, indent=1)
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
