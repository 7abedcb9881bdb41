"""A client process for the several-models tests: says hello naming its model, then per line
on stdin ``[[layer position, [experts]], ...]`` acquires each set in order (releasing each),
checks every leased byte against the synth stamps and answers one JSON line
``{"hits": H, "accesses": A, "bad": [...]}``; a line ``free`` instead runs freely through the
steps given as the JSON file argument (``--free STEPS.json RATE``), then prints the same line.

usage: python mix_client.py ENDPOINT MODEL SEED [--free STEPS.json TOKENS_PER_S]
(SEED -1: bytes not checked, for benchmarks/multi_model.py)
"""
import json
import sys
import time

from moecache_client import Client
from moecached.tools.synth import verify_expert_bytes


def run_step(c, L, sets, seed, bad):
    hits = acc = 0
    for li, ex in sets:
        with c.acquire(L[li], ex) as lease:
            acc += len(ex)
            hits += lease.hits + lease.prefetch_hits
            for e in (ex if seed >= 0 else ()):
                for part, view in lease.parts(e).items():
                    r = verify_expert_bytes(view, L[li], part, e, seed)
                    if r:
                        bad.append(f"layer {L[li]} expert {e} {part}: {r}")
    return hits, acc


def main():
    endpoint, model, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    c = Client(endpoint, model=model, name=f"mix-{model}", timeout=120)
    L = c.expert_layers
    bad = []
    if len(sys.argv) > 4 and sys.argv[4] == "--free":
        steps = json.load(open(sys.argv[5]))
        rate = float(sys.argv[6])
        H = A = Hc = Ac = errors = 0
        t0 = time.monotonic()
        for i, (sets, counted) in enumerate(steps):
            wait = t0 + i / rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                h, a = run_step(c, L, sets, seed, bad)
            except Exception as e:   # counted: the tests expect none
                errors += 1
                bad.append(f"step {i}: {type(e).__name__}: {e}")
                continue
            H, A = H + h, A + a
            if counted:
                Hc, Ac = Hc + h, Ac + a
        print(json.dumps({"hits": H, "accesses": A, "counted_hits": Hc, "counted_accesses": Ac,
                          "errors": errors, "bad": bad[:5], "n_bad": len(bad),
                          "wall_s": time.monotonic() - t0}), flush=True)
        c.close()
        return
    print(json.dumps({"ready": True, "endpoint": c.endpoint}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        h, a = run_step(c, L, json.loads(line), seed, bad)
        print(json.dumps({"hits": h, "accesses": a, "bad": bad[:5]}), flush=True)
        bad.clear()
    c.close()


if __name__ == "__main__":
    main()
