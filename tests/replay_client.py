"""A client process for tests: replays a routing trace against a daemon and checks every
leased byte against the synth stamps. Prints one JSON line with its counts.

usage: python replay_client.py ENDPOINT TRACE NAME TOKENS SEED [HOLD_S]
"""
import json
import sys
import time


from moecache_client import Client
from moecached.tools.synth import verify_expert_bytes
from moecached.engine.trace import load_trace


def main():
    endpoint, trace, name, tokens, seed = sys.argv[1:6]
    hold = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
    tr = load_trace(trace)
    c = Client(endpoint, name=name, timeout=60)
    L = c.expert_layers
    bad, n, hits = [], 0, 0
    for t in range(min(int(tokens), tr.experts.shape[0])):
        for li in range(min(len(L), tr.experts.shape[1])):
            ex = [int(e) % c.n_experts for e in tr.experts[t, li] if e >= 0]
            ex = list(dict.fromkeys(ex))
            if not ex:
                continue
            with c.acquire(L[li], ex, tag="prompt" if tr.is_prompt[t] else "decode") as lease:
                n += len(ex)
                hits += lease.hits + lease.prefetch_hits
                for e in ex:
                    for part, view in lease.parts(e).items():
                        r = verify_expert_bytes(view, L[li], part, e, int(seed))
                        if r:
                            bad.append(f"layer {L[li]} expert {e} {part}: {r}")
                if hold:
                    time.sleep(hold)
    c.close()
    print(json.dumps({"name": name, "accesses": n, "hits": hits, "bad": bad[:5], "n_bad": len(bad)}))


if __name__ == "__main__":
    main()
