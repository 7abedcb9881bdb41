"""One client's flood of costly requests, inside every request limit, must not take the daemon's
loop from the others. It did: noreply prefetches naming every expert of every layer, a few
thousand a second, took another client's acquire latency up about 30x. Now each request's loop
time is charged to its client; a client over its share while others are active has its noreply
prefetches held back (the newest runs later, older ones are replaced), counted per client."""
import statistics
import subprocess
import sys
import textwrap
import time

import pytest

from moecache_client import Client

from daemon_util import Daemon

pytestmark = pytest.mark.timeout(300)

FLOOD = textwrap.dedent("""
    import sys, time, msgpack, zmq
    ep, layers, ne, seconds = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3]), float(sys.argv[4])
    s = zmq.Context().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.connect(ep)
    s.send(msgpack.packb({"v": 1, "id": 0, "op": "hello", "client": "flood"}))
    s.recv()
    msg = msgpack.packb({"v": 1, "id": 1, "op": "prefetch", "noreply": True,
                         "layers": [[l, list(range(ne))] for l in layers]})
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        for _ in range(50):
            s.send(msg)
        n += 50
        time.sleep(0.01)            # about 5000 messages a second
    print(n, flush=True)
""")


def _p50_acquires(c, layer, seconds):
    lat = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        c.acquire(layer, [1, 2]).release()
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat)


def test_a_wide_prefetch_flood_does_not_take_the_loop(model_factory, tmp_path):
    path = model_factory("qwen3-30b-a3b-Q4_K_M", layers=8, experts=64)
    with Daemon(path, tmp_path, slots=256, client_rate_limit=40000, client_rate_burst=40000) as d, \
            Client(d.endpoint, name="engine", fast_path=False) as c:
        L = d.idx.expert_layers
        c.acquire(L[0], [1, 2]).release()
        alone = _p50_acquires(c, L[0], 1.5)
        p = subprocess.Popen([sys.executable, "-c", FLOOD, d.endpoint, ",".join(map(str, L)), "64", "3"],
                             stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        flooded = _p50_acquires(c, L[0], 1.5)
        sent = int(p.communicate(timeout=60)[0])
        flood = next(x for x in c.stats()["clients"] if x["name"] == "flood")
    assert sent > 1000
    assert flooded <= 2 * alone, f"acquire p50 {alone * 1e6:.0f} us alone, {flooded * 1e6:.0f} us in the flood"
    assert flood.get("throttled", 0) > 0 and flood["prefetches_coalesced"] > 0, flood
