"""The patched llama.cpp's tier of experts in device memory (--moecached-vram, patches 0007 and
0008), on the CPU build.

With --moecached-vram SIZE|N% every engine keeps its own slot table of experts in a buffer of the
device that runs the MoE blocks. With the lookup on the host (--moecached-vram-lookup host, and
every prompt) the acquire op looks the router's experts up there, acquires only the ones missing,
copies their bytes from the arena into least recently used tier slots (through
ggml_backend_tensor_set_async) and the block's matmuls read the tier. With the lookup on the device
(device, and auto once decoded tokens find their experts in the tier) a table per
block maps the ids to tier slots in the graph, the host reads every block's routed ids once after
the graph, copies in what was missing and computes the same graph again. A CPU build puts the tier
in a CPU buffer of its own, the same code path: the logits must be the resident run's bytes, and
the tier's counters (mc-decode's ``vram`` line) must add up.

Needs the patched llama.cpp (clients/llama.cpp/build.sh); skipped with one line when it is not
built.
"""
from __future__ import annotations

import filecmp
import os
import re
import signal
import subprocess
import time

import pytest

from daemon_util import start_daemon, stop_daemon
from moecached.tools import engine_llama
from llama_util import BIN, MODEL, NEEDS_BUILD, Runner, across_restart, prompt
from moecache_client import Client
from moecached.engine.index import open_index
from moecached.tools.synth_runnable import write_runnable

pytestmark = NEEDS_BUILD
STEPS = 40
RUN = Runner(STEPS)
decode, served = RUN.decode, RUN.served


def parse_kv(stdout: str, head: str) -> dict:
    m = re.search(rf"^{head} (.*)$", stdout, re.M)
    assert m, f"no '{head}' line:\n{stdout[-1500:]}"
    return {k: int(v) if re.fullmatch(r"-?\d+", v) else v for k, v in (kv.split("=", 1) for kv in m.group(1).split())}


def vram(r) -> dict:
    return parse_kv(r.stdout, "vram")


def timing(r) -> dict:
    m = re.search(r"^timing prompt_tokens=(\d+) prompt_s=\S+ decode_tokens=(\d+)", r.stdout, re.M)
    assert m, r.stdout[-1500:]
    return {"prompt_tokens": int(m.group(1)), "decode_tokens": int(m.group(2))}


@pytest.fixture(scope="module")
def geometry():
    idx = open_index(str(MODEL)).to_json()
    assert len(idx["size_classes"]) == 1
    return {"blocks": len(idx["expert_layers"]), "experts": idx["n_experts"], "k": idx["top_k"],
            "slot_bytes": idx["size_classes"][0]["slot_bytes"]}


@pytest.fixture(scope="module")
def resident(tmp_path_factory):
    d = tmp_path_factory.mktemp("vram-ref")
    decode(MODEL, d / "resident.bin")
    return d / "resident.bin"


