"""The shared-budget split (``moecached.daemon.split``) and the simulator's ``--mix`` replay
(``moecached.tools.mixsim``): bounds, equal start, moves toward ghost hits, hysteresis, the
floor's total, add/remove; the mix replay with frozen shares equals the per-model g-lru
simulator; on two real traces of different models the shared split is within one point of
the best static split and no worse than the equal split."""
import pytest

from moecached.daemon.split import MIN_GAIN, Member, Split, SplitError, least_share
from moecached.tools import simulate as sim
from moecached.tools import simstream
from moecached.tools.policycli import main as policy_main
from moecached.tools.mixsim import MixModel, layout_index, replay_mix, run_mix
from moecached.engine.trace import load_trace

from fixtures import layout_path, trace_path

MiB = 1 << 20


def qwen_idx(layers=4):
    return layout_index(layout_path("qwen3-30b-a3b-Q4_K_M"), layers, 128)


def mix_idx(layers=2):
    return layout_index(layout_path("mixtral-8x7b-Q4_K_M"), layers, 8)


def members(**kw):
    q, m = qwen_idx(), mix_idx()
    return [Member("qwen", q, least_share(q, 8), **kw.get("qwen", {})),
            Member("mix", m, least_share(m, 2), **kw.get("mix", {}))]


def test_equal_start_by_weight_and_bounds():
    sp = Split(1024 * MiB, members(), step=0)
    assert sp.shares["qwen"] == sp.shares["mix"] == 512 * MiB
    sp = Split(1024 * MiB, members(qwen={"weight": 3.0}), step=0)
    # 768 MiB for qwen would leave mix below its minimum: mix gets exactly its minimum
    assert sp.shares["mix"] == sp.members["mix"].min_bytes
    assert sum(sp.shares.values()) <= 1024 * MiB
    big = Split(64 << 30, members(), step=0)   # more than both hold: each gets all its experts
    assert all(big.shares[n] == big.members[n].full_bytes for n in big.shares)
    with pytest.raises(SplitError, match="minimum shares"):
        Split(100 * MiB, members(), step=0)


def test_moves_toward_ghost_hits_within_bounds():
    sp = Split(2048 * MiB, members(), step=100 * MiB)
    before = dict(sp.shares)
    assert sp.rebalance({"qwen": 50, "mix": 0}) == ("mix", "qwen", 100 * MiB)
    assert sp.shares["qwen"] == before["qwen"] + 100 * MiB
    assert sp.rebalance({"qwen": 0, "mix": 0}) is None         # nothing to gain
    assert sp.rebalance({"qwen": 1, "mix": 0}) is None         # below MIN_GAIN
    assert MIN_GAIN > 1
    for _ in range(100):
        sp.rebalance({"qwen": 50, "mix": 0})
    # qwen holds every expert before mix reaches its minimum: a partial last step to the max
    assert sp.shares["qwen"] == sp.members["qwen"].max_bytes
    assert sp.shares["mix"] > sp.members["mix"].min_bytes
    assert sum(sp.shares.values()) == sum(before.values())


def test_remembered_loss_stops_oscillation():
    """A model shrunk one step whose lost step then shows as ghost hits is grown back once,
    and not shrunk again while that loss stays remembered (a plain ghost comparison would
    flip every period)."""
    sp = Split(2048 * MiB, members(), step=100 * MiB)
    s0 = dict(sp.shares)
    assert sp.rebalance({"qwen": 30, "mix": 0}) == ("mix", "qwen", 100 * MiB)
    # mix lost its step: now it counts ghost hits on it; qwen's next step gains less
    assert sp.rebalance({"qwen": 10, "mix": 40}) == ("qwen", "mix", 100 * MiB)
    assert sp.shares == s0
    # back where it was, mix counts no ghost hits; qwen wants its step again, but mix's
    # loss one step down is remembered (40 > 30 * 1.25): no move
    trail = []
    for _ in range(10):
        trail.append(sp.rebalance({"qwen": 30, "mix": 0}))
    assert trail == [None] * 10 and sp.shares == s0


def test_deterministic():
    def run():
        sp = Split(2048 * MiB, members(), step=64 * MiB)
        out = []
        for i in range(50):
            sp.rebalance({"qwen": (i * 7) % 13, "mix": (i * 5) % 11})
            out.append(dict(sp.shares))
        return out
    assert run() == run()


def test_total_scales_shares_and_add_remove():
    sp = Split(2048 * MiB, members(), step=0, shares={"qwen": 1536 * MiB, "mix": 512 * MiB})
    sp.set_total(1024 * MiB)    # the floor takes half: proportions kept within the bounds
    assert sp.shares["qwen"] == 768 * MiB and sp.shares["mix"] == 256 * MiB or \
        sp.shares["mix"] == sp.members["mix"].min_bytes
    assert sum(sp.shares.values()) <= 1024 * MiB
    with pytest.raises(SplitError):
        sp.set_total(50 * MiB)
    sp = Split(2048 * MiB, members()[:1], step=0)
    assert list(sp.shares) == ["qwen"]
    m = members()[1]
    sp.add(m)
    assert set(sp.shares) == {"qwen", "mix"} and sum(sp.shares.values()) <= 2048 * MiB
    assert sp.shares["mix"] >= m.min_bytes
    with pytest.raises(SplitError, match="already served"):
        sp.add(m)
    sp.remove("mix")
    assert list(sp.shares) == ["qwen"] and sp.shares["qwen"] <= 2048 * MiB


