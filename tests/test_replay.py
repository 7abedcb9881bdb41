"""Replay against a live daemon: with prefetch off its hits are exactly the simulator's g-lru
(same tokens, warm-up, slots per size class; also through ``tokens=``, the CLI's ``--tokens``)
and the daemon-LRU reference's; plan() windows; prefetch counting."""

import numpy as np
import re

import pytest

from moecached.tools.replay import replay
from moecached.tools.replayplan import ReplayError, parse_predictor, plan, reference_lru
from moecached.tools.simulate import simulate
from moecached.engine.trace import load_trace

from fixtures import make_model, trace_path


def qwen_trace(name="qwen3_30b_a3b_sharegpt_prefill_2080.npz"):
    return load_trace(trace_path(name))


def sliced(t, layers, tokens):
    return t.window(0, tokens, layers=layers)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("replay"), "qwen3-30b-a3b-Q4_K_M", layers=2,
                      experts=128)


@pytest.fixture()
def daemon(model, tmp_path):
    from moecached.tools.demo import Daemon
    made = []

    def start(slots, args=()):
        d = Daemon(model, str(tmp_path), slots=slots, lock=False, readers=8,
                   name=f"d{len(made)}", args=args)
        made.append(d)
        return d, d.connect(timeout=60)

    yield start
    for d in made:
        d.stop()


@pytest.mark.parametrize("frac", [0.25, 0.5])
def test_prefetch_off_matches_reference_and_simulator(daemon, frac):
    t = sliced(qwen_trace(), 2, 200)
    slots = int(frac * 128) * 2
    d, c = daemon(slots)
    try:
        r = replay(c, t, warm_tokens=40, tokens=160, lookahead=0, overhead_tokens=5)
    finally:
        c.close()
    s = r["sim"]
    assert r["counted_tokens"] == 160 and r["warm_tokens"] == 40
    assert r["accesses"] == 160 * 2 * 8
    assert r["hits"] + r["demand_misses"] == r["accesses"] and r["prefetch_hits"] == 0
    assert r["slots"] == slots and s["slots_match"], (r["class_slots"], s["glru_class_caps"])
    # the daemon's counters agree with the lease replies
    assert r["daemon"]["hits"] == r["hits"] and r["daemon"]["demand_misses"] == r["demand_misses"]
    # exact: the simulator (moecache-ctl policy's g-lru) on the same window, warm-up and slots
    assert s["daemon_equals_simulator"]
    assert (r["hits"], r["accesses"]) == (s["glru_hits"], s["glru_accesses"])
    # ... also as the CLI computes it: the whole trace, --warmup 40 --tokens 160
    g = simulate(t, "g-lru", slots, warmup=40, tokens=160)
    assert (g["hits"], g["accesses"], g["counted_tokens"]) == (r["hits"], r["accesses"], 160)
    assert g["hit_rate"] == r["hit_rate"]
    # and the daemon's LRU run offline over the same requests (second, independent model)
    assert s["daemon_equals_reference"]
    assert (r["hits"], r["accesses"]) == (s["reference_hits"], s["reference_accesses"])
    assert r["overhead_all_hits"] and r["overhead_ms_per_token"] > 0
    assert 0 < r["hit_rate"] < 1 and r["bytes_read"] >= r["demand_misses"] * 3_000_000


def test_cold_admission_daemon_equals_simulator(daemon):
    """admit_cold = 7: every acquire of 8 experts loads its misses at the LRU's cold end; the
    daemon's hits are the simulator's g-lru with admit_cold=7 on the same window, and differ
    from plain g-lru (so the admission rule is really applied on both sides)."""
    t = sliced(qwen_trace(), 2, 200)
    slots = 64
    d, c = daemon(slots, ["--admit-cold", "7"])
    try:
        r = replay(c, t, warm_tokens=40, tokens=160, lookahead=0, overhead_tokens=0)
    finally:
        c.close()
    g = simulate(t, "g-lru", slots, warmup=40, tokens=160, admit_cold=7)
    assert (r["hits"], r["accesses"]) == (g["hits"], g["accesses"])
    plain = simulate(t, "g-lru", slots, warmup=40, tokens=160)
    assert plain["hits"] != g["hits"]


@pytest.mark.parametrize("eviction, policy", [("lfu-decay", "g-lfu-decay"), ("slru", "g-slru")])
def test_eviction_daemon_equals_simulator(daemon, eviction, policy):
    """eviction = lfu-decay / slru: the daemon's hits are the simulator's g-lfu-decay / g-slru
    (the same LFUDecay / SLRU class) on the same window, and differ from g-lru."""
    t = sliced(qwen_trace(), 2, 200)
    slots = 64
    d, c = daemon(slots, ["--eviction", eviction])
    try:
        r = replay(c, t, warm_tokens=40, tokens=160, lookahead=0, overhead_tokens=0)
    finally:
        c.close()
    g = simulate(t, policy, slots, warmup=40, tokens=160)
    assert (r["hits"], r["accesses"]) == (g["hits"], g["accesses"])
    assert simulate(t, "g-lru", slots, warmup=40, tokens=160)["hits"] != g["hits"]


