"""A short ``moecache-ctl demo`` end to end on a real trace (2-block real-layout model, few
tokens): daemon started and stopped per size, hits equal to the simulator's g-lru on the same
window (and to the daemon-LRU reference), files removed; and the synthetic default path in
miniature."""
import json
import os
import subprocess
import sys

import pytest

from moecached.tools.simulate import simulate
from moecached.engine.trace import load_trace
from moecached.tools.workload import generate, locality_stats

from fixtures import trace_path


def qwen_trace_path():
    return trace_path("qwen3_30b_a3b_sharegpt_prefill_2080.npz")


def run_demo(args, tmp_path):
    cmd = [sys.executable, "-m", "moecached.tools.ctl", "demo", "--workdir", str(tmp_path),
           "--no-progress", "--gbps", "1.0", "--json"] + args
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout), p.stderr


@pytest.mark.slow
def test_demo_real_trace(tmp_path):
    out, err = run_demo(["--trace", str(qwen_trace_path()), "--layers", "2", "--sizes", "0.25,0.5",
                         "--warm-tokens", "24", "--tokens", "64"], tmp_path)
    flat = " ".join(err.split())   # messages are folded at 100 columns
    assert "REAL trace" in flat and "first 2 of 48 MoE layers" in flat
    res = out["results"]
    assert [r["size_fraction"] for r in res] == [0.25, 0.5]
    assert [r["slots"] for r in res] == [64, 128]
    t = load_trace(qwen_trace_path())
    t2 = t.window(layers=2)
    for r in res:
        assert r["counted_tokens"] == 64 and r["accesses"] == 64 * 2 * 8
        s = r["sim"]
        assert s["slots_match"]
        assert s["daemon_equals_simulator"], (r["hits"], s["glru_hits"])
        # the CLI's numbers: moecache-ctl policy --sizes SLOTS --warmup 24 --tokens 64
        g = simulate(t2, "g-lru", r["slots"], warmup=24, tokens=64)
        assert (g["hits"], g["accesses"]) == (r["hits"], r["accesses"])
        assert g["hit_rate"] == r["hit_rate"]
        assert s["daemon_equals_reference"], (r["hits"], s["reference_hits"])
        assert r["drive_ceiling_tok_s"] > 0 and r["gbps_source"] == "given"
        assert "prefill only" in r["note"]
    assert res[1]["hit_rate"] >= res[0]["hit_rate"]
    # cleaned up: workdir removed, no daemon left on its socket
    assert not os.path.exists(out["workdir"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_demo_synthetic_small(tmp_path):
    out, err = run_demo(["--layers", "2", "--sizes", "0.5", "--warm-tokens", "8",
                         "--tokens", "16", "--keep"], tmp_path)
    assert "SYNTHETIC" in err
    r = out["results"][0]
    assert r["synthetic"] and r["sim"]["daemon_equals_simulator"]
    assert r["sim"]["glru_hits"] == r["hits"] and r["sim"]["daemon_equals_reference"]
    assert os.path.exists(out["model"])  # --keep
    # what a user reads fits a terminal of 100 columns: the messages and the table
    from moecached.tools.replay import format_table
    for line in err.splitlines() + format_table(out["results"], title="moecached demo: " + "x" * 120).splitlines():
        assert len(line) <= 100, line


def test_synthetic_locality_near_real():
    """The generator's documented fit: within a few points of the real Qwen3 statistics."""
    s = locality_stats(generate(1024, 8, 128, 8, seed=1))
    assert abs(s["prev"] - 0.456) < 0.05
    assert abs(s["top10"] - 0.374) < 0.06
    assert abs(s["lru_25"] - 0.825) < 0.04
    assert abs(s["lru_50"] - 0.967) < 0.03


def test_demo_refuses_to_fill_the_disk(tmp_path, monkeypatch, capsys):
    """Not enough free space for the model: one line naming the directory, the space needed and
    available and the fix; nothing written."""
    import shutil
    import moecached.tools.synth
    from moecached.tools.ctl import main as ctl

    def must_not_write(*a, **kw):
        raise AssertionError("the model was written")
    monkeypatch.setattr(moecached.tools.synth, "write_model", must_not_write)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 30))
    assert ctl(["demo", "--workdir", str(tmp_path), "--layers", "16", "--no-progress"]) == 1
    from moecached.tools.synth import model_disk_bytes
    need = (model_disk_bytes("qwen3-30b-a3b-Q4_K_M", layers=16) + (64 << 20)) / 2**30
    assert capsys.readouterr().err == (
        f"moecache-ctl demo: error: {tmp_path}: the 16-block model needs {need:.1f} GiB, 1.0 GiB "
        f"available: pass --workdir DIR on a filesystem with room (or fewer --layers)\n")
    assert list(tmp_path.iterdir()) == []


def test_demo_engine_step_says_how_to_build_it(monkeypatch, tmp_path):
    import argparse
    from moecached.tools import engine_llama
    from moecached.tools.demo import engine_step
    monkeypatch.setattr(engine_llama, "llama_bin", lambda: None)
    lines = []
    assert engine_step(argparse.Namespace(workdir=str(tmp_path), keep=False), lines.append) == {"built": False}
    assert len(lines) == 1 and "clients/llama.cpp/build.sh" in lines[0]