@pytest.mark.parametrize("lookup", ["host", "device"])
@pytest.mark.parametrize("share", ["10%", "25%", "50%", "100%"])
def test_tier_gives_the_resident_logits_and_its_counters_add_up(resident, geometry, tmp_path, share, lookup):
    """Half the experts in the arena; the tier at a share of the served experts, looked up on the
    host or on the device: the resident run's logits and those of the run without the tier, byte
    for byte. Every decoded token's block calls are hits or copies; bytes copied are whole
    experts; a prompt that can need more experts than the tier holds runs on the arena (one
    fallback per block it reaches). On the device, every decoded token whose blocks' experts fit
    in the tier at once (8 blocks x top-4 = 32: not 10 %) runs the device lookup, one read of the
    routed ids per pass, a pass more for each pass that missed."""
    g = geometry
    served_experts = g["blocks"] * g["experts"]
    arena_slots = served_experts // 2
    plain, _ = served(MODEL, tmp_path, "plain", arena_slots)
    r, st = served(MODEL, tmp_path, "tier", arena_slots, "--moecached-vram", share, "--moecached-vram-lookup", lookup)
    assert filecmp.cmp(resident, tmp_path / "plain.bin", shallow=False), "the run without the tier differs"
    assert filecmp.cmp(resident, tmp_path / "tier.bin", shallow=False), f"--moecached-vram {share}: logits differ"
    v, t = vram(r), timing(r)
    n = int(share[:-1]) * served_experts // 100
    assert v["slots"] == n and v["lookup"] == lookup, v
    assert v["vram_bytes"] >= n * g["slot_bytes"], v
    copies = v["misses"] + v["spec_copies"]
    assert v["misses"] > 0 and v["copied_bytes"] == copies * g["slot_bytes"], v
    assert v["invalidations"] == 0, v
    assert 0 < copies - v["evictions"] <= n, v                 # the slots filled, never more
    assert v["decode_hits"] + v["decode_misses"] == STEPS * g["blocks"] * g["k"], v
    assert v["decode_copied_bytes"] == (v["decode_misses"] + v["decode_spec_copies"]) * g["slot_bytes"], v
    device = lookup == "device" and n >= g["blocks"] * g["k"]
    assert v["device_ubatches"] == (STEPS if device else 0) and v["switches"] == 0, v
    assert v["reads"] == v["device_ubatches"] + v["reruns"], v
    assert v["reruns"] <= v["fill_syncs"] <= v["reruns"] * g["blocks"], v     # a wait per block filled
    assert v["decode_reruns"] == v["reruns"] and (v["reruns"] > 0) == device, v   # the tier starts empty
    if not device:
        assert v["spec_copies"] == 0, v
    prompt_fits = min(g["experts"], t["prompt_tokens"] * g["k"]) <= n
    # (the last block's FFN runs on the one token whose logits are output: it fits)
    assert v["fallbacks"] == (0 if prompt_fits else g["blocks"] - 1), (v, t)
    if share == "10%":
        assert v["evictions"] > 0 and not prompt_fits, v
    else:
        assert v["decode_hits"] > 0, v
    if share == "100%":
        # the prompt through the tier too; each expert copied once, the decode never acquires
        assert prompt_fits and v["evictions"] == 0 and v["misses"] <= served_experts, v
        eng = engine_llama.parse_stats(r.stdout)
        assert eng["acquires"] < engine_llama.parse_stats(plain.stdout)["acquires"], (eng, plain.stdout[-500:])


def test_device_lookup_of_a_full_tier_reads_once_per_token_and_runs_once(resident, geometry, tmp_path):
    """Every expert in the tier, looked up on the device: a second round of the same prompt and
    decode in the same process finds every expert its tokens route to in the tier, so it adds no
    pass, no fill, no acquire: one read of the routed ids per decoded token and nothing else."""
    g = geometry
    slots = g["blocks"] * g["experts"]
    one, _ = served(MODEL, tmp_path, "one", slots, "--moecached-vram", "100%", "--moecached-vram-lookup", "device")
    two, _ = served(MODEL, tmp_path, "two", slots, "--moecached-vram", "100%", "--moecached-vram-lookup", "device",
                    "--rounds", "2")
    assert filecmp.cmp(resident, tmp_path / "one.bin", shallow=False), "logits differ"
    assert filecmp.cmp(resident, tmp_path / "two.bin", shallow=False), "logits differ (first round)"
    v1, v2 = vram(one), vram(two)
    assert v1["device_ubatches"] == STEPS and v2["device_ubatches"] == 2 * STEPS, (v1, v2)
    assert v1["reruns"] > 0 and v2["reruns"] == v1["reruns"] and v2["fill_syncs"] == v1["fill_syncs"], (v1, v2)
    assert v2["reads"] == v1["reads"] + STEPS, (v1, v2)
    assert v2["evictions"] == 0 and v2["misses"] == v1["misses"] and v2["copied_bytes"] == v1["copied_bytes"], (v1, v2)
    e1, e2 = engine_llama.parse_stats(one.stdout), engine_llama.parse_stats(two.stdout)
    assert e2["acquires"] == e1["acquires"], (e1, e2)          # the second round asks the daemon nothing


