"""Soak: client processes -- Python (watched and unwatched) and, when the C client builds, C
(clients/c/examples/soak.c), all pinning through shared memory when they can -- acquire random
experts on a small cache under heavy eviction while they are stalled past the heartbeat
(SIGSTOP/SIGCONT), SIGKILLed and replaced, and while the daemon is stalled and restarted.
Every byte a client reads through a lease that still says valid afterwards is checked against
the model file.

Done when: 0 wrong bytes read without an exception, 0 pins left once the clients are gone.
Bounded: ``MOECACHED_SOAK_S`` seconds (default 40); set it higher for a long run.
"""
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon_util import start_daemon, stop_daemon
from moecache_client import Client, ClientError

HERE = Path(__file__).resolve().parent
CDIR = HERE.parent / "clients" / "c"
SOAK_S = float(os.environ.get("MOECACHED_SOAK_S", "40"))
pytestmark = pytest.mark.timeout(600 + 2 * SOAK_S)   # a long soak is not a hang


def c_worker(tmp_path, model):
    """Build the C soak worker and its expectation table; None when the C client cannot be
    built here (the Python workers still run)."""
    import shutil
    if not all(shutil.which(t) for t in ("cc", "make", "pkg-config")):
        return None
    r = subprocess.run(["make", "-C", str(CDIR), "build/soak"], capture_output=True, text=True)
    if r.returncode != 0:
        return None
    expect = tmp_path / "expect.txt"
    subprocess.run([sys.executable, str(CDIR / "tests" / "dump_expect.py"), model, str(expect)], check=True)
    return str(CDIR / "build" / "soak"), str(expect)


@pytest.mark.slow
def test_soak_stalls_kills_restarts(model_factory, tmp_path):
    model = model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 7, 8], experts=16)
    sock = str(tmp_path / "d.sock")
    ep = f"ipc://{sock}"
    args = ("--slots", "24", "--heartbeat", "1")
    d = start_daemon(model, sock, *args)
    rng = random.Random(1)
    outs, procs = [], {}
    seeds = iter(range(10_000))
    cw = c_worker(tmp_path, model)

    def spawn(i):
        seed = next(seeds)
        out = tmp_path / f"client{seed}.txt"
        outs.append(out)
        if i >= 4:   # C workers
            procs[i] = subprocess.Popen([cw[0], ep, cw[1], str(out), str(seed)], stderr=subprocess.DEVNULL)
            return
        extra = ["--unwatched"] if i % 2 else []
        procs[i] = subprocess.Popen([sys.executable, str(HERE / "soak_client.py"), ep, str(out),
                                     str(seed)] + extra, stderr=subprocess.DEVNULL)

    n_clients = 4 + (2 if cw else 0)
    for i in range(n_clients):
        spawn(i)
    events = {"client_stalls": 0, "client_kills": 0, "daemon_stalls": 0, "daemon_restarts": 0}
    try:
        t_end = time.time() + SOAK_S
        next_restart = time.time() + SOAK_S / 3
        while time.time() < t_end:
            time.sleep(rng.uniform(0.3, 1.0))
            r = rng.random()
            i = rng.randrange(n_clients)
            if r < 0.35:                                   # a client stalls past the heartbeat
                procs[i].send_signal(signal.SIGSTOP)
                time.sleep(rng.uniform(1.2, 2.5))
                procs[i].send_signal(signal.SIGCONT)
                events["client_stalls"] += 1
            elif r < 0.65:                                 # a client is killed and replaced
                procs[i].kill()
                procs[i].wait()
                spawn(i)
                events["client_kills"] += 1
            elif r < 0.8:                                  # the daemon stalls
                d.send_signal(signal.SIGSTOP)
                time.sleep(rng.uniform(1.2, 2.5))
                d.send_signal(signal.SIGCONT)
                events["daemon_stalls"] += 1
            elif time.time() >= next_restart:              # the daemon is killed or stopped
                if rng.random() < 0.5:
                    d.kill()
                    d.wait()
                else:
                    stop_daemon(d)
                d = start_daemon(model, sock, *args)
                events["daemon_restarts"] += 1
                next_restart = time.time() + SOAK_S / 3
        for p in procs.values():
            p.send_signal(signal.SIGCONT)
            p.terminate()
        for p in procs.values():
            p.wait(30)
        # every client is gone: nothing may stay pinned (watched ones at once, unwatched ones
        # after the heartbeat)
        with Client(ep) as c:
            t0 = time.time()
            while c.stats()["pinned"] and time.time() - t0 < 10:
                time.sleep(0.2)
            st = c.stats()
        assert st["pinned"] == 0, st["clients"]
    except ClientError:
        raise
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
        stop_daemon(d)
    wrong, verified, invalid, c_verified = [], 0, 0, 0
    import json
    for out in outs:
        if not out.exists():
            continue
        for line in out.read_text().splitlines():
            if line.startswith("WRONG"):
                wrong.append((out.name, line))
            elif line.startswith("DONE"):
                n = json.loads(line[5:])
                verified += n["verified_parts"]
                invalid += n["invalid_seen"]
                if "fast" in n:
                    c_verified += n["verified_parts"]
    print(f"soak {SOAK_S:.0f}s: {events}, {verified} parts verified ({c_verified} by C clients), "
          f"{invalid} invalid leases detected, {len(wrong)} wrong")
    assert not wrong, wrong[:10]
    assert verified > 100, "the soak read too little to mean anything"
    assert cw is None or c_verified > 0, "the C workers verified nothing"
    assert events["client_stalls"] and events["client_kills"]
