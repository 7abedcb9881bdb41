"""The patched llama.cpp's GPU rungs on a CUDA build: the experts computed on the GPU over the
arena (``--moecached-gpu zerocopy``) and from a tier in VRAM (``--moecached-vram``, looked up per
block on the host or in the graph on the device, ``--moecached-vram-lookup``) give the logits of
the same build with every layer on the GPU, byte for byte (the same CUDA kernels over the same
bytes), with the arena holding every expert or half of them. The model is a random-weight one of 4
blocks x 32 experts, top-4, Q8_0, whose expert rows are whole chunks of 256 elements as zerocopy
needs (the trained model's down projections have rows of 64: zerocopy refuses it at start).

Runs where a CUDA build of the patched llama.cpp and an NVIDIA GPU are present:
``MOECACHED_LLAMA_CUDA_BIN`` names its bin directory (``benchmarks/gpu_hybrid.sh OUT build``
and the device kit's ``setup.sh cuda`` make one in /tmp/llama/build-cuda/bin). Skipped with one
line elsewhere; CI runs the same paths on the CPU build (tests/test_llama_engine.py,
tests/test_llama_vram.py).
"""
from __future__ import annotations

import filecmp
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from daemon_util import start_daemon, stop_daemon
from llama_util import Runner, across_restart, prompt
from moecached.tools.synth_runnable import write_runnable

CUDA_BIN = Path(os.environ["MOECACHED_LLAMA_CUDA_BIN"]) if os.environ.get("MOECACHED_LLAMA_CUDA_BIN") else None


def _why_not() -> str | None:
    if CUDA_BIN is None or not (CUDA_BIN / "mc-decode").exists():
        return ("no CUDA build of the patched llama.cpp: set MOECACHED_LLAMA_CUDA_BIN to its bin directory "
                "(benchmarks/gpu_hybrid.sh OUT build makes /tmp/llama/build-cuda/bin)")
    if shutil.which("nvidia-smi") is None or subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode:
        return "no NVIDIA GPU (nvidia-smi -L fails)"
    return None


WHY_NOT = _why_not()
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or ""), pytest.mark.timeout(900)]
STEPS = 32
RUN = Runner(STEPS, CUDA_BIN)
ZEROCOPY = ("--cpu-moe", "--moecached-gpu", "zerocopy")


BLOCKS, EXPERTS, TOP_K = 4, 32, 4


def _served_experts() -> int:
    return BLOCKS * EXPERTS


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu-model")
    return Path(write_runnable(str(d / "q8.gguf"), arch="qwen3moe", blocks=BLOCKS, experts=EXPERTS, top_k=TOP_K,
                               hidden=256, expert_ff=256, quant="q8_0", seed=2))