@pytest.mark.parametrize("stage,share", [("next", "25%"), ("auto", "25%"), ("auto", "50%")])
def test_staging_knob_on_a_tier_that_reads_no_arena_in_place(resident, geometry, tmp_path, monkeypatch, stage, share):
    """LLAMA_MOECACHED_VRAM_STAGE where the arena is not read in place (a CPU build: the device
    lookup copies every miss): next gives the tier its staging slots and copies nothing ahead, the
    tables still name the tier's own slots (the resident logits, byte for byte); auto decides at
    load: next where a block's guess (twice the top-k) is at most 1 MiB and the tier holds less
    than a third of the experts, else off."""
    g = geometry
    monkeypatch.setenv("LLAMA_MOECACHED_VRAM_STAGE", stage)
    r, _ = served(MODEL, tmp_path, "stage", g["blocks"] * g["experts"], "--moecached-vram", share, "--moecached-vram-lookup", "device")
    assert filecmp.cmp(resident, tmp_path / "stage.bin", shallow=False), "logits differ"
    v = vram(r)
    small = g["slot_bytes"] * 2 * g["k"] <= 1 << 20
    want = "next" if stage == "next" or (small and share == "25%") else "off"
    assert v["stage"] == want and v["stage_width"] == (2 * g["k"] if want == "next" else 0), (v, g)
    assert v["stage_copies"] == v["stage_hits"] == v["stage_bytes"] == 0 and v["device_ubatches"] == STEPS, v


def _last_graph_ops(stderr: str) -> dict:
    """The op counts of the last graph ggml's scheduler split (GGML_SCHED_DEBUG=2): the decode step's."""
    from collections import Counter
    assert "## SPLIT #0:" in stderr, stderr[-1500:]
    return Counter(re.findall(r"node #\s*\d+ \(\s*(\w+)\)", stderr.rsplit("## SPLIT #0:", 1)[1]))


def test_device_lookup_leaves_no_host_op_in_the_decode_graph(geometry, tmp_path):
    """The decode step's graph (GGML_SCHED_DEBUG=2 prints it): with the host lookup every block has
    one acquire op (a CPU custom op: on a GPU a round trip; it gives its lease back once its copies
    are done, so no release op follows the matmuls); with the lookup on the device none, and per
    block one get_rows of its table and one copy into the routing record."""
    g = geometry
    sock = str(tmp_path / "d.sock")
    p = start_daemon(str(MODEL), sock, "--slots", str(g["blocks"] * g["experts"]))
    ops = {}
    try:
        for lookup in ("host", "device"):
            r = engine_llama.decode(BIN, str(MODEL), str(tmp_path / f"{lookup}.bin"), prompt=prompt(), steps=1,
                                    endpoint=f"ipc://{sock}", timeout=300,
                                    extra=("--moecached-vram", "100%", "--moecached-vram-lookup", lookup),
                                    env=dict(os.environ, GGML_SCHED_DEBUG="2"))
            assert r.returncode == 0, r.stderr[-2000:]
            ops[lookup] = _last_graph_ops(r.stderr)
            assert vram(r)["device_ubatches"] == (1 if lookup == "device" else 0), vram(r)
    finally:
        stop_daemon(p)
    host, dev = ops["host"], ops["device"]
    assert host["MAP_CUSTOM"] == g["blocks"] and host["MUL_MAT_ID"] == 3 * g["blocks"], host
    assert dev["MAP_CUSTOM"] == 0 and dev["MUL_MAT_ID"] == 3 * g["blocks"], dev
    assert dev["GET_ROWS"] == host["GET_ROWS"] + g["blocks"] and dev["CPY"] == host["CPY"] + g["blocks"], (host, dev)


def test_auto_lookup_goes_to_the_host_when_the_tier_churns(resident, geometry, tmp_path, monkeypatch):
    """A tier of exactly the experts one token needs (8 blocks x top-4 = 32 slots, 12.5 %) and
    random routing: nearly every decoded token on the device misses, evicts and runs again. auto
    started on the device (LLAMA_MOECACHED_VRAM_AUTO_START) sends the next tokens to the host lookup
    after a window of such tokens (a switch) and stays there (they keep copying); device keeps
    running them again; both give the resident logits."""
    g = geometry
    slots = g["blocks"] * g["experts"] // 2
    dev, _ = served(MODEL, tmp_path, "dev", slots, "--moecached-vram", "12.5%", "--moecached-vram-lookup", "device")
    monkeypatch.setenv("LLAMA_MOECACHED_VRAM_AUTO_START", "device")
    auto, _ = served(MODEL, tmp_path, "auto", slots, "--moecached-vram", "12.5%")
    assert filecmp.cmp(resident, tmp_path / "dev.bin", shallow=False), "device: logits differ"
    assert filecmp.cmp(resident, tmp_path / "auto.bin", shallow=False), "auto: logits differ"
    vd, va = vram(dev), vram(auto)
    assert vd["slots"] == g["blocks"] * g["k"], vd
    assert vd["device_ubatches"] == STEPS and vd["switches"] == 0 and vd["reruns"] >= STEPS // 2, vd
    assert vd["spec_copies"] > 0, vd                            # copies for a routing a later pass did not have
    assert va["lookup"] == "auto" and va["switches"] == 1 and 0 < va["device_ubatches"] < STEPS // 2, va
    assert va["reruns"] < vd["reruns"], (va, vd)
    assert va["decode_hits"] + va["decode_misses"] == STEPS * g["blocks"] * g["k"], va


