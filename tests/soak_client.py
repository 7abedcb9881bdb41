"""A client process for the soak test: acquires random experts until told to stop, reads every
part of every expert it holds, and checks the bytes against the model whenever its lease
still says ``valid()`` afterwards.

    python soak_client.py ENDPOINT OUT_FILE SEED [--unwatched]

Appends one line per wrong byte range to OUT_FILE at once (``WRONG layer expert part``), so a
SIGKILLed client's findings survive it, and a final ``DONE {json}`` line on SIGTERM.
``--unwatched`` hides the process start time from the daemon, so its leases expire after a
silence (as a remote client's would) instead of living as long as the process.
"""
import json
import random
import signal
import sys
import time

import numpy as np

import moecache_client
from moecache_client import Client, ClientError, LeaseInvalid
from moecached.tools.synth import verify_expert_bytes


def main() -> int:
    endpoint, out_path, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if "--unwatched" in sys.argv:
        moecache_client._own_start_time = lambda: None
    rng = random.Random(seed)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    out = open(out_path, "a", buffering=1)
    n = {"acquires": 0, "verified_parts": 0, "wrong": 0, "invalid_seen": 0, "errors": 0}
    c = None
    while not stop:
        try:
            if c is None:
                c = Client(endpoint, name=f"soak{seed}", timeout=5, connect_timeout=5)
            L = c.expert_layers
            layer = rng.choice(L)
            experts = rng.sample(range(c.n_experts), rng.randint(1, 4))
            lease = c.acquire(layer, experts)
            n["acquires"] += 1
            try:
                copies = {e: {p: np.array(v) for p, v in lease.parts(e).items()} for e in experts}
                if rng.random() < 0.2:
                    time.sleep(rng.random() * 0.05)   # hold it a while: stalls land here
                if lease.valid():
                    for e, parts in copies.items():
                        for p, v in parts.items():
                            n["verified_parts"] += 1
                            if verify_expert_bytes(v, layer, p, e, 0) is not None:
                                n["wrong"] += 1
                                out.write(f"WRONG {layer} {e} {p}\n")
                else:
                    n["invalid_seen"] += 1
            except LeaseInvalid:
                n["invalid_seen"] += 1
            lease.release()
        except ClientError:
            n["errors"] += 1
            time.sleep(0.05)
    out.write("DONE " + json.dumps(n) + "\n")
    out.close()
    if c is not None:
        c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