def test_reference_is_sensitive():
    """The exact check can fail: another capacity or another order gives other hits."""
    t = sliced(qwen_trace(), 2, 200)
    p = plan(t, 40, 160)
    from moecached.tools.replayplan import step_sets
    sets = step_sets(p.trace.experts, p.steps)
    h64, a = reference_lru(sets, p.counted, [0, 0], [64], 128)
    h63, _ = reference_lru(sets, p.counted, [0, 0], [63], 128)
    assert a == 160 * 16 and h63 < h64


def test_prefetch_oracle_counts(daemon):
    t = sliced(qwen_trace(), 2, 120)
    d, c = daemon(64)
    try:
        r = replay(c, t, warm_tokens=20, tokens=100, lookahead=2, predictor="oracle",
                   compute_ms=4.0, attn_frac=0.5, overhead_tokens=3)
    finally:
        c.close()
    assert "sim" not in r
    assert r["hits"] + r["prefetch_hits"] + r["demand_misses"] == r["accesses"] == 1600
    # counted over the window: prefetches queued during warm-up for the first counted layers
    # (lookahead 2 x top-k at most) may be hit inside it, still loading when demanded
    assert r["prefetch_hits"] > 0 and r["prefetches"] + 2 * t.top_k >= r["prefetch_hits"]
    assert r["tok_s"] <= 1000 / 4.0 * 1.05  # compute time is waited


def test_plan_windows():
    t = qwen_trace()
    p = plan(t)
    assert p.sim_warmup == 256 and p.counted_tokens == t.n_tokens - 256 and "prefill" in p.note
    p = plan(t, 10, 5)
    assert (p.start, p.end, p.warm_tokens, p.counted_tokens) == (0, 15, 10, 5)
    assert simulate(t, "g-lru", 0.25, warmup=10, tokens=5)["counted_tokens"] == 5
    m = load_trace(trace_path("mixtral8x7b_humaneval0_full.npz"))
    p = plan(m, 20, 7)
    first = int(np.argmax(~m.is_prompt))
    assert (p.start, p.warm_tokens, p.counted_tokens) == (first - 20, 20, 7)
    # the simulator's --tokens window is replay's: same end, same counted tokens
    g = simulate(m, "g-lru", 0.5, tokens=7)
    assert g["counted_tokens"] == 7
    assert g["hits"] == simulate(m.window(0, p.end), "g-lru", 0.5)["hits"]
    with pytest.raises(ReplayError):
        plan(t, t.n_tokens, None)
    with pytest.raises(ReplayError):
        parse_predictor("noisy:2,1")
    assert parse_predictor("noisy:0.8,0.5") == ("noisy", 0.8, 0.5)


def test_layer_mismatch_refused(daemon):
    t = sliced(qwen_trace(), 3, 20)
    d, c = daemon(64)
    try:
        with pytest.raises(ReplayError, match="MoE layers"):
            replay(c, t, warm_tokens=5)
    finally:
        c.close()


# -- drive ceiling never below the achieved tok/s; -e short flag ---------------------------------

def _fake_result(gbps, src, bytes_read, wall, ct):
    from moecached.tools.replay import drive_ceiling
    tok, use, used_src = drive_ceiling(gbps, src, bytes_read, wall, ct)
    return {"label": "25%", "slots": 1, "experts_total": 4, "cache_fraction": 0.25,
            "arena_gib": 1.0, "model_expert_gib": 4.0, "counted_tokens": ct, "warm_tokens": 0,
            "tok_s": ct / wall, "stall_ms_per_token": 1.0, "acquire_ms_per_token": 1.0,
            "hits": 1, "accesses": 2, "prefetch_hits": 0, "demand_misses": 1,
            "prefetches": 0, "wasted_prefetches": 0, "bytes_per_token": bytes_read / ct,
            "bytes_read": bytes_read, "read_gbps": bytes_read / wall / 1e9, "read_latency": {},
            "gbps": gbps, "gbps_source": src, "drive_ceiling_tok_s": tok, "ceiling_gbps": use,
            "ceiling_gbps_source": used_src, "overhead_ms_per_token": 0.1,
            "overhead_us_per_acquire": 1.0, "note": "", "compute_ms": 0.0, "attn_frac": 0.3,
            "lookahead": 0}