def test_auto_lookup_starts_on_the_host_and_goes_to_the_device_once_tokens_hit(resident, geometry, tmp_path):
    """auto starts on the host lookup, where a token that misses costs its copies and no second
    pass: a tier too small for the routing (12.5 %) never leaves it (no token runs again), and a
    tier of every expert goes to the device once the decoded tokens stop copying (the first uses
    done), then reads the routed ids once per token; both give the resident logits."""
    g = geometry
    slots = g["blocks"] * g["experts"]
    small, _ = served(MODEL, tmp_path, "small", slots, "--moecached-vram", "12.5%")
    full, _ = served(MODEL, tmp_path, "full", slots, "--moecached-vram", "100%")
    for name in ("small", "full"):
        assert filecmp.cmp(resident, tmp_path / f"{name}.bin", shallow=False), f"{name}: logits differ"
    vs, vf = vram(small), vram(full)
    assert vs["lookup"] == "auto" and vs["switches"] == 0 and vs["device_ubatches"] == 0 and vs["reruns"] == 0, vs
    assert vs["decode_misses"] > 0, vs
    assert vf["switches"] == 1 and 0 < vf["device_ubatches"] < STEPS, vf
    assert vf["reads"] == vf["device_ubatches"] + vf["reruns"], vf


def test_two_engines_with_tiers_share_one_arena(resident, geometry, tmp_path):
    """Two engines (two processes) at once on one daemon holding every expert, each with its own
    tier of half the experts: each gets the resident run's logits and keeps its own tier (its own
    copies), and the arena reads each expert from the file once for both."""
    import threading
    g = geometry
    served_experts = g["blocks"] * g["experts"]
    sock = str(tmp_path / "two.sock")
    p = start_daemon(str(MODEL), sock, "--slots", str(served_experts))
    runs = {}
    try:
        def run(i):
            runs[i] = decode(MODEL, tmp_path / f"e{i}.bin", "--moecached-vram", "50%",
                             endpoint=f"ipc://{sock}", check=False)
        ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        with Client(f"ipc://{sock}", name="test", map_arena=False) as c:
            st = c.stats()
    finally:
        stop_daemon(p)
    for i in range(2):
        assert runs[i].returncode == 0, runs[i].stderr[-2000:]
        assert filecmp.cmp(resident, tmp_path / f"e{i}.bin", shallow=False), f"engine {i}: logits differ"
        v = vram(runs[i])
        assert v["slots"] == served_experts // 2 and v["misses"] > 0 and v["decode_hits"] > 0, v
        assert v["invalidations"] == 0, v
    # one copy in the arena: every expert read once at most, whichever engine asked first (both
    # engines waiting on one load count a miss each: the bytes read are what says it)
    resident = sum(c["used"] for c in st["classes"])
    assert 0 < resident <= served_experts and st["bytes_read"] == resident * g["slot_bytes"], st


def test_tier_larger_than_the_arena_with_prompt_waves(resident, geometry, tmp_path):
    """A daemon of top-k + 2 slots (the prompt runs in waves of experts on the arena) and a tier
    of half the experts, far larger than the arena: decode copies at most what one acquire
    holds; the same logits."""
    g = geometry
    r, st = served(MODEL, tmp_path, "tight", g["k"] + 2, "--moecached-vram", "50%")
    assert filecmp.cmp(resident, tmp_path / "tight.bin", shallow=False), "logits differ"
    eng, v = engine_llama.parse_stats(r.stdout), vram(r)
    assert eng["waves"] > 0, eng
    assert v["fallbacks"] == g["blocks"] - 1 and v["decode_hits"] > 0 and v["decode_misses"] > 0, v