@pytest.fixture(scope="module")
def all_on_the_gpu(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu-ref")
    RUN.decode(model, d / "gpu.bin")
    return d / "gpu.bin"


def _vram(stdout: str) -> dict:
    m = re.search(r"^vram (.*)$", stdout, re.M)
    assert m, stdout[-1500:]
    return {k: int(x) if x.isdigit() else x for k, x in (kv.split("=", 1) for kv in m.group(1).split())}


@pytest.mark.parametrize("arena", [1.0, 0.5])
@pytest.mark.parametrize("tier,lookup", [(None, None), ("25%", "host"), ("25%", "device"), ("100%", "host"), ("100%", "device")])
def test_gpu_rungs_give_the_all_on_the_gpu_logits(model, all_on_the_gpu, tmp_path, arena, tier, lookup):
    """Rung 2 (zerocopy), rung 3 (a VRAM tier over it, looked up on the host) and rung 4 (the
    tier looked up on the device, a token computed again after a miss), the arena holding every
    expert or half: the logits of the run with every layer on the GPU, and the tier's counters add
    up (on the device: every decoded token, 4 blocks x top-4 fitting in 25 % of 4 x 32)."""
    extra = ZEROCOPY + (("--moecached-vram", tier, "--moecached-vram-lookup", lookup) if tier else ())
    r, st = RUN.served(model, tmp_path, "rung", int(arena * _served_experts()), *extra)
    assert filecmp.cmp(all_on_the_gpu, tmp_path / "rung.bin", shallow=False), \
        f"arena {arena:.0%}, tier {tier}: logits differ from every layer on the GPU"
    assert st["demand_misses"] > 0 or arena == 1.0, st
    if tier:
        v = _vram(r.stdout)
        assert v["slots"] > 0 and v["misses"] > 0 and v["invalidations"] == 0, v
        assert v["vram_bytes"] > 0 and v["copied_bytes"] > 0, v
        assert v["device_ubatches"] == (STEPS if lookup == "device" else 0), v
        assert v["reads"] == v["device_ubatches"] + v["reruns"], v


@pytest.mark.parametrize("arena", [1.0, 0.5])
@pytest.mark.parametrize("lookup", ["host", "device"])
def test_tier_without_zerocopy_copies_from_the_registered_arena(model, all_on_the_gpu, tmp_path, arena, lookup, monkeypatch):
    """The tier without --moecached-gpu zerocopy (as for a model whose rows zerocopy refuses),
    LLAMA_MOECACHED_VRAM_PINNED=1: the arena's three parts are registered with CUDA for the
    copies, and the logits are the all-on-the-GPU run's."""
    monkeypatch.setenv("LLAMA_MOECACHED_VRAM_PINNED", "1")
    r, st = RUN.served(model, tmp_path, "tier", int(arena * _served_experts()), "--cpu-moe",
                       "--moecached-vram", "25%", "--moecached-vram-lookup", lookup)
    assert filecmp.cmp(all_on_the_gpu, tmp_path / "tier.bin", shallow=False), \
        f"arena {arena:.0%}, lookup {lookup}: logits differ from every layer on the GPU"
    v = _vram(r.stdout)
    assert v["pinned_parts"] == 3 and v["misses"] > 0 and v["invalidations"] == 0, v
    assert "registered with CUDA device" in r.stderr, r.stderr[-1500:]
    if lookup == "host":
        assert v["decode_copy_syncs"] > 0, v


@pytest.mark.parametrize("arena", [1.0, 0.5])
@pytest.mark.parametrize("tier,zerocopy", [("12.5%", True), ("25%", False), ("100%", True)])
def test_arena_lookup_reads_what_the_tier_lacks_in_place(model, all_on_the_gpu, tmp_path, arena, tier, zerocopy):
    """--moecached-vram-lookup arena: every decoded token on the device lookup, its table naming
    the arena's slot (ids past the tier's) for an expert the tier lacks, read in place over the
    host link; with an arena of half the experts some are absent (acquired, the pass run again) or
    their slot reused (the generation tells, the pass run again). The logits of the run with every
    layer on the GPU, and the counters add up."""
    extra = (ZEROCOPY if zerocopy else ("--cpu-moe",)) + ("--moecached-vram", tier, "--moecached-vram-lookup", "arena")
    r, st = RUN.served(model, tmp_path, "arena", int(arena * _served_experts()), *extra)
    assert filecmp.cmp(all_on_the_gpu, tmp_path / "arena.bin", shallow=False), \
        f"arena {arena:.0%}, tier {tier}, zerocopy {zerocopy}: logits differ from every layer on the GPU"
    assert "read from the arena in place" in r.stderr, r.stderr[-1500:]
    v = _vram(r.stdout)
    assert v["lookup"] == "arena" and v["device_ubatches"] == STEPS and v["invalidations"] == 0, v
    assert v["reads"] == v["device_ubatches"] + v["reruns"], v
    assert v["decode_hits"] + v["decode_misses"] == v["decode_hits"] + v["decode_arena_reads"] > 0, v
    if tier != "100%":   # (a full tier may hold every expert the decode needs after the prompt)
        assert v["arena_reads"] > 0 and v["arena_read_bytes"] > 0 and v["copied_bytes"] > 0, v
    if arena == 1.0 and tier == "12.5%":   # every expert the prompt left out is read by the daemon once, then in place
        assert v["decode_reruns"] <= st["demand_misses"], (v, st)


def test_arena_lookup_on_the_trained_model(tmp_path, monkeypatch):
    """The trained model (rows of 64 elements, which zerocopy refuses): its tier's misses read from
    the arena in place by the vector kernels (decode only; the prompt copies), the all-on-the-GPU
    logits byte for byte; with the copies into the tier admitted by use (the default) and by LRU
    (LLAMA_MOECACHED_VRAM_ADMIT=all), and without each block's guessed experts copied ahead into the
    tier's staging slots (LLAMA_MOECACHED_VRAM_STAGE=off; auto, the default, stages these 52 KiB
    experts). A tier smaller than a token's routing (12.5 %: 32 slots, 32 experts a token) copies
    fewer bytes when it admits by use than when it copies every miss; copied ahead, routed experts
    are found staged and fewer are read in place."""
    trained = Path(__file__).resolve().parents[1] / "benchmarks" / "models" / "qwen3moe-stdlib-8x32-q8_0.gguf"
    text = (trained.parent / "qwen3moe-stdlib-heldout.txt").read_text(errors="replace")[:300]
    RUN.decode(trained, tmp_path / "gpu.bin", text=text)
    got = {}
    for name, env in (("freq", {}), ("all", {"LLAMA_MOECACHED_VRAM_ADMIT": "all"}), ("off", {"LLAMA_MOECACHED_VRAM_STAGE": "off"})):
        monkeypatch.delenv("LLAMA_MOECACHED_VRAM_ADMIT", raising=False)
        monkeypatch.delenv("LLAMA_MOECACHED_VRAM_STAGE", raising=False)
        for k, x in env.items():
            monkeypatch.setenv(k, x)
        r, _ = RUN.served(trained, tmp_path, name, 8 * 32, "--cpu-moe", "--moecached-vram", "12.5%",
                          "--moecached-vram-lookup", "arena", text=text)
        assert filecmp.cmp(tmp_path / "gpu.bin", tmp_path / f"{name}.bin", shallow=False), f"{name}: logits differ from every layer on the GPU"
        v = got[name] = _vram(r.stdout)
        assert v["lookup"] == "arena" and v["device_ubatches"] == STEPS and v["decode_arena_reads"] > 0, v
    assert (got["freq"]["admit"], got["all"]["admit"]) == ("freq", "all"), got
    assert got["freq"]["admit_refused"] > 0 and got["all"]["admit_refused"] == 0, got
    assert got["freq"]["decode_copied_bytes"] < got["all"]["decode_copied_bytes"], got
    st, off = got["freq"], got["off"]
    assert (st["stage"], off["stage"]) == ("next", "off") and off["stage_copies"] == off["stage_width"] == 0, got
    assert st["stage_width"] == 8 and st["decode_stage_copies"] > 0 and st["decode_stage_hits"] > 0, st
    assert st["decode_stage_bytes"] > 0 and st["decode_arena_reads"] < off["decode_arena_reads"], (st, off)


def test_copies_ahead_beside_the_daemon_prefetch_on_the_trained_model(tmp_path):
    """With --moecached-prefetch next the prefetch op runs on the CPU and splits a decoded token's
    graph between a block's stage and its wait (each split a CUDA graph of its own once warm): the
    copies ahead are left out there (a capture that ended with the second stream open aborted the
    process after the first two tokens). The all-on-the-GPU logits byte for byte, the arena read in
    place as without them."""
    trained = Path(__file__).resolve().parents[1] / "benchmarks" / "models" / "qwen3moe-stdlib-8x32-q8_0.gguf"
    text = (trained.parent / "qwen3moe-stdlib-heldout.txt").read_text(errors="replace")[:300]
    RUN.decode(trained, tmp_path / "gpu.bin", text=text)
    r, _ = RUN.served(trained, tmp_path, "pf", 8 * 32, "--cpu-moe", "--moecached-vram", "12.5%", "--moecached-vram-lookup", "arena",
                      "--moecached-prefetch", "next", text=text)
    assert filecmp.cmp(tmp_path / "gpu.bin", tmp_path / "pf.bin", shallow=False), "logits differ from every layer on the GPU"
    v = _vram(r.stdout)
    assert v["stage"] == "next" and v["device_ubatches"] == STEPS and v["decode_arena_reads"] > 0, v
    assert v["stage_copies"] == v["stage_hits"] == 0, v


def test_auto_reads_small_experts_in_place_and_not_large_ones(model, all_on_the_gpu, tmp_path):
    """The default lookup (auto) on a tier: this model's experts (204 KiB) are read from the arena
    in place; a model whose experts are larger than 1 MiB keeps the device / host lookup. Both give
    their all-on-the-GPU logits byte for byte."""
    r, _ = RUN.served(model, tmp_path, "small", _served_experts(), "--cpu-moe", "--moecached-vram", "25%")
    assert filecmp.cmp(all_on_the_gpu, tmp_path / "small.bin", shallow=False), "logits differ from every layer on the GPU"
    v = _vram(r.stdout)
    assert v["lookup"] == "arena" and v["decode_arena_reads"] > 0, v
    assert "lookup auto: experts of 204 KiB" in r.stderr, r.stderr[-1500:]
    big = Path(write_runnable(str(tmp_path / "big.gguf"), arch="qwen3moe", blocks=2, experts=8, top_k=2,
                              hidden=1024, expert_ff=512, quant="q8_0", seed=3))
    RUN.decode(big, tmp_path / "big-gpu.bin")
    r, _ = RUN.served(big, tmp_path, "big", 2 * 8, "--cpu-moe", "--moecached-vram", "25%")
    assert filecmp.cmp(tmp_path / "big-gpu.bin", tmp_path / "big.bin", shallow=False), "logits differ from every layer on the GPU"
    v = _vram(r.stdout)
    assert v["lookup"] == "auto" and v["decode_arena_reads"] == 0, v


@pytest.mark.parametrize("tier,lookup,zerocopy", [(None, None, True), ("25%", "host", True), ("12.5%", "device", True),
                                                  ("25%", "host", False), ("25%", "arena", False), ("25%", "auto", False)])
def test_daemon_restart_on_the_gpu_is_an_error_or_a_correct_continuation(model, all_on_the_gpu, tmp_path, tier, lookup, zerocopy):
    """Zerocopy (with a tier looked up on the host or on the device, or none) or a tier copying
    from the registered arena (LLAMA_MOECACHED_VRAM_PINNED=1), the daemon restarted mid-decode: the new arena is registered with
    CUDA anew (the tier invalidated) and the logits stay the all-on-the-GPU run's, or the engine
    stops with one moecached error line and what it wrote is a prefix of them."""
    n = _served_experts()
    sock = str(tmp_path / "d.sock")
    p = start_daemon(str(model), sock, "--slots", str(n))
    cmd = [str(CUDA_BIN / "mc-decode"), "-m", str(model), "-p", prompt(), "-n", str(STEPS), "-t", "2",
           "--dump", str(tmp_path / "out.bin"), "--moecached", f"ipc://{sock}", *(ZEROCOPY if zerocopy else ("--cpu-moe",)),
           *(("--moecached-vram", tier, "--moecached-vram-lookup", lookup) if tier else ()),
           "--step-delay-ms", "150", "--retries", "40"]
    def under_way(eng):
        time.sleep(3.0)
        assert eng.poll() is None, "the engine finished before the restart: make the decode longer"
    rc, out, err = across_restart(cmd, under_way,
                                  lambda: (stop_daemon(p), start_daemon(str(model), sock, "--slots", str(n)))[1],
                                  env=None if zerocopy else dict(os.environ, LLAMA_MOECACHED_VRAM_PINNED="1"))
    ref = all_on_the_gpu.read_bytes()
    if rc == 0:
        assert (tmp_path / "out.bin").read_bytes() == ref, "other logits after a restart"
        m = re.search(r"^moecached (acquires=.*)$", out, re.M)
        st = {k: int(v) for k, v in (kv.split("=", 1) for kv in m.group(1).split())} if m else {}
        assert st.get("restarts", 0) >= 1, out[-1500:]
        if lookup == "auto":   # (it chose the in-place reads: after the restart it chooses between the others)
            assert _vram(out)["lookup"] == "auto" and "as auto chooses" in err, err[-1500:]
    else:
        assert "moecached error:" in err, err[-2000:]
        assert ref.startswith((tmp_path / "out.bin").read_bytes())


@pytest.mark.parametrize("lookup", ["arena", "host", "auto"])
def test_pages_given_back_end_the_arena_registration(model, all_on_the_gpu, tmp_path, lookup):
    """A daemon that gives pages of its arena back (slots 128 -> 64 by SIGHUP: holes punched in the
    freed slots, refilled later with new pages) under an engine whose arena is registered with CUDA
    (the in-place reads, or the host lookup's copies with LLAMA_MOECACHED_VRAM_PINNED=1): the
    registration ends (one warning, registration_ends=1) and the logits stay the all-on-the-GPU
    run's, or the engine stops with one moecached error line after a prefix of them."""
    conf = tmp_path / "d.toml"
    conf.write_text("slots = 128\n")
    sock = str(tmp_path / "d.sock")
    p = start_daemon(str(model), sock, "--config", str(conf), "--log-level", "info")
    cmd = [str(CUDA_BIN / "mc-decode"), "-m", str(model), "-p", prompt(), "-n", str(STEPS), "-t", "2",
           "--dump", str(tmp_path / "out.bin"), "--moecached", f"ipc://{sock}", "--cpu-moe",
           "--moecached-vram", "25%", "--moecached-vram-lookup", lookup, "--step-delay-ms", "150", "--retries", "40"]
    def under_way(eng):
        time.sleep(3.0)
        assert eng.poll() is None, "the engine finished before the shrink: make the decode longer"
    def shrink():
        conf.write_text("slots = 64\n")
        p.send_signal(signal.SIGHUP)
        return None
    try:
        rc, out, err = across_restart(cmd, under_way, shrink, env=dict(os.environ, LLAMA_MOECACHED_VRAM_PINNED="1"))
    finally:
        log = stop_daemon(p)
    assert "slots" in log and "SIGHUP: applied" in log, log[-1500:]
    ref = all_on_the_gpu.read_bytes()
    if rc == 0:
        assert (tmp_path / "out.bin").read_bytes() == ref, "other logits after the daemon gave pages back"
        v = _vram(out)
        assert v["registration_ends"] == 1 and v["pinned_parts"] == 0, v
        assert v["lookup"] == lookup, v   # (auto: its choice of the in-place reads ended with them)
        assert "gave pages of the arena back" in err, err[-1500:]
    else:
        assert "moecached error:" in err, err[-2000:]
        assert ref.startswith((tmp_path / "out.bin").read_bytes())
