"""The trained MoE model shipped in benchmarks/models/ (benchmarks/train_moe.py): indexable, and -- with
the patched llama.cpp built (clients/llama.cpp/build.sh; else those tests skip) -- decoded through
moecached bit-identically to the resident run, and greedily as the PyTorch model decodes it (when
torch is installed)."""
from __future__ import annotations

import filecmp
import re
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

from daemon_util import start_daemon, stop_daemon
from moecached.engine.index import open_index
from moecached.tools import engine_llama

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "benchmarks" / "models" / "qwen3moe-stdlib-8x32-q8_0.gguf"
BIN = engine_llama.llama_bin()
needs_llama = pytest.mark.skipif(BIN is None, reason="patched llama.cpp not built: run clients/llama.cpp/build.sh "
                                                     "(or set MOECACHED_LLAMA_BIN to its bin directory)")
# held-out code (the corpus holds out whole files; this one is not in the training split)
PROMPT = "    def __init__(self, name, value):\n        self.name = name\n"
STEPS = 32


def test_trained_model_is_indexable():
    idx = open_index(str(MODEL)).to_json()
    assert idx["arch"] == "qwen3moe"
    assert idx["n_experts"] == 32 and idx["top_k"] == 4
    assert idx["expert_layers"] == list(range(8))
    assert len(idx["size_classes"]) == 1            # every expert part Q8_0
    assert MODEL.stat().st_size <= 16 * 2**20


def test_trained_model_vocabulary_is_the_training_tokenizers():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import train_moe
    r = GGUFReader(str(MODEL))
    f = r.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(f.parts[i]).decode() for i in f.data]
    assert tokens == train_moe.vocab()[0]
    f = r.fields["tokenizer.ggml.add_space_prefix"]
    assert bool(f.parts[f.data[0]][0]) is False


def _decode(dump, endpoint=None):
    r = engine_llama.decode(BIN, str(MODEL), str(dump), prompt=PROMPT, steps=STEPS, endpoint=endpoint)
    assert r.returncode == 0, f"mc-decode failed ({r.returncode}): {r.stderr[-2000:]}"
    return [int(t) for t in re.findall(r"^step \d+ token (\d+)$", r.stdout, re.M)], r


@needs_llama
@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_trained_model_through_the_daemon_decodes_as_resident(tmp_path, budget):
    ref, _ = _decode(tmp_path / "resident.bin")
    assert len(set(ref)) > 3, f"greedy decode is degenerate: {ref}"
    sock = str(tmp_path / "d.sock")
    p = start_daemon(str(MODEL), sock, "--slots", str(int(8 * 32 * budget)))
    try:
        got, r = _decode(tmp_path / "served.bin", endpoint=f"ipc://{sock}")
    finally:
        log = stop_daemon(p)
    assert got == ref
    assert filecmp.cmp(tmp_path / "resident.bin", tmp_path / "served.bin", shallow=False), \
        f"logits differ from the resident run\n{r.stdout[-1500:]}\n{log[-1500:]}"
    st = engine_llama.parse_stats(r.stdout)
    assert st["acquires"] >= 8 * STEPS and st["misses"] > 0, st


@needs_llama
def test_trained_model_greedy_text_equals_pytorch(tmp_path):
    """The graph: llama.cpp on an F32 copy of the shipped weights (dequantised) decodes greedily what
    the PyTorch model of benchmarks/train_moe.py decodes, with close logits. (On the Q8_0 file itself
    llama.cpp's CPU matmuls quantise the activations too, which moves logits by ~0.15 and may change
    a greedy token late in a decode.)"""
    pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import numpy as np
    import train_moe
    w, cfg = train_moe.read_gguf(str(MODEL))
    f32 = train_moe.write_gguf(str(tmp_path / "f32.gguf"), w, cfg)
    model, _ = train_moe.load_model(f32)
    ids = [train_moe.BOS] + train_moe.encode(PROMPT).tolist()
    ref_rows, ref = train_moe.torch_greedy(model, ids, STEPS)
    r = engine_llama.decode(BIN, f32, str(tmp_path / "logits.bin"), prompt=PROMPT, steps=STEPS)
    assert r.returncode == 0, r.stderr[-2000:]
    got = [int(t) for t in re.findall(r"^step \d+ token (\d+)$", r.stdout, re.M)]
    assert got == ref, (train_moe.decode(got), train_moe.decode(ref))
    rows = np.fromfile(tmp_path / "logits.bin", dtype=np.float32).reshape(-1, train_moe.N_VOCAB)
    assert np.abs(rows[0] - ref_rows[0]).max() < 0.02     # the prompt's last token (logits ~20)