def test_tier_by_size_and_with_two_size_classes(tmp_path):
    """A Q4_K_M model (two size classes, Q4_K and Q6_K down projections): the tier sized in
    bytes covers both classes; the resident run's logits."""
    q = BIN / "llama-quantize"
    if not q.exists():
        pytest.skip("no llama-quantize in the build")
    model = write_runnable(str(tmp_path / "q4.gguf"), arch="qwen3moe", blocks=4, experts=16, top_k=4, hidden=256,
                           expert_ff=256, quant="Q4_K_M", seed=3, quantize_bin=str(q))
    idx = open_index(model).to_json()
    assert len(idx["size_classes"]) == 2
    total = sum(len(c["layers"]) * idx["n_experts"] * c["slot_bytes"] for c in idx["size_classes"])
    decode(model, tmp_path / "resident.bin")
    r, _ = served(model, tmp_path, "tier", 4 * 16, "--moecached-vram", f"{total // 2}")
    assert filecmp.cmp(tmp_path / "resident.bin", tmp_path / "tier.bin", shallow=False), "logits differ"
    v = vram(r)
    want = sum(int(0.5 * len(c["layers"]) * idx["n_experts"] + 1e-9) for c in idx["size_classes"])
    assert abs(v["slots"] - want) <= 2 and v["misses"] > 0 and v["decode_hits"] > 0, (v, want)


def test_tier_with_substitution_and_prefetch(resident, geometry, tmp_path):
    """Substitution: the daemon decides on what its arena holds, the tier only moves the bytes: the
    same substitutions and logits as without the tier. Prefetch: the resident run's logits."""
    g = geometry
    slots = g["blocks"] * g["experts"] // 2
    subst = ["--moecached-subst", "0.5", "--moecached-subst-cap", "1"]
    r0, st0 = served(MODEL, tmp_path, "subst", slots, *subst)
    r1, st1 = served(MODEL, tmp_path, "subst_tier", slots, *subst, "--moecached-vram", "25%")
    assert st0["substitutions"] > 0, st0
    assert st1["substitutions"] == st0["substitutions"], (st0["substitutions"], st1["substitutions"])
    assert filecmp.cmp(tmp_path / "subst.bin", tmp_path / "subst_tier.bin", shallow=False), "substituted logits differ"
    assert vram(r1)["decode_misses"] > 0 and vram(r1)["decode_hits"] > 0, vram(r1)
    r2, st2 = served(MODEL, tmp_path, "pf_tier", slots, "--moecached-prefetch", "next", "--moecached-vram", "25%")
    assert filecmp.cmp(resident, tmp_path / "pf_tier.bin", shallow=False), "prefetch + tier: logits differ"
    assert parse_kv(r2.stdout, "prefetch")["calls"] > 0 and st2["prefetches"] > 0


def _restarted_under_the_tier(tmp_path, *tier):
    """Decode with ``tier`` flags (a tier small enough that tokens keep acquiring) while the
    daemon is restarted once; an error, or the resident logits with the restart and the tier's
    invalidation counted. Returns mc-decode's ``vram`` line (None after an error)."""
    text = "Experts in shared memory, served to every engine."
    model = write_runnable(str(tmp_path / "f32.gguf"), arch="qwen3moe", blocks=2, experts=16, top_k=4, quant="f32", seed=1)
    decode(model, tmp_path / "resident.bin", text=text)
    sock = str(tmp_path / "d.sock")
    p = start_daemon(model, sock, "--slots", "12")
    cmd = [str(BIN / "mc-decode"), "-m", model, "-p", text, "-n", str(STEPS), "-t", "2", "--dump", str(tmp_path / "out.bin"),
           "--moecached", f"ipc://{sock}", *tier, "--step-delay-ms", "50", "--retries", "40"]

    def under_way(eng):
        time.sleep(1.0)
        assert eng.poll() is None, "the engine finished before the restart: make the decode longer"
    rc, out, err = across_restart(cmd, under_way, lambda: (stop_daemon(p), start_daemon(model, sock, "--slots", "12"))[1],
                                  timeout=300)
    ref = (tmp_path / "resident.bin").read_bytes()
    if rc != 0:
        assert "moecached error:" in err, err[-2000:]
        assert ref.startswith((tmp_path / "out.bin").read_bytes())
        return None
    assert (tmp_path / "out.bin").read_bytes() == ref, "wrong logits after a restart"
    st = engine_llama.parse_stats(out)
    v = parse_kv(out, "vram")
    assert st["restarts"] >= 1 and v["invalidations"] >= 1, (st, v)
    return v


