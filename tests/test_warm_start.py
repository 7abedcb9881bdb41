"""Warm starts: the resident set saved to a state file, read back at the next start in file
order; a state file of another model or a corrupt one is one log line and a cold start;
``moecache-ctl warm`` fills from the state file or a trace."""
import json
import os

import numpy as np
import pytest

from daemon_util import start_daemon, stop_daemon, wait_for
from fixtures import file_bytes
from moecache_client import Client
from moecached.engine.index import open_index
from moecached.engine.trace import Trace, save_trace
from moecached.engine.warmth import (StateError, load_state, model_identity, plan_fill,
                                     save_state)
from moecached.daemon.state import state_path


@pytest.fixture
def model(model_factory):
    # 4 blocks x 16 experts of real Qwen3-30B-A3B Q4_K_M sizes (two size classes)
    return model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 7, 8], experts=16)


def _start(model, tmp_path, sock="d.sock", *extra):
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    return start_daemon(model, str(tmp_path / sock), "--slots", "40", "--state-dir", str(state),
                        "--state-interval", "0", *extra)


def _resident(st) -> int:
    return sum(c["used"] for c in st["classes"])


def _check_bytes(c, idx, pairs):
    """Every expert of ``pairs`` is resident and its slot holds the file's bytes."""
    for layer, expert in pairs:
        with c.acquire(layer, [expert]) as lease:
            want = file_bytes(idx, layer, expert)
            for part, data in want.items():
                assert lease.part(expert, part).tobytes() == data, (layer, expert, part)


def _wait_warm(c, n, timeout=30.0):
    """Stats once ``n`` experts were warm-loaded and the fill ended (its clock stopped)."""
    import time
    wait_for(lambda: c.stats()["warm_loaded"] >= n, f"{n} experts warm-loaded", timeout)
    last = c.stats()["warm_seconds"]
    while True:
        time.sleep(0.1)
        st = c.stats()
        if st["warm_seconds"] == last:
            return st
        last = st["warm_seconds"]


@pytest.mark.daemon
def test_restart_round_trip(model, tmp_path):
    """Daemon A loads N experts and stops; daemon B on the same state dir comes back with the
    same resident set, counted in stats, each slot holding the file's bytes."""
    idx = open_index(model)
    layers = idx.expert_layers
    wanted = [(l, e) for e in (1, 4, 6, 9, 11, 14) for l in layers]
    ep = f"ipc://{tmp_path}/d.sock"
    a = _start(model, tmp_path)
    try:
        with Client(ep) as c:
            for layer, expert in wanted:
                c.acquire(layer, [expert]).release()
            before = c.stats()
    finally:
        out_a = stop_daemon(a)
    assert "saved 24 resident experts" in out_a, out_a
    (f,) = os.listdir(tmp_path / "state")
    st_file = load_state(str(tmp_path / "state" / f))
    assert set(st_file["experts"]) == set(wanted)
    assert st_file["experts"][0] == wanted[-1]          # hottest first
    b = _start(model, tmp_path)
    try:
        with Client(ep) as c:
            st = _wait_warm(c, len(wanted))
            assert st["warm_loaded"] == len(wanted) == st["warm_wanted"]
            assert st["warm_pending"] == 0                # the fill ended
            assert c._call({"op": "ping"})["warm_pending"] == 0   # what a C engine polls
            assert st["warm_bytes"] == sum(
                sum(s.nbytes for s in idx.parts(l, e)) for l, e in wanted)
            assert st["warm_seconds"] > 0
            assert _resident(st) == _resident(before) == len(wanted)
            assert st["demand_misses"] == 0
            _check_bytes(c, idx, wanted)
            assert c.stats()["demand_misses"] == 0       # every acquire above was a hit
    finally:
        out_b = stop_daemon(b)
    assert "warm start from state file" in out_b and "Traceback" not in out_b, out_b