def test_drive_ceiling_uses_achieved_bandwidth_when_the_probe_is_lower():
    from moecached.tools.replay import drive_ceiling, format_table
    # the tester's run: 200 MB/token, 21.24 tok/s achieved, a probe of 2.994 GB/s (14.97 tok/s)
    ct, bpt = 100, 200e6
    wall = ct / 21.24
    tok, use, src = drive_ceiling(2.994, "measured", ct * bpt, wall, ct)
    assert src == "achieved" and use == pytest.approx(4.248)
    assert tok >= ct / wall and tok == pytest.approx(21.24)
    r = _fake_result(2.994, "measured", ct * bpt, wall, ct)
    table = format_table([r])
    row = next(l for l in table.splitlines() if l.startswith("drive ceiling"))
    assert row.split()[5:] == ["21.24", "@4.25*"]
    assert "probe (2.99 GB/s, measured); * the run read faster" in " ".join(table.split())
    # a probe above the achieved bandwidth is used as such
    tok, use, src = drive_ceiling(6.0, "measured", ct * bpt, wall, ct)
    assert (use, src) == (6.0, "measured") and tok == pytest.approx(30.0)
    row = next(l for l in format_table([_fake_result(6.0, "measured", ct * bpt, wall, ct)])
               .splitlines() if l.startswith("drive ceiling"))
    assert row.split()[5:] == ["30.00", "@6.00"]
    # given bandwidth, nothing read, no bandwidth
    assert drive_ceiling(2.0, "given", 0, wall, ct) == (float("inf"), 2.0, "given")
    assert drive_ceiling(None, "given", ct * bpt, wall, ct) == (None, None, None)


@pytest.mark.parametrize("gbps", [0.1, 1.0, 3.7, 50.0])
@pytest.mark.parametrize("wall", [0.37, 1.0, 7.3])
def test_drive_ceiling_never_below_achieved(gbps, wall):
    from moecached.tools.replay import drive_ceiling
    ct, read = 97, 3.3e9
    tok, _, _ = drive_ceiling(gbps, "measured", read, wall, ct)
    assert tok >= ct / wall


def test_replay_has_short_endpoint_flag():
    from moecached.tools.replay import build_parser
    a = build_parser().parse_args(["t.npz", "-e", "tcp://127.0.0.1:5555"])
    assert a.endpoint == "tcp://127.0.0.1:5555"
    assert build_parser().parse_args(["t.npz", "--endpoint", "ipc:///x"]).endpoint == "ipc:///x"
    assert "--endpoint ENDPOINT, -e ENDPOINT" in build_parser().format_help()


def test_replay_while_tracing_records_only_the_trace_tokens(daemon, tmp_path):
    """While the daemon records a trace, replay skips its all-resident overhead probe, whose
    made-up tokens would otherwise enter the recording; the recording then holds exactly the
    replayed tokens, with their experts."""
    from moecached.engine.trace import load_trace as load
    t = sliced(qwen_trace(), 2, 60)
    d, c = daemon(128)
    out = tmp_path / "rec.npz"
    try:
        c.trace_start(str(out))
        r = replay(c, t, warm_tokens=10, tokens=30, lookahead=0, overhead_tokens=5)
        c.trace_stop()
    finally:
        c.close()
    assert r["overhead_ms_per_token"] is None and r["overhead_skipped"] == "the daemon is recording a trace"
    rec = load(out)
    assert rec.experts.shape[:2] == (40, 2)
    want = np.sort(t.experts[:40], axis=2)
    assert np.array_equal(np.sort(rec.experts, axis=2)[:, :, :want.shape[2]], want)


def test_table_fits_100_columns_and_explains_its_rows():
    """Three sizes side by side, long notes and title: no line over 100 columns; every row
    marked [n] has its explanation under the table."""
    from moecached.tools.replay import format_table
    ct, bpt = 100, 200e6
    rs = []
    for i, gb in enumerate((0.04, 0.2, 6.0)):
        r = _fake_result(gb, "measured", ct * bpt, ct / 21.24, ct)
        r["label"] = f"{25 * (i + 1)}% cache"
        r["note"] = "a long note about the warm-up tokens that were prefill only and how they were counted here"
        rs.append(r)
    table = format_table(rs, title="moecached demo: SYNTHETIC workload on a model with a long file name "
                                   "(48 MoE layers x 128 experts, 17.1 GiB of experts)")
    lines = table.splitlines()
    assert max(len(l) for l in lines) <= 100, max(lines, key=len)
    marks = {m for l in lines for m in re.findall(r"\[(\d)\]", l[:30])}
    assert marks and all(any(l.startswith(f"[{m}] ") for l in lines) for m in marks)