def test_daemon_restart_with_the_tier_is_an_error_or_a_correct_continuation(tmp_path):
    """A tier of exactly top-k experts for two blocks: every block call copies, so every call
    acquires and sees the new daemon; the tier is then invalidated (what it holds came from the
    old arena) and the logits stay the resident run's."""
    v = _restarted_under_the_tier(tmp_path, "--moecached-vram", "12.5%")
    if v is not None:
        assert v["slots"] == 4 and v["evictions"] > 0, v


def test_daemon_restart_under_the_device_lookup_is_an_error_or_a_correct_continuation(tmp_path):
    """The device lookup with a tier of exactly what one token needs (2 blocks x top-4 of 2 x 16
    experts): tokens keep missing, so fills keep acquiring and one sees the new daemon; the tier is
    forgotten and the token's next pass fills it from the new arena; the resident logits."""
    v = _restarted_under_the_tier(tmp_path, "--moecached-vram", "25%", "--moecached-vram-lookup", "device")
    if v is not None:
        assert v["slots"] == 8 and v["device_ubatches"] >= STEPS and v["reruns"] > 0, v


def _killed_while_leases_held(tmp_path, text, steps, *lookup):
    """Decode ``text`` (``steps`` steps) with the whole model in the tier and every lease kept
    3 s (LLAMA_MOECACHED_HOLD_US); once the engine holds a fill's leases the daemon is killed and a new
    one started. Returns (rc, stdout, stderr, the resident logits, the engine's logits)."""
    model = write_runnable(str(tmp_path / "f32.gguf"), arch="qwen3moe", blocks=2, experts=16, top_k=4, quant="f32", seed=1)
    subprocess.run([str(BIN / "mc-decode"), "-m", model, "-p", text, "-n", str(steps), "-t", "2",
                    "--dump", str(tmp_path / "resident.bin")], check=True, capture_output=True, timeout=300)
    sock = str(tmp_path / "d.sock")
    p = start_daemon(model, sock, "--slots", "32")
    cmd = [str(BIN / "mc-decode"), "-m", model, "-p", text, "-n", str(steps), "-t", "2", "--dump", str(tmp_path / "out.bin"),
           "--moecached", f"ipc://{sock}", "--moecached-vram", "100%", *lookup, "--retries", "60"]

    def under_way(eng):
        with Client(f"ipc://{sock}", name="watcher", map_arena=False) as c:
            deadline = time.monotonic() + 120
            # more than one: the engine's check at attach holds one expert's lease for a moment;
            # a fill holds every expert it copied (at least top-k) for 3 s
            while c.stats()["leases"] < 2 and eng.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.stats()["leases"] >= 2, "the engine held no fill's leases in 120 s"
    rc, out, err = across_restart(cmd, under_way,
                                  lambda: (stop_daemon(p, sig=signal.SIGKILL), start_daemon(model, sock, "--slots", "32"))[1],
                                  env=dict(os.environ, LLAMA_MOECACHED_HOLD_US="3000000"))
    return rc, out, err, (tmp_path / "resident.bin").read_bytes(), (tmp_path / "out.bin").read_bytes()


