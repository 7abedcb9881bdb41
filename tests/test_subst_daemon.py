"""Substitution decided at the cache: an acquire carrying the router's candidates may be granted
a resident candidate in place of a missing expert. The daemon's counts equal the simulator's
(``moecache-ctl policy --subst``, same rule, same eviction code) on a deterministic replay,
the bytes served for a substitute are the substitute's, and bad ``subst`` fields get one-line
errors."""
import msgpack
import numpy as np
import pytest
import zmq

from moecached.tools import simulate as sim
from moecached.tools import simsubst
from moecached.tools.policycli import main as policy_main
from moecached.engine.trace import Trace, load_trace, save_trace
from moecache_client import Client, Subst

from daemon_util import Daemon
from fixtures import file_bytes

pytestmark = pytest.mark.usefixtures("hot_path")

E, L, K = 8, 4, 4          # top-4: ranks 1-2 routed, ranks 3-4 candidates


def weighted_trace(seed, T=120, hot=0.5):
    rng = np.random.default_rng(seed)
    ex = np.empty((T, L, K), np.int16)
    for t in range(T):
        for l in range(L):
            ex[t, l] = ex[t - 1, l] if t and rng.random() < hot else rng.choice(E, K, False)
    w = -np.sort(-rng.random((T, L, K)), axis=2).astype(np.float32)
    return Trace(experts=ex, is_prompt=np.zeros(T, bool), weights=w, meta={"n_experts": E})


def replay(c, idx, t, r, cap, subst=True):
    """Drive the trace token by token, layer by layer: acquire the routed experts (with their
    candidates when ``subst``), check each substitute's bytes, release. Returns (hits,
    substituted, accesses) and the per-layer substitutions seen in replies."""
    layers = c.expert_layers
    h = K // 2
    hits = subs = acc = 0
    per_layer = {}
    checked = 0
    for tok in range(t.n_tokens):
        for l in range(L):
            ex = [int(e) for e in t.experts[tok, l]]
            ws = [float(x) for x in t.weights[tok, l]]
            routed, scores = ex[:h], ws[:h]
            cands = [(e, x) for e, x in zip(ex[h:], ws[h:]) if e not in routed]
            s = Subst(r, cap, {layers[l]: (scores, cands)}) if subst else None
            lease = c.acquire(layers[l], routed, subst=s)
            try:
                served = [e for _, e, _, _ in lease.items]
                for layer, missing, sub in lease.substituted:
                    assert layer == layers[l] and missing in routed and sub in dict(cands)
                    assert served[routed.index(missing)] == sub
                    per_layer[layer] = per_layer.get(layer, 0) + 1
                    if checked < 6:      # the bytes served are the substitute's own
                        want = file_bytes(idx, layer, sub)
                        assert {p: bytes(v) for p, v in lease.parts(sub).items()} == want
                        assert want != file_bytes(idx, layer, missing)
                        checked += 1
                assert sorted(set(served) - set(routed)) == sorted(x[2] for x in lease.substituted)
                assert lease.hits + lease.prefetch_hits + lease.misses + len(lease.substituted) \
                    == len(routed)
                hits += lease.hits
                subs += len(lease.substituted)
                acc += len(routed)
            finally:
                lease.release()
    return (hits, subs, acc), per_layer


@pytest.mark.parametrize("eviction,policy,sim_policy", [
    ("lfu-subst", "per-layer", "lfu-subst"),
    ("lru", "global", "g-lru"),
])
@pytest.mark.parametrize("r,cap", [(0.5, 1), (0.3, None)])
def test_daemon_substitution_equals_simulator(model_factory, tmp_path, monkeypatch, eviction,
                                              policy, sim_policy, r, cap):
    t = weighted_trace(3)
    slots = 3 * L                        # three slots per layer: eviction has a choice
    path = model_factory("qwen3-30b-a3b-Q4_K_M", layers=L, experts=E)
    with Daemon(path, tmp_path, slots=slots, policy=policy, eviction=eviction) as d:
        with Client(d.endpoint, name="subst") as c:
            got, per_layer = replay(c, d.idx, t, r, cap)
            st = c.stats()
    v = simsubst.subst_view(t, warmup=0)
    want = simsubst.simulate_subst(v, sim_policy, slots, r, -1 if cap is None else cap)
    assert got == (want["hits"], want["substituted"], want["accesses"])
    assert want["substituted"] > 0
    # counted per layer and per client, the way the other counters are
    assert st["substitutions"] == want["substituted"]
    assert {int(k): x["substitutions"] for k, x in st["layers"].items() if x["substitutions"]} \
        == per_layer
    mine = [x for x in st["clients"] if x["name"] == "subst"][0]
    assert {int(k): n for k, n in mine["substitutions_by_layer"].items()} == per_layer
    assert mine["substitutions"] == want["substituted"]
    assert st["hits"] + st["prefetch_hits"] + st["demand_misses"] + st["substitutions"] \
        == want["accesses"]
    if eviction == "lfu-subst":          # the candidates' credits are part of what matched
        import moecached.engine.policy as mp
        monkeypatch.setitem(mp.EVICTIONS, "lfu-subst",
                            lambda n: mp.LFUDecay(n, mp.LFU_SUBST_HALVE_AFTER, mp.LFU_SUBST_USE, 0))
        other = simsubst.simulate_subst(v, sim_policy, slots, r, -1 if cap is None else cap)
        assert (other["hits"], other["substituted"]) != (want["hits"], want["substituted"])