def test_replace_keeps_the_share_within_the_new_bounds():
    # a model's file re-indexed: the member with the new index keeps its share where it fits,
    # forgets what it learned; a minimum that no longer fits changes nothing
    sp = Split(1536 * MiB, members(), step=100 * MiB)
    for _ in range(3):
        sp.rebalance({"qwen": 50, "mix": 0})
    before = dict(sp.shares)
    assert sp.table["qwen"]
    q2 = qwen_idx(layers=2)                     # the new file has fewer layers: smaller max
    new = Member("qwen", q2, least_share(q2, 8))
    assert new.full_bytes < before["qwen"]
    shares = sp.replace(new)
    assert sp.members["qwen"] is new and sp.table["qwen"] == {}
    assert shares["qwen"] == new.full_bytes     # clamped to all its experts
    assert shares["mix"] >= before["mix"]       # what qwen no longer holds goes to mix
    assert sum(shares.values()) <= 1536 * MiB
    huge = Member("qwen", qwen_idx(), 1200 * MiB)   # its minimum leaves mix too little
    with pytest.raises(SplitError, match="minimum shares"):
        sp.replace(huge)
    assert sp.members["qwen"] is new and sp.shares == shares


def test_floor_round_trip_gives_every_share_back():
    """The floor shrinks the total and grows it back: every share is what it was, the shares
    add up to the total (no byte left to rounding), and a model that held all its experts holds
    them all again (one byte short of its full size is one slot fewer)."""
    q, m = qwen_idx(layers=2), mix_idx()
    ms = [Member("qwen", q, least_share(q, 8)), Member("mix", m, least_share(m, 2))]
    total = 2048 * MiB
    for shrunk in (1850000000, 1950515200, 1700000000, 1234567891):
        sp = Split(total, ms)
        before = dict(sp.shares)
        assert before["qwen"] == ms[0].full_bytes and sum(before.values()) == total
        sp.set_total(shrunk)
        assert sum(sp.shares.values()) == shrunk
        assert all(sp.shares[n] < before[n] for n in before)
        sp.set_total(shrunk - 1000)     # the floor often shrinks twice before it grows back
        sp.set_total(total)
        assert sp.shares == before, shrunk
        assert ms[0].slots(sp.shares["qwen"]) == ms[0].slots(ms[0].full_bytes)
    # a shrink deep enough to hold mix at its minimum does not move the split for good
    sp = Split(1024 * MiB, ms)
    before = dict(sp.shares)
    sp.set_total(600 * MiB)
    assert sp.shares["mix"] == ms[1].min_bytes
    sp.set_total(1024 * MiB)
    assert sp.shares == before


def _mix_models(q_tokens=800):
    q = load_trace(trace_path("qwen3_30b_a3b_sharegpt_prefill_2050.npz")).window(0, q_tokens, layers=4)
    m = load_trace(trace_path("mixtral8x7b_humaneval0_full.npz")).window(0, None, layers=2)
    return [MixModel("qwen", q, qwen_idx()), MixModel("mix", m, mix_idx())]


def test_frozen_shares_equal_the_per_model_simulator():
    """With frozen shares each model's hits in the interleaved replay are the g-lru simulator's
    on its own trace at its slots (interleaving cannot matter: separate caches)."""
    mms = _mix_models(600)
    sp = Split(1536 * MiB, [Member(x.name, x.index, least_share(x.index, x.trace.top_k))
                            for x in mms], step=0)
    r = replay_mix(mms, 1536 * MiB, dynamic=False)
    for x in mms:
        slots = sp.members[x.name].slots(sp.shares[x.name])
        assert len(slots) == 1
        g = sim.simulate(x.trace, "g-lru", int(next(iter(slots.values()))))
        got = r["models"][x.name]
        assert (got["hits"], got["accesses"]) == (g["hits"], g["accesses"]), x.name
        assert got["ghost_hits"] == 0   # frozen: no ghost list


@pytest.mark.parametrize("gib", [1, 2])
def test_shared_within_a_point_of_best_static_and_not_below_equal(gib):
    out = run_mix(_mix_models(1200), gib << 30, points=9)
    best, eq, shared = out["best_static"], out["equal"], out["shared"]
    assert shared["hit_rate"] >= best["hit_rate"] - 0.01, (shared["shares"], best["shares"])
    assert shared["hit_rate"] >= eq["hit_rate"]
    assert shared["moves"] >= 1   # the equal split is not the best here: it had to move


def test_mix_cli(capsys, tmp_path):
    mms = _mix_models(400)
    paths = []
    for x in mms:
        p = tmp_path / f"{x.name}.npz"
        from moecached.engine.trace import save_trace
        save_trace(p, x.trace)
        paths.append(str(p))
    rc = policy_main(["--mix", ",".join(paths), "--names", "qwen,mix", "--budget", "1GiB",
                   "--layouts", layout_path("qwen3-30b-a3b-Q4_K_M") + ","
                   + layout_path("mixtral-8x7b-Q4_K_M")])
    out = capsys.readouterr().out
    assert rc == 0 and "shared (final" in out and "equal" in out and "static (best)" in out
    with pytest.raises(simstream.SimulationError, match="--budget"):
        policy_main(["--mix", ",".join(paths)])
    with pytest.raises(simstream.SimulationError, match="--rates: found 1 entries, expected 2"):
        policy_main(["--mix", ",".join(paths), "--budget", "1GiB", "--rates", "1",
                  "--layouts", "a,b"])