@pytest.mark.daemon
def test_state_of_another_model_is_ignored(model, model_factory, tmp_path):
    """A state file written for another model identity (the file changed) is one log line and
    a cold start."""
    ep = f"ipc://{tmp_path}/d.sock"
    a = _start(model, tmp_path)
    try:
        with Client(ep) as c:
            c.acquire(c.expert_layers[0], [1, 2, 3]).release()
    finally:
        stop_daemon(a)
    (f,) = os.listdir(tmp_path / "state")
    path = tmp_path / "state" / f
    doc = json.loads(path.read_text())
    doc["identity"]["files"][0]["mtime_ns"] += 1          # as if the model had been rewritten
    doc["identity"]["fingerprint"] = "0" * 32
    path.write_text(json.dumps(doc))
    b = _start(model, tmp_path)
    try:
        with Client(ep) as c:
            st = c.stats()
            assert st["warm_loaded"] == 0 and _resident(st) == 0
    finally:
        out = stop_daemon(b)
    lines = [x for x in out.splitlines() if "is not this model's" in x]
    assert len(lines) == 1 and "starting cold" in lines[0], out
    assert "Traceback" not in out


@pytest.mark.daemon
@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "wrong-types"])
def test_corrupt_state_file_is_a_cold_start(model, tmp_path, damage):
    """A truncated or corrupt state file gives one log line and a cold start, never a crash."""
    ep = f"ipc://{tmp_path}/d.sock"
    state = tmp_path / "state"
    state.mkdir()
    path = state_path(str(state), ep, model)
    idx = open_index(model)
    good = json.dumps({"format": "moecached-warm", "version": 1, "identity": model_identity(idx),
                       "experts": [[idx.expert_layers[0], 1]]})
    text = {"truncated": good[:len(good) // 2], "garbage": "\x00\xff not json",
            "empty": "", "wrong-types": good.replace("[[", "[[\"x\", ")}[damage]
    with open(path, "w", errors="surrogateescape") as f:
        f.write(text)
    b = _start(model, tmp_path)
    try:
        with Client(ep) as c:
            st = c.stats()
            assert st["warm_loaded"] == 0 and _resident(st) == 0
            c.acquire(idx.expert_layers[0], [2]).release()     # serves as usual
    finally:
        out = stop_daemon(b)
    lines = [x for x in out.splitlines() if "starting cold" in x]
    assert len(lines) == 1 and path in lines[0], out
    assert "Traceback" not in out
    assert load_state(path)["experts"] == [(idx.expert_layers[0], 2)]   # rewritten at stop


@pytest.mark.daemon
def test_ctl_warm_from_trace_fills(model, tmp_path, capsys):
    """``moecache-ctl warm --from-trace`` loads the trace's experts in first-use order until
    the free slots are full; and ``warm`` alone fills from the state file."""
    from moecached.tools.ctl import main as ctl
    idx = open_index(model)
    rng = np.random.default_rng(1)
    T, L, k = 12, len(idx.expert_layers), 4
    ex = np.stack([np.stack([rng.permutation(16)[:k] for _ in range(L)]) for _ in range(T)])
    trace = str(tmp_path / "t.npz")
    save_trace(trace, Trace(experts=ex.astype(np.int16), is_prompt=np.zeros(T, bool),
                            meta={"n_experts": 16}))
    firsts = []
    for t in range(T):
        for li in range(L):
            for e in ex[t, li]:
                if (idx.expert_layers[li], int(e)) not in firsts:
                    firsts.append((idx.expert_layers[li], int(e)))
    ep = f"ipc://{tmp_path}/d.sock"
    d = _start(model, tmp_path)
    try:
        assert ctl(["warm", "--from-trace", trace, "-e", ep, "--json"]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        with Client(ep) as c:
            st = c.stats()
            resident = _resident(st)
            assert out["loaded"] == st["warm_loaded"] == resident == out["queued"] > 0
            assert out["wanted"] == len(firsts)
            slots = sum(x["slots"] for x in st["classes"])
            assert resident == min(slots, len(firsts)) or all(
                x["free"] == 0 for x in st["classes"] if x["used"] < x["slots"])
            assert st["evictions"] == 0 and st["demand_misses"] == 0
            _check_bytes(c, idx, firsts[:8])
            assert c.stats()["demand_misses"] == 0
        # a second warm while everything wanted is resident loads nothing
        assert ctl(["warm", "--from-trace", trace, "-e", ep, "--json"]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["queued"] == 0
    finally:
        stop_daemon(d)
    d = _start(model, tmp_path, "d.sock", "--state-dir", "")   # warm starts off: nothing read
    try:
        assert ctl(["warm", "-e", ep]) == 1
        assert "warm starts are off" in capsys.readouterr().err
    finally:
        stop_daemon(d)


def test_state_file_round_trip_and_refusals(tmp_path):
    """load_state reads what save_state wrote; anything else is one StateError line."""
    class Idx:
        files = [str(tmp_path / "m.gguf")]

        def fingerprint(self):
            return "f" * 32

        def file_facts(self):
            return [{"path": str(tmp_path / "m.gguf"), "size": 10, "mtime_ns": 20, "ctime_ns": 30,
                     "dev": 1, "ino": 2}]

    class Cache:
        index = Idx()
    p = str(tmp_path / "s.warm")
    assert save_state(p, Cache(), [(3, 1), (4, 2)]) == 2
    st = load_state(p)
    assert st["experts"] == [(3, 1), (4, 2)] and st["identity"] == model_identity(Idx())
    assert not [x for x in os.listdir(tmp_path) if x.endswith(".tmp")]
    for text in ["", "{", "[]", '{"format": "x"}', '{"format": "moecached-warm", "version": 9}',
                 '{"format": "moecached-warm", "version": 1, "identity": {"files": []}, '
                 '"experts": [[1, -2]]}']:
        with open(p, "w") as f:
            f.write(text)
        with pytest.raises(StateError) as e:
            load_state(p)
        assert "\n" not in str(e.value) and p in str(e.value)
    with pytest.raises(FileNotFoundError):
        load_state(str(tmp_path / "none.warm"))


def test_plan_is_in_file_order_and_fits_the_free_slots(model, tmp_path):
    """A fill loads the most wanted experts that fit each pool's free slots, in file order."""
    from moecached.engine.cache import ExpertCache
    idx = open_index(model)
    with ExpertCache(idx, slots=12, readers=2, lock_memory=False, arena_dir=str(tmp_path)) as cache:
        layers = idx.expert_layers
        wanted = [(layers[-1], 15), (layers[0], 9), (layers[0], 2), (layers[1], 4)] + \
            [(l, e) for l in reversed(layers) for e in range(16)]
        plan = plan_fill(cache, wanted)
        offs = [(idx.parts(l, e)[0].file, idx.parts(l, e)[0].offset) for l, e in plan]
        assert offs == sorted(offs)
        assert len(plan) == 12 - 0 and set(wanted[:4]) <= set(plan)


@pytest.mark.daemon
def test_several_models_each_come_back(model, model_factory, tmp_path):
    """With several models each has its own state file and comes back with its own experts;
    ``moecache-ctl warm --model NAME`` reaches the model's socket."""
    from moecached.tools.ctl import main as ctl
    # neither model fits its share whole (else a cold start reads it all)
    other = model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6], experts=64)
    state = tmp_path / "state"
    state.mkdir()
    sock = str(tmp_path / "d.sock")
    args = ["--budget", "200MiB", "--state-dir", str(state), "--state-interval", "0"]

    def start():
        import subprocess
        import sys
        p = subprocess.Popen([sys.executable, "-P", "-m", "moecached.daemon", "--model", f"a={model}",
                              "--model", f"b={other}", "--endpoint", f"ipc://{sock}",
                              "--no-lock-memory", "--arena-dir", str(tmp_path), *args],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def up():
            assert p.poll() is None, p.stdout.read()
            try:
                Client(f"ipc://{sock}", model="*", connect_timeout=1, map_arena=False).close()
                return True
            except Exception:
                return False
        wait_for(up, "the daemon of two models serving", 60)
        return p
    la, lb = open_index(model).expert_layers, open_index(other).expert_layers
    want = {"a": [(la[0], 1), (la[1], 2), (la[2], 3)], "b": [(lb[0], 4), (lb[1], 5)]}
    d = start()
    try:
        for name, pairs in want.items():
            with Client(f"ipc://{sock}", model=name) as c:
                for layer, expert in pairs:
                    c.acquire(layer, [expert]).release()
    finally:
        stop_daemon(d)
    assert len(os.listdir(state)) == 2
    d = start()
    try:
        for name, pairs in want.items():
            with Client(f"ipc://{sock}", model=name) as c:
                st = _wait_warm(c, len(pairs))
                assert st["warm_loaded"] == len(pairs) and _resident(st) == len(pairs)
                _check_bytes(c, open_index(model if name == "a" else other), pairs)
                assert c.stats()["demand_misses"] == 0
        assert ctl(["warm", "-e", f"ipc://{sock}", "--model", "b", "--json"]) == 0
    finally:
        out = stop_daemon(d)
    assert "Traceback" not in out, out


@pytest.mark.daemon
def test_periodic_save_survives_a_crash(model, tmp_path):
    """The state file is also written every state_interval_s: a daemon killed (no graceful
    stop) comes back with what it held at the last save."""
    import signal
    idx = open_index(model)
    l0, l1 = idx.expert_layers[:2]
    ep = f"ipc://{tmp_path}/d.sock"
    path = state_path(str(tmp_path / "state"), ep, model)
    a = start_daemon(model, str(tmp_path / "d.sock"), "--slots", "40", "--state-dir",
                     str(tmp_path / "state"), "--state-interval", "0.5")
    try:
        with Client(ep) as c:
            c.acquire(l0, [1, 5]).release()
            c.acquire(l1, [3]).release()
        wait_for(lambda: os.path.exists(path) and len(load_state(path)["experts"]) == 3,
                 "a periodic save of 3 experts", 20)
    finally:
        stop_daemon(a, sig=signal.SIGKILL)
    assert set(load_state(path)["experts"]) == {(l0, 1), (l0, 5), (l1, 3)}
    b = start_daemon(model, str(tmp_path / "d.sock"), "--slots", "40", "--state-dir",
                     str(tmp_path / "state"), "--state-interval", "0.5")
    try:
        with Client(ep) as c:
            st = _wait_warm(c, 3)
            assert st["warm_loaded"] == 3 and _resident(st) == 3
    finally:
        stop_daemon(b)


def test_fill_without_prefetch_loads_nothing_and_ends(model, tmp_path):
    """With prefetch off (max_prefetch_loads = 0) a fill cannot load at prefetch priority: it
    plans nothing, says why, and ends at once."""
    from moecached.engine.cache import ExpertCache
    from moecached.engine.warmth import WarmFill, counters_of
    idx = open_index(model)
    with ExpertCache(idx, slots=12, readers=2, lock_memory=False, arena_dir=str(tmp_path),
                     max_prefetch_loads=0) as cache:
        f = WarmFill(cache, [(idx.expert_layers[0], 1)]).start()
        assert f.join(5) and f.planned == 0 and "max_prefetch_loads = 0" in f.why_not
        assert counters_of(cache).running is None and counters_of(cache).loaded == 0


def test_fill_leaves_the_wanted_order_in_the_lru(model, tmp_path):
    """Loaded in file order, the filled experts end in the order they were wanted: the most
    wanted the least cold, the least wanted the next victim."""
    from moecached.engine.cache import ExpertCache
    from moecached.engine.warmth import WarmFill, resident_experts
    idx = open_index(model)
    layers = idx.expert_layers
    with ExpertCache(idx, slots=64, readers=2, lock_memory=False, arena_dir=str(tmp_path)) as cache:
        wanted = [(layers[3], 2), (layers[0], 9), (layers[2], 15), (layers[0], 1), (layers[1], 7)]
        f = WarmFill(cache, wanted).start()
        assert f.join(30) and f.done == len(wanted)
        got = [x for x in resident_experts(cache) if x in wanted]
        pools = {}
        for x in wanted:
            pools.setdefault(id(cache._layers[x[0]].pool), []).append(x)
        for xs in pools.values():   # recency order holds within each pool
            assert [x for x in got if x in xs] == xs, (got, xs)


def test_warm_is_an_admin_op(model_factory):
    """``warm`` changes what the daemon holds for everyone: an ordinary account in the socket's
    group is refused ``not_permitted``; an admin gets through (here a server without warm
    starts: ``refused``)."""
    from as_user import needs_root, run_as, shared_dir, temp_group, temp_user
    from daemon_util import Daemon
    from test_security import ask, code
    if needs_root.args[0]:
        pytest.skip(needs_root.kwargs["reason"])
    path = model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=8)
    with temp_group() as g, temp_group() as a, temp_user([g.gr_name]) as user, \
            temp_user([g.gr_name, a.gr_name]) as adm, shared_dir() as d:
        with Daemon(path, d, gid=g.gr_gid, heartbeat_s=30, admin_gid=a.gr_gid) as dm:
            msg = {"op": "warm", "experts": [[0, 1]]}
            (rep,) = run_as(user, ask, dm.endpoint, msg)
            assert code(rep) == "not_permitted" and rep["error"]["message"].startswith(
                "warm: not permitted"), rep
            (rep,) = run_as(adm, ask, dm.endpoint, msg)
            assert code(rep) == "refused" and "no warm starts" in rep["error"]["message"], rep
            assert dm.cache.stats()["warm_loaded"] == 0


@pytest.mark.daemon
def test_cold_daemon_whose_arena_holds_the_model_reads_it_whole(model, tmp_path):
    """Warm starts on but no state file yet: an arena with a slot for every expert is filled
    with the whole model in file order at start (as a memory-mapped engine's load reads its
    file), so the first engine pays no demand miss per expert; a smaller arena, or warm starts
    off, is left cold."""
    idx = open_index(model)
    everything = [(l, e) for l in idx.expert_layers for e in range(int(idx.n_experts))]
    ep = f"ipc://{tmp_path}/d.sock"
    (tmp_path / "state").mkdir()
    d = start_daemon(model, str(tmp_path / "d.sock"), "--slots", str(len(everything)),
                     "--state-dir", str(tmp_path / "state"))
    try:
        with Client(ep) as c:
            st = _wait_warm(c, len(everything))
            assert st["warm_loaded"] == len(everything) and _resident(st) == len(everything)
            _check_bytes(c, idx, everything[::5])
            assert c.stats()["demand_misses"] == 0
    finally:
        out = stop_daemon(d)
    assert "the whole model" in out and "Traceback" not in out, out
    for slots, state in ((len(everything) - 8, str(tmp_path / "state2")), (len(everything), "")):
        if state:
            os.mkdir(state)
        small = start_daemon(model, str(tmp_path / "s.sock"), "--slots", str(slots), "--state-dir", state)
        try:
            with Client(f"ipc://{tmp_path}/s.sock") as c:
                st = c.stats()
                assert st["warm_loaded"] == 0 and _resident(st) == 0, (slots, state)
        finally:
            stop_daemon(small)


def test_warm_pending_is_what_the_running_fill_has_left():
    """``warm_pending`` (what a C engine waits on at connect) is the running fill's planned less
    its loaded experts, and 0 when no fill runs."""
    import types
    from moecached.engine.warmth import WarmCounters
    from moecached.facts.stats import CACHE_STATS
    (row,) = [s for s in CACHE_STATS if s.key == "warm_pending"]
    cache = types.SimpleNamespace(warm=WarmCounters())
    assert row.value(cache) == 0
    fill = types.SimpleNamespace(planned=12, done=0, t0=None)
    cache.warm.running = fill
    seen = []
    for done in (0, 5, 12):
        fill.done = done
        seen.append(row.value(cache))
    assert seen == [12, 7, 0]
    cache.warm.running = None
    assert row.value(cache) == 0
    assert row.value(types.SimpleNamespace()) == 0        # a cache that never filled


def test_the_stop_line_tells_resident_from_still_to_load(monkeypatch, caplog):
    """Stopped during a fill, the daemon saves the resident experts and then what the fill had
    still to load; its line counts them apart (it said "saved 256 resident experts" with 74 in)."""
    import logging
    import types
    from moecached.daemon import state as st_mod
    monkeypatch.setattr(st_mod, "save_state", lambda path, cache, experts, model=None: len(experts))
    states = types.SimpleNamespace(saved={})
    experts = [(0, e) for e in range(256)]
    with caplog.at_level(logging.INFO, logger="moecached.warm"):
        st_mod.WarmStates._write(states, [("/s/m.warm", None, experts, "/m.gguf", 74)], "stop")
        st_mod.WarmStates._write(states, [("/s/n.warm", None, experts[:9], "/n.gguf", 9)], "stop")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["saved 74 resident experts and 182 a running warm fill had still to load to /s/m.warm (stop)",
                     "saved 9 resident experts to /s/n.warm (stop)"], lines
    assert states.saved == {"/s/m.warm": 256, "/s/n.warm": 9}