@pytest.mark.slow
def test_lease_invalid_under_a_device_lookup_fill_discards_the_batch_and_the_retry_is_correct(tmp_path):
    """A prompt of a few tokens runs the device lookup too: its first pass misses every expert, the
    fill acquires them and keeps the leases 3 s (LLAMA_MOECACHED_HOLD_US) after the copies; the
    daemon is killed then, the leases read invalid, the batch is discarded and the tier forgotten,
    and the retry on a new daemon gives the resident logits."""
    steps = 2
    rc, out, err, ref, got = _killed_while_leases_held(tmp_path, "Hi", steps, "--moecached-vram-lookup", "device")
    assert rc == 0, err[-2000:]
    assert "copied into the tier (daemon restart" in err, err[-2000:]   # a batch was discarded, then retried
    assert got == ref, "wrong logits after a crash"
    v = parse_kv(out, "vram")
    assert v["invalidations"] >= 1 and v["fallbacks"] == 0 and v["device_ubatches"] >= steps + 1 and v["fill_syncs"] >= 1, v


@pytest.mark.slow
def test_lease_invalid_under_a_copy_invalidates_the_tier_and_the_retry_is_correct(tmp_path):
    """The whole model in the tier (the prompt goes through it too) and every lease kept 3 s
    (LLAMA_MOECACHED_HOLD_US): the daemon is killed while the engine holds the lease of experts it
    copied into the tier; the lease reads invalid (or the next acquire finds no daemon), the batch
    is discarded, the tier forgotten, and the retry on a new daemon gives the resident logits."""
    rc, out, err, ref, got = _killed_while_leases_held(tmp_path, "Experts in shared memory, served to every engine.", 2)
    assert rc == 0, err[-2000:]
    assert "moecached error:" in err, err[-2000:]          # a batch was discarded, then retried
    assert got == ref, "wrong logits after a crash"
    v = parse_kv(out, "vram")
    assert v["invalidations"] >= 1 and v["fallbacks"] == 0, v


@pytest.mark.parametrize("value,want", [("lots", "expected a size such as 8GiB"), ("-5", "expected a size such as 8GiB"),
                                        ("150%", "above 100%"), ("1%", "fewer than top-k 4")])
def test_bad_tier_size_is_one_line(geometry, tmp_path, value, want):
    sock = str(tmp_path / "d.sock")
    p = start_daemon(str(MODEL), sock, "--slots", "128")
    try:
        r = decode(MODEL, tmp_path / "out.bin", "--moecached-vram", value, endpoint=f"ipc://{sock}", check=False)
    finally:
        stop_daemon(p)
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.startswith("moecached:")]
    assert len(lines) == 1 and "--moecached-vram" in lines[0] and value in lines[0] and want in lines[0], r.stderr[-2000:]


@pytest.mark.parametrize("lookup,want", [("gpu", "expected auto"),
                                         # the in-place reads of the arena need the tier on a CUDA device
                                         ("arena", "not a CUDA device")])
def test_bad_tier_lookup_is_one_line(tmp_path, lookup, want):
    sock = str(tmp_path / "d.sock")
    p = start_daemon(str(MODEL), sock, "--slots", "128")
    try:
        r = decode(MODEL, tmp_path / "out.bin", "--moecached-vram", "50%", "--moecached-vram-lookup", lookup,
                   endpoint=f"ipc://{sock}", check=False)
    finally:
        stop_daemon(p)
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.startswith("moecached: --moecached-vram-lookup")]
    assert len(lines) == 1 and lookup in lines[0] and want in lines[0], r.stderr[-2000:]


@pytest.mark.parametrize("var,value,want", [("LLAMA_MOECACHED_VRAM_FILL", "soon", "expected later"),
                                            ("LLAMA_MOECACHED_VRAM_ADMIT", "lfu", "expected freq"),
                                            ("LLAMA_MOECACHED_VRAM_STAGE", "two", "expected auto"),
                                            ("LLAMA_MOECACHED_VRAM_STAGE_WIDTH", "8x", "expected the experts to copy ahead")])
def test_bad_arena_lookup_knob_is_one_line(tmp_path, monkeypatch, var, value, want):
    sock = str(tmp_path / "d.sock")
    p = start_daemon(str(MODEL), sock, "--slots", "128")
    monkeypatch.setenv(var, value)
    try:
        r = decode(MODEL, tmp_path / "out.bin", "--moecached-vram", "50%", endpoint=f"ipc://{sock}", check=False)
    finally:
        stop_daemon(p)
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.startswith("moecached:")]
    assert len(lines) == 1 and var in lines[0] and value in lines[0] and want in lines[0], r.stderr[-2000:]