def test_no_candidates_changes_nothing(model_factory, tmp_path):
    """Without candidates the daemon's hits are plain lfu-subst's (no credits, no swaps)."""
    t = weighted_trace(4)
    slots = 3 * L
    path = model_factory("qwen3-30b-a3b-Q4_K_M", layers=L, experts=E)
    with Daemon(path, tmp_path, slots=slots, policy="per-layer", eviction="lfu-subst") as d:
        with Client(d.endpoint, name="plain") as c:
            got, _ = replay(c, d.idx, t, 0.5, 1, subst=False)
            st = c.stats()
    v = simsubst.subst_view(t, warmup=0)
    plain = sim.simulate(v.trace, "lfu-subst", slots, warmup=0)
    assert got == (plain["hits"], 0, plain["accesses"]) and st["substitutions"] == 0
    assert simsubst.simulate_subst(v, "lfu-subst", slots, 0.5, 1)["hits"] != plain["hits"]


def raw(endpoint, msg):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    s.send(msgpack.packb(dict({"v": 1, "id": 7}, **msg)))
    assert s.poll(5000), "daemon did not answer"
    rep = msgpack.unpackb(s.recv(), raw=False)
    s.close()
    return rep


@pytest.mark.parametrize("subst,code,text", [
    ("x", "bad_type", "field 'subst'"),
    ({"r": 1.5, "layers": []}, "bad_type", "subst.r"),
    ({"r": 0.5, "cap": -1, "layers": []}, "bad_type", "subst.cap"),
    ({"r": 0.5, "layers": [[99, [1.0], []]]}, "out_of_range", "layer 99"),
    ({"r": 0.5, "layers": [["x", [1.0, 0.5], []]]}, "out_of_range", "layer 'x'"),
    ({"r": 0.5, "layers": [["L", [1.0], []]]}, "bad_type", "1 scores for 2 experts"),
    ({"r": 0.5, "layers": [["L", [1.0, 0.5], [[1, 0.4]]]]}, "bad_type", "candidate 1"),
    ({"r": 0.5, "layers": [["L", [1.0, 0.5], [[9, 0.4]]]]}, "out_of_range", "candidate 9"),
    ({"r": 0.5, "layers": [["L", [1.0, float("nan")], []]]}, "bad_type", "finite number"),
    ({"r": 0.5, "layers": [["L", [1.0, 0.5], [[3, 0.4], [3, 0.2]]]]}, "bad_type", "each once"),
])
def test_bad_subst_field_is_a_one_line_error(model_factory, tmp_path, subst, code, text):
    path = model_factory("qwen3-30b-a3b-Q4_K_M", layers=L, experts=E)
    with Daemon(path, tmp_path, slots=2 * L) as d:
        layer = d.idx.expert_layers[0]
        if isinstance(subst, dict):
            subst = dict(subst, layers=[[layer if x[0] == "L" else x[0]] + x[1:]
                                        for x in subst["layers"]])
        rep = raw(d.endpoint, {"op": "acquire", "layer": layer, "experts": [1, 2],
                               "subst": subst})
        assert rep["ok"] is False and rep["error"]["code"] == code, rep
        assert text in rep["error"]["message"] and "\n" not in rep["error"]["message"]
        ok = raw(d.endpoint, {"op": "acquire", "layer": layer, "experts": [1, 2]})
        assert ok["ok"] is True                     # the daemon goes on serving


def test_client_subst_arguments_checked():
    with pytest.raises(Exception, match="r"):
        Subst(2.0, 1, {})
    with pytest.raises(Exception, match="cap"):
        Subst(0.5, -1, {})
    assert Subst(0.5, None, {3: ([0.6], [(4, 0.3)])}).wire() == \
        {"r": 0.5, "layers": [[3, [0.6], [[4, 0.3]]]]}


