"""Scan resistance: a decode workload with a prefill burst every 64 decode tokens (every expert
of every layer touched). With scan-resistant admission (``admit_cold = "prompt"``, the misses at
the cold end or at the probation point; or ``eviction = "slru"``) the daemon's decode hit rate
stays within 1 point of the burst-free trace's, while plain LRU loses more; the daemon's hits are
the simulator's (same eviction code, same admission) in every configuration."""
import numpy as np
import pytest

from moecached.tools import simulate as sim
from moecached.tools import simstream
from moecached.engine.trace import Trace
from moecache_client import Client

from daemon_util import Daemon

L, E, K = 2, 16, 2
SLOTS = 12                     # 6 of 16 experts per layer, one budget
EVERY = 64                     # decode tokens between prefill bursts


def decode_tokens(seed, n, ws=5, drift=0.02):
    """Decode routing with a drifting working set of ``ws`` experts per layer."""
    rng = np.random.default_rng(seed)
    hot = [list(rng.choice(E, ws, False)) for _ in range(L)]
    p = np.array([0.35, 0.25, 0.2, 0.12, 0.08])
    out = np.empty((n, L, K), np.int16)
    for t in range(n):
        for l in range(L):
            if rng.random() < drift:
                new = int(rng.integers(E))
                if new not in hot[l]:
                    hot[l][int(rng.integers(ws))] = new
            out[t, l] = rng.choice(hot[l], K, False, p=p)
    return out


def workload(seed=0, n_dec=640, burst=True) -> Trace:
    """Decode tokens; before every EVERY-th one (after the first) a prefill burst of E/K prompt
    tokens that together route every expert of every layer."""
    dec = decode_tokens(seed, n_dec)
    rows, prompt = [], []
    for i in range(n_dec):
        if burst and i and i % EVERY == 0:
            for j in range(E // K):
                rows.append(np.array([[j * K + x for x in range(K)]] * L, np.int16))
                prompt.append(True)
        rows.append(dec[i])
        prompt.append(False)
    return Trace(experts=np.stack(rows), is_prompt=np.array(prompt), meta={"n_experts": E})


def run_daemon(path, tmp_path, t, **cache_kw):
    """Acquire every token's experts layer by layer (prompt tokens tagged "prompt"); returns
    (decode hits, decode accesses)."""
    hits = acc = 0
    with Daemon(path, tmp_path, slots=SLOTS, **cache_kw) as d:
        with Client(d.endpoint, name="scan") as c:
            layers = c.expert_layers
            for tok in range(t.n_tokens):
                prompt = bool(t.is_prompt[tok])
                for l in range(L):
                    ex = [int(e) for e in t.experts[tok, l]]
                    lease = c.acquire(layers[l], ex, tag="prompt" if prompt else "decode")
                    if not prompt:
                        hits += lease.hits + lease.prefetch_hits
                        acc += len(ex)
                    lease.release()
    return hits, acc


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("qwen3-30b-a3b-Q4_K_M", layers=L, experts=E)


CONFIGS = {   # name -> (daemon cache options, simulator policy and options)
    "lru": ({}, ("g-lru", {})),
    "lru+cold": ({"admit_cold": "prompt"}, ("g-lru", {"admit_cold": "prompt"})),
    "lru+probation": ({"admit_cold": "prompt", "scan_admit": "probation"},
                      ("g-lru", {"admit_cold": "prompt", "scan_admit": "probation"})),
    "slru": ({"eviction": "slru"}, ("g-slru", {})),
    "slru+cold": ({"eviction": "slru", "admit_cold": "prompt"},
                  ("g-slru", {"admit_cold": "prompt"})),
}


@pytest.fixture(scope="module")
def burst_free(model, tmp_path_factory):
    """Decode hit rate of the burst-free trace, daemon == simulator, per eviction order."""
    t = workload(burst=False)
    out = {}
    for ev, pol in (("lru", "g-lru"), ("slru", "g-slru")):
        h, a = run_daemon(model, tmp_path_factory.mktemp("free"), t, eviction=ev)
        s = sim.simulate(t, pol, SLOTS)
        assert (h, a) == (s["hits"], s["accesses"])
        out[ev] = h / a
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_burst_daemon_equals_simulator_and_resists(model, tmp_path, burst_free, name):
    cache_kw, (pol, sim_kw) = CONFIGS[name]
    t = workload()
    h, a = run_daemon(model, tmp_path, t, **cache_kw)
    s = sim.simulate(t, pol, SLOTS, **sim_kw)
    assert (h, a) == (s["hits"], s["accesses"])          # daemon == simulator
    free = burst_free[cache_kw.get("eviction", "lru")]
    loss = (free - h / a) * 100
    if name == "lru":
        assert loss > 1.0, f"plain LRU should lose more than 1 point to the bursts, lost {loss:.2f}"
    else:
        assert loss <= 1.0, f"{name}: lost {loss:.2f} points to the bursts"


def test_probation_point_differs_from_cold_end():
    """The two admission points are different rules (the simulator tells them apart)."""
    t = workload()
    a = sim.simulate(t, "g-lru", SLOTS, admit_cold="prompt")
    b = sim.simulate(t, "g-lru", SLOTS, admit_cold="prompt", scan_admit="probation")
    assert a["hits"] != b["hits"]
    with pytest.raises(simstream.SimulationError, match="scan_admit"):
        sim.simulate(t, "g-lru", SLOTS, admit_cold="prompt", scan_admit="middle")