def test_recorded_trace_keeps_the_offered_scores_and_candidates(model_factory, tmp_path):
    """A trace recorded while a client acquires with ``subst`` holds the scores and candidates
    the client sent, and the experts routed (not the substitutes granted). The client takes
    no shared-memory fast path: an acquire pinned there reaches the daemon without its offer."""
    t = weighted_trace(3, T=30)
    out = str(tmp_path / "rec.npz")
    path = model_factory("qwen3-30b-a3b-Q4_K_M", layers=L, experts=E)
    h = K // 2
    sent = []                                        # (routed, scores, cands) per token-layer
    with Daemon(path, tmp_path, slots=3 * L, policy="per-layer", eviction="lfu-subst") as d:
        with Client(d.endpoint, name="subst", fast_path=False) as c:
            c.trace_start(out)
            layers = c.expert_layers
            swaps = 0
            for tok in range(t.n_tokens):
                for l in range(L):
                    ex = [int(e) for e in t.experts[tok, l]]
                    ws = [float(x) for x in t.weights[tok, l]]
                    cands = [(e, x) for e, x in zip(ex[h:], ws[h:])]
                    sent.append((ex[:h], ws[:h], cands))
                    lease = c.acquire(layers[l], ex[:h], tag="decode",
                                      subst=Subst(0.3, None, {layers[l]: (ws[:h], cands)}))
                    swaps += len(lease.substituted)
                    lease.release()
            c.trace_stop()
    assert swaps > 0                                 # substitutes were granted along the way
    rec = load_trace(out)
    assert rec.n_tokens == t.n_tokens and rec.n_layers == L
    for i, (routed, scores, cands) in enumerate(sent):
        tok, l = divmod(i, L)
        assert rec.experts[tok, l, :h].tolist() == routed and (rec.experts[tok, l, h:] == -1).all()
        assert rec.scores[tok, l, :h].tolist() == np.float32(scores).tolist()
        assert rec.candidates[tok, l].tolist() == [e for e, _ in cands]
        assert rec.candidate_scores[tok, l].tolist() == np.float32([x for _, x in cands]).tolist()


def test_simulator_uses_recorded_candidates():
    """One layer, 4 experts, 2 slots, g-lru, r = 0.5. Token 1 routes [2, 1] with recorded
    candidate 0 (score 0.9), resident since token 0 routed [0, 1]: the recorded view grants 0
    for 2 (1 swap, 1 hit). The top k/2 view routes [0] then [2] with candidate 1, never
    resident: no swap, no hit."""
    ex = np.array([[[0, 1]], [[2, 1]]], np.int16)
    t = Trace(experts=ex, is_prompt=np.zeros(2, bool), weights=np.float32([[[1, .5]], [[1, .5]]]),
              meta={"n_experts": 4})
    half = simsubst.simulate_subst(simsubst.subst_view(t, warmup=0), "g-lru", 2, 0.5)
    assert (half["hits"], half["substituted"], half["accesses"]) == (0, 0, 2)
    assert half["view"] == simsubst.SUBST_VIEW
    t.scores = np.ones((2, 1, 2), np.float32)
    t.candidates = np.array([[[-1]], [[0]]], np.int16)
    t.candidate_scores = np.float32([[[0]], [[0.9]]])
    v = simsubst.subst_view(t, warmup=0)
    got = simsubst.simulate_subst(v, "g-lru", 2, 0.5)
    assert (got["hits"], got["substituted"], got["accesses"]) == (1, 1, 4)
    assert got["view"] == v.view == simsubst.SUBST_VIEW_RECORDED and v.routed == 2
    low = simsubst.simulate_subst(v, "g-lru", 2, 0.95)       # 0.9 < 0.95 x 1: no swap
    assert (low["hits"], low["substituted"]) == (1, 0)


def test_simulator_cli_names_the_view(tmp_path, capsys):
    ex = np.array([[[0, 1]], [[2, 1]]], np.int16)
    base = dict(experts=ex, is_prompt=np.zeros(2, bool),
                weights=np.float32([[[1, .5]], [[1, .5]]]), meta={"n_experts": 4})
    save_trace(tmp_path / "half.npz", Trace(**base))
    save_trace(tmp_path / "rec.npz", Trace(**base, scores=np.ones((2, 1, 2), np.float32),
                                           candidates=np.array([[[-1]], [[0]]], np.int16),
                                           candidate_scores=np.float32([[[0]], [[0.9]]])))
    assert policy_main([str(tmp_path / "half.npz"), str(tmp_path / "rec.npz"), "--subst", "0.5",
                     "--sizes", "2", "--warmup", "0"]) == 0
    text = capsys.readouterr().out
    assert f"half.npz: substitution view: {simsubst.SUBST_VIEW}" in text
    assert f"rec.npz: substitution view: {simsubst.SUBST_VIEW_RECORDED}" in text
