"""llama.cpp decoding through moecached: logits bit-identical to the resident model.

Needs the patched llama.cpp (clients/llama.cpp/build.sh); skipped with one line when it is
not built. The driver (mc-decode) dumps the float32 logits of the prompt's last token and of
every greedy step; a run through the daemon must write the same bytes as the resident run.
The models (MODELS) cover the architectures the patch is checked on: qwen3moe, llama
(Mixtral-style) and olmoe, each at several quant mixes.
"""
from __future__ import annotations

import filecmp
import os
import re
import shutil
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from daemon_util import start_daemon, stop_daemon
from moecache_client import Client
from moecached.tools import engine_llama
from moecached.engine.index import open_index
from moecached.tools.synth_runnable import write_runnable

BIN = engine_llama.llama_bin()
pytestmark = [pytest.mark.skipif(BIN is None, reason="patched llama.cpp not built: run clients/llama.cpp/build.sh "
                                                     "(or set MOECACHED_LLAMA_BIN to its bin directory)"),
              pytest.mark.timeout(1200)]   # a test may decode twice, each run given 300 s
PROMPT = "Experts in shared memory, served to every engine."
STEPS = 40


# name -> (arch, write_runnable arguments); the qwen3moe models keep the bare quant names.
# llama is Mixtral-style (8 experts, top-2, as Mixtral); Q4_K_M gives two size classes
# (some down projections stay Q6_K). Quant types other than f32/q8_0 need llama-quantize.
MODELS = {
    "f32": ("qwen3moe", dict(blocks=2, experts=16, top_k=4, quant="f32", seed=1)),
    "q8_0": ("qwen3moe", dict(blocks=3, experts=16, top_k=4, quant="q8_0", seed=2)),
    "q4_k_m": ("qwen3moe", dict(blocks=4, experts=16, top_k=4, hidden=256, expert_ff=256, quant="Q4_K_M", seed=3)),
    "llama-f32": ("llama", dict(blocks=2, experts=8, top_k=2, quant="f32", seed=4)),
    "llama-q8_0": ("llama", dict(blocks=3, experts=8, top_k=2, quant="q8_0", seed=5)),
    "llama-q4_k_m": ("llama", dict(blocks=4, experts=8, top_k=2, hidden=256, expert_ff=256, quant="Q4_K_M", seed=6)),
    "olmoe-q8_0": ("olmoe", dict(blocks=3, experts=16, top_k=4, quant="q8_0", seed=7)),
    "olmoe-q4_k_m": ("olmoe", dict(blocks=3, experts=16, top_k=4, hidden=256, expert_ff=256, quant="Q4_K_M", seed=8)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama-models")
    q = BIN / "llama-quantize"
    out = {}
    for name, (arch, kw) in MODELS.items():
        if kw["quant"] in ("f32", "q8_0"):
            out[name] = write_runnable(str(d / f"{name}.gguf"), arch=arch, **kw)
        elif q.exists():
            out[name] = write_runnable(str(d / f"{name}.gguf"), arch=arch, quantize_bin=str(q), **kw)
    return out


def decode(model, dump, *extra, endpoint=None, check=True, timeout=300):
    r = engine_llama.decode(BIN, model, str(dump), prompt=PROMPT, steps=STEPS, endpoint=endpoint,
                            extra=extra, timeout=timeout)
    if check:
        assert r.returncode == 0, f"mc-decode failed ({r.returncode}): {r.stderr[-2000:]}"
    return r


def stats_of(r) -> dict:
    st = engine_llama.parse_stats(r.stdout)
    assert st, r.stdout
    return st


@pytest.fixture(scope="module")
def reference(models, tmp_path_factory):
    d = tmp_path_factory.mktemp("llama-ref")
    ref = {}
    for name, path in models.items():
        dump = d / f"{name}.bin"
        r = decode(path, dump)
        toks = re.findall(r"^step \d+ token (\d+)$", r.stdout, re.M)
        assert len(toks) == STEPS + 1
        assert len(set(toks)) > 1, f"{name}: greedy decode is degenerate ({toks[:5]}...)"
        ref[name] = dump
    return ref


@pytest.mark.parametrize("quant", list(MODELS))
def test_runnable_model_is_indexed(models, quant):
    if quant not in models:
        pytest.skip("no llama-quantize in the build")
    arch, kw = MODELS[quant]
    idx = open_index(models[quant]).to_json()
    assert idx["arch"] == arch and idx["n_experts"] == kw["experts"] and idx["top_k"] == kw["top_k"]
    assert idx["expert_layers"] == list(range(kw["blocks"]))
    if kw["quant"] == "Q4_K_M":
        # Q4_K_M keeps some down projections at Q6_K: two size classes
        assert len(idx["size_classes"]) == 2


@pytest.mark.parametrize("quant", list(MODELS))
@pytest.mark.parametrize("budget", ["all", "half", "tight"])
def test_daemon_served_logits_are_bit_identical(models, reference, tmp_path, quant, budget):
    if quant not in models:
        pytest.skip("no llama-quantize in the build")
    idx = open_index(models[quant]).to_json()
    n_blocks, n_exp, k = len(idx["expert_layers"]), idx["n_experts"], idx["top_k"]
    n_classes = len(idx["size_classes"])
    slots = {"all": n_blocks * n_exp, "half": n_blocks * n_exp // 2, "tight": (k + 2) * n_classes}[budget]
    sock = str(tmp_path / "d.sock")
    p = start_daemon(models[quant], sock, "--slots", str(slots))
    try:
        r = decode(models[quant], tmp_path / "out.bin", endpoint=f"ipc://{sock}")
    finally:
        log = stop_daemon(p)
    assert filecmp.cmp(reference[quant], tmp_path / "out.bin", shallow=False), \
        f"{quant}/{budget}: logits differ from the resident run\n{r.stdout[-1500:]}\n{log[-1500:]}"
    st = stats_of(r)
    assert st["acquires"] >= n_blocks * STEPS
    # the decode steps' share of the served blocks' host ops: one acquire op and one release op a block
    # and token, each timed (the acquire's own time within its op's)
    assert st["decode_acquires"] == n_blocks * STEPS, st
    assert st["decode_ops"] == 2 * n_blocks * STEPS and st["ops"] > st["decode_ops"], st
    assert 0 < st["decode_acquire_us"] <= st["decode_op_us"] <= st["op_us"], st
    if budget == "tight":
        assert st["misses"] > 2 * n_blocks * k, st          # experts evicted and read again
        assert st["waves"] > 0, st                          # the prompt ran in waves
    if budget == "all":
        assert st["misses"] <= n_blocks * n_exp, st         # each expert read at most once


@pytest.mark.parametrize("quant", ["q8_0", "llama-q4_k_m"])
def test_cpu_moe_keeps_the_logits(models, reference, tmp_path, quant):
    """mc-decode --cpu-moe (the experts' tensors in CPU buffers, llama.cpp's -ot exps=CPU): on a
    CPU build the same logits as without it, resident and with --moecached (the GPU machine's
    rung 1 compares these two runs; benchmarks/gpu_hybrid.sh)."""
    if quant not in models:
        pytest.skip("no llama-quantize in the build")
    decode(models[quant], tmp_path / "cpu_moe.bin", "--cpu-moe")
    assert filecmp.cmp(reference[quant], tmp_path / "cpu_moe.bin", shallow=False), f"{quant}: --cpu-moe changed the logits"
    idx = open_index(models[quant]).to_json()
    sock = str(tmp_path / "d.sock")
    p = start_daemon(models[quant], sock, "--slots", str(len(idx["expert_layers"]) * idx["n_experts"]))
    try:
        r = decode(models[quant], tmp_path / "served.bin", "--cpu-moe", endpoint=f"ipc://{sock}")
    finally:
        log = stop_daemon(p)
    assert filecmp.cmp(reference[quant], tmp_path / "served.bin", shallow=False), \
        f"{quant}: --cpu-moe --moecached differs from the resident run\n{r.stdout[-1500:]}\n{log[-1500:]}"
    assert stats_of(r)["acquires"] > 0


def test_two_engines_through_one_daemon(models, reference, tmp_path):
    quant = "q8_0"
    sock = str(tmp_path / "d.sock")
    p = start_daemon(models[quant], sock, "--slots", "20", "--on-pressure", "wait")
    results = {}
    try:
        def run(i):
            results[i] = decode(models[quant], tmp_path / f"out{i}.bin", endpoint=f"ipc://{sock}")
        ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        stop_daemon(p)
    for i in range(2):
        assert i in results
        assert filecmp.cmp(reference[quant], tmp_path / f"out{i}.bin", shallow=False), f"engine {i}: logits differ"
        assert stats_of(results[i])["misses"] > 0


def _replace_daemon_under(eng, p, model, sock, slots, timeout, what, when, sig=signal.SIGTERM):
    """While engine ``eng`` decodes: once ``when()`` returns, stop daemon ``p`` with ``sig``,
    start a new one (``slots`` slots) on the same socket and wait for the engine (``timeout``
    seconds). Returns its (stdout, stderr); the engine and the new daemon never outlive it."""
    p2 = None
    try:
        when()
        assert eng.poll() is None, f"the engine finished before {what}"
        stop_daemon(p, sig=sig)
        p2 = start_daemon(model, sock, "--slots", slots)
        return eng.communicate(timeout=timeout)
    finally:
        if eng.poll() is None:
            eng.kill()
        if p2:
            stop_daemon(p2)


def test_daemon_restart_mid_decode_is_an_error_or_a_correct_continuation(models, reference, tmp_path):
    quant = "f32"
    sock = str(tmp_path / "d.sock")
    p = start_daemon(models[quant], sock, "--slots", "12")
    cmd = [str(BIN / "mc-decode"), "-m", models[quant], "-p", PROMPT, "-n", str(STEPS), "-t", "2",
           "--dump", str(tmp_path / "out.bin"), "--moecached", f"ipc://{sock}",
           "--step-delay-ms", "50", "--retries", "40"]
    eng = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = _replace_daemon_under(eng, p, models[quant], sock, "12", 300, "the restart: make "
                                     "the decode longer", when=lambda: time.sleep(1.0))
    if eng.returncode == 0:
        # a correct continuation: every logits row equals the resident run's
        assert filecmp.cmp(reference[quant], tmp_path / "out.bin", shallow=False), "wrong logits after a restart"
        assert stats_of(subprocess.CompletedProcess([], 0, out, err))["restarts"] >= 1, out
    else:
        assert "moecached error:" in err, err[-2000:]
        # whatever was written before the error matches the resident run
        got = (tmp_path / "out.bin").read_bytes()
        assert reference[quant].read_bytes().startswith(got)


@pytest.mark.slow
def test_daemon_crash_while_a_lease_is_held_discards_the_batch_and_continues(models, reference, tmp_path):
    # every block keeps its lease 3 s (LLAMA_MOECACHED_HOLD_US, a slow compute); the daemon is
    # killed meanwhile and a new one started (it zeroes the dead arena's epoch): the lease
    # reads invalid, or the next acquire finds no daemon; llama_decode fails and rolls the batch
    # back; the retry runs on the new daemon and the logits are still the resident run's
    quant, steps = "f32", 2
    sock = str(tmp_path / "d.sock")
    p = start_daemon(models[quant], sock, "--slots", "32")
    cmd = [str(BIN / "mc-decode"), "-m", models[quant], "-p", PROMPT, "-n", str(steps), "-t", "2",
           "--dump", str(tmp_path / "out.bin"), "--moecached", f"ipc://{sock}", "--retries", "60"]
    eng = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=dict(os.environ, LLAMA_MOECACHED_HOLD_US="3000000"))

    def holding():
        # kill only once the engine holds a block's leases (its first block acquired): a fixed
        # sleep could kill the daemon while a loaded machine is still loading the model, and one
        # lease may be the check at attach (one expert, released at once)
        with Client(f"ipc://{sock}", name="watcher") as c:
            deadline = time.monotonic() + 120
            while c.stats()["leases"] < 2 and eng.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.stats()["leases"] >= 2, "the engine held no block's leases in 120 s"
    out, err = _replace_daemon_under(eng, p, models[quant], sock, "32", 600, "the crash",
                                     when=holding, sig=signal.SIGKILL)
    assert eng.returncode == 0, err[-2000:]
    assert "moecached error:" in err, err[-2000:]          # a batch was discarded, then retried
    assert "(llama_decode returned 2); retry 1 of 60 in 500 ms" in err, err[-2000:]   # the line says it is retried
    row = (tmp_path / "out.bin").read_bytes()
    assert len(row) > 0 and reference[quant].read_bytes().startswith(row), "wrong logits after a crash"
    assert stats_of(subprocess.CompletedProcess([], 0, out, err))["restarts"] >= 1


def test_refused_other_model_file_is_one_line(models, tmp_path):
    # the daemon serves another model file: the engine refuses at start, naming both files
    sock = str(tmp_path / "d.sock")
    p = start_daemon(models["q8_0"], sock, "--slots", "48")
    try:
        r = decode(models["f32"], tmp_path / "out.bin", endpoint=f"ipc://{sock}", check=False)
    finally:
        stop_daemon(p)
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.startswith("moecached:")]
    assert lines and "another model file" in lines[0], r.stderr[-2000:]
    assert os.path.basename(models["q8_0"]) in lines[0] and models["f32"] in lines[0], lines[0]


def test_same_shape_other_model_is_refused_and_a_copy_with_its_times_is_served(models, reference, tmp_path):
    """A model of the same shape and type (a fine-tune: every tensor check passes) is another
    file: refused at start, never computed with the daemon's experts (it was, before: exit 0,
    every logit wrong). A copy made with the file's times (cp -p) is the same model: served."""
    arch, kw = MODELS["q8_0"]
    other = write_runnable(str(tmp_path / "other.gguf"), arch=arch, **dict(kw, seed=99))
    assert os.path.getsize(other) == os.path.getsize(models["q8_0"])
    copy = str(tmp_path / "copy.gguf")
    shutil.copy2(models["q8_0"], copy)
    sock = str(tmp_path / "d.sock")
    p = start_daemon(models["q8_0"], sock, "--slots", "48")
    try:
        r = decode(other, tmp_path / "other.bin", endpoint=f"ipc://{sock}", check=False)
        decode(copy, tmp_path / "copy.bin", endpoint=f"ipc://{sock}")
    finally:
        stop_daemon(p)
    assert r.returncode != 0 and not (tmp_path / "other.bin").exists() or \
        (tmp_path / "other.bin").stat().st_size == 0, r.stderr[-2000:]
    line = next(l for l in r.stderr.splitlines() if l.startswith("moecached:"))
    assert "another model file" in line and other in line and "cp -p" in line, line
    assert filecmp.cmp(reference["q8_0"], tmp_path / "copy.bin", shallow=False)


def test_another_model_of_the_same_size_and_times_is_refused_by_its_bytes(models, tmp_path):
    """Another model of the same shape given the daemon's file's size and times before both start
    (a fine-tune unpacked with normalised times): the size and time checks pass, one served
    expert's bytes do not (before: exit 0, every logit wrong)."""
    arch, kw = MODELS["q8_0"]
    other = write_runnable(str(tmp_path / "other.gguf"), arch=arch, **dict(kw, seed=99))
    st = os.stat(models["q8_0"])
    assert os.path.getsize(other) == st.st_size
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    sock = str(tmp_path / "d.sock")
    p = start_daemon(models["q8_0"], sock, "--slots", "48")
    try:
        r = decode(other, tmp_path / "other.bin", endpoint=f"ipc://{sock}", check=False)
    finally:
        stop_daemon(p)
    assert r.returncode != 0 and (not (tmp_path / "other.bin").exists() or (tmp_path / "other.bin").stat().st_size == 0), \
        r.stderr[-2000:]
    line = next(l for l in r.stderr.splitlines() if l.startswith("moecached:"))
    assert "the daemon's bytes are not this file's" in line and "ffn_" in line, line


@pytest.mark.parametrize("how", ["daemon restarted on another file", "file replaced under the daemon",
                                 "file replaced by one of the same size and times",
                                 "daemon restarted on one of the same size and times under a copy's engine",
                                 "daemon restarted on another file with fewer experts"])
def test_another_model_under_a_running_engine_stops_it(models, reference, tmp_path, how):
    """A new session on another file of the same shape (a daemon restarted on it, or the file
    replaced under a daemon that reloads): the engine's next acquire meets the new arena and
    stops with the reason (before, it went on with the new model's experts: wrong logits). A
    model with fewer experts a block refuses the engine's ids itself (out of range): the engine
    still names the new session's model file, not the refusal, and stops (before, it retried the
    refusal forever, and llama-server's /health said ok)."""
    arch, kw = MODELS["q8_0"]
    model = str(tmp_path / "model.gguf")
    shutil.copy2(models["q8_0"], model)
    fewer = how.endswith("fewer experts")
    other = write_runnable(str(tmp_path / "other.gguf"), arch=arch,
                           **dict(kw, seed=99, **({"experts": kw["experts"] // 2} if fewer else {})))
    sock = str(tmp_path / "d.sock")
    p = start_daemon(model, sock, "--slots", "48")
    loaded = model
    if how.endswith("copy's engine"):
        # the engine loads a copy with the file's times (not the daemon's inode); the daemon comes
        # back on another model given them too: only the bytes tell
        loaded = shutil.copy2(model, str(tmp_path / "copy.gguf"))
        st = os.stat(model)
        os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    cmd = [str(BIN / "mc-decode"), "-m", loaded, "-p", PROMPT, "-n", str(STEPS), "-t", "2",
           "--dump", str(tmp_path / "out.bin"), "--moecached", f"ipc://{sock}",
           "--step-delay-ms", "100", "--retries", "20"]
    eng = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def decoding():   # the engine has loaded the model and acquired (its first misses read)
        with Client(f"ipc://{sock}", name="watcher") as c:
            deadline = time.monotonic() + 120
            while c.stats()["demand_misses"] < 1 and eng.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
    try:
        if how.startswith("daemon"):
            out, err = _replace_daemon_under(eng, p, other, sock, "24" if fewer else "48", 300, "the restart",
                                             when=decoding)
        else:
            decoding()
            assert eng.poll() is None, "the engine finished before the replacement"
            nxt = shutil.copy2(other, str(tmp_path / ".next.gguf"))
            if how.endswith("times"):   # size and mtime as the loaded file's: only the inode tells
                st = os.stat(model)
                os.utime(nxt, ns=(st.st_atime_ns, st.st_mtime_ns))
            os.replace(nxt, model)
            out, err = eng.communicate(timeout=300)
    finally:
        if eng.poll() is None:
            eng.kill()
        stop_daemon(p)
    got = (tmp_path / "out.bin").read_bytes()
    assert reference["q8_0"].read_bytes().startswith(got), "wrong logits after another model's session"
    why = "the new session's bytes are not this engine's file's" if how.endswith("copy's engine") else \
        "a new daemon session serves another"
    assert eng.returncode != 0 and why in err, (eng.returncode, err[-2000:])
    # no retry mends it: llama_decode returns -3 (not 2), and mc-decode --retries stops at once
    failed = [ln for ln in err.splitlines() if ln.startswith("moecached error:")]
    assert failed and "returned -3" in failed[-1] and sum("returned -3" in ln for ln in failed) == 1, failed[-5:]


def rewrite_gguf(src, dst, *, arch=None, drop=(), add=(), kv=()):
    """Copy the F32 GGUF ``src`` to ``dst``: the keys renamed to ``arch``, tensors whose name
    contains one of ``drop`` left out, then ``add`` ((name, numpy array) pairs) and ``kv``
    ((key, value, GGUFValueType) triples) added."""
    r = GGUFReader(src)
    old = r.fields["general.architecture"].contents()
    arch = arch or old
    w = GGUFWriter(dst, arch)
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(arch + k[len(old):] if k.startswith(old + ".") else k, f.contents(), f.types[0], sub_type=sub)
    for k, v, t in kv:
        w.add_key_value(k, v, t)
    for t in r.tensors:
        if not any(d in t.name for d in drop):
            w.add_tensor(t.name, np.array(t.data, dtype=np.float32))
    for name, arr in add:
        w.add_tensor(name, arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("layout", ["scales", "biases"])
def test_unsupported_expert_layout_is_refused_at_start_in_one_line(tmp_path, layout):
    # llama.cpp loads per-expert scales (blk.N.ffn_*_exps.scale) for every arch, and per-expert
    # biases for gpt-oss; the patch refuses both before it connects, in one line
    E, F, H, nh = 8, 64, 64, 4
    src = write_runnable(str(tmp_path / "src.gguf"), arch="llama", blocks=2, experts=E, top_k=2, seed=9)
    model = str(tmp_path / "m.gguf")
    if layout == "scales":
        rewrite_gguf(src, model, add=[("blk.1.ffn_up_exps.scale", np.ones(E))])
        want = "blk.1: per-expert scales (ffn_*_exps_s) are not supported by --moecached; run without it"
    else:
        u32 = GGUFValueType.UINT32
        add = []
        for b in range(2):
            p = f"blk.{b}."
            add += [(p + "post_attention_norm.weight", np.ones(H)), (p + "attn_sinks.weight", np.zeros(nh)),
                    (p + "attn_output.bias", np.zeros(H)), (p + "ffn_gate_inp.bias", np.zeros(E)),
                    (p + "ffn_gate_exps.bias", np.zeros((E, F))), (p + "ffn_up_exps.bias", np.zeros((E, F))),
                    (p + "ffn_down_exps.bias", np.zeros((E, H)))]
        rewrite_gguf(src, model, arch="gpt-oss", drop=("ffn_norm",), add=add,
                     kv=[("gpt-oss.expert_feed_forward_length", F, u32), ("gpt-oss.attention.sliding_window", 128, u32)])
        want = "blk.0: per-expert biases (ffn_*_exps.bias) are not supported by --moecached; run without it"
    resident = decode(model, tmp_path / "resident.bin", check=False)
    assert resident.returncode == 0, f"the {layout} model does not run resident: {resident.stderr[-2000:]}"
    r = decode(model, tmp_path / "out.bin", endpoint=f"ipc://{tmp_path / 'none.sock'}", check=False)
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.startswith("moecached:")]
    assert lines == [f"moecached: {want}"], r.stderr[-2000:]


def served(model, tmp_path, name, slots, *extra):
    """mc-decode through a fresh daemon of `slots` slots; (the run, the daemon's stats)."""
    from moecache_client import Client
    sock = str(tmp_path / f"{name}.sock")
    p = start_daemon(model, sock, "--slots", str(slots))
    try:
        r = decode(model, tmp_path / f"{name}.bin", *extra, endpoint=f"ipc://{sock}")
        with Client(f"ipc://{sock}", name="test") as c:
            st = c.stats()
    finally:
        stop_daemon(p)
    return r, st


def moe_records(path):
    """mc-decode --dump-moe: per MoE block of every ubatch, {block, probs, topk, ids, weights}
    (ids: after substitution; rows of one-token ubatches)."""
    import numpy as np
    out, cur = [], {}
    for line in open(path):
        name, ne0, ne1, *v = line.split()
        kind, block = name.rsplit("-", 1)
        ne0, ne1 = int(ne0), int(ne1)
        cur.setdefault(block, {})[kind] = np.array(v, dtype=np.float32 if kind in
                                                   ("ffn_moe_probs", "ffn_moe_weights_norm") else np.int64).reshape(ne1, ne0)
        if kind == "ffn_moe_weights_norm":
            c = cur.pop(block)
            out.append({"block": int(block), "probs": c["ffn_moe_probs"], "topk": c["ffn_moe_topk"],
                        "ids": c.get("ffn_moe_topk_subst", c["ffn_moe_topk"]), "subst": "ffn_moe_topk_subst" in c,
                        "weights": c["ffn_moe_weights_norm"]})
    return out


def test_substitution_reads_fewer_experts_and_is_reproducible(models, reference, tmp_path):
    import numpy as np
    # half the experts cached: a missing expert often has a resident one ranked just below the
    # top-k; with r = 0.5 the daemon grants it, the engine runs it with its own routing weight
    quant = "q8_0"
    idx = open_index(models[quant]).to_json()
    slots = len(idx["expert_layers"]) * idx["n_experts"] // 2
    exact, st_exact = served(models[quant], tmp_path, "exact", slots)
    subst = ["--moecached-subst", "0.5", "--moecached-subst-cap", "1"]
    r1, st1 = served(models[quant], tmp_path, "subst1", slots, *subst, "--dump-moe", str(tmp_path / "moe.txt"))
    r2, st2 = served(models[quant], tmp_path, "subst2", slots, *subst)
    assert filecmp.cmp(reference[quant], tmp_path / "exact.bin", shallow=False)
    assert st_exact["substitutions"] == 0
    assert st1["substitutions"] > 0, st1
    assert st1["demand_misses"] < st_exact["demand_misses"], (st1["demand_misses"], st_exact["demand_misses"])
    # the substitutes were computed with: the logits are not the exact run's
    assert not filecmp.cmp(reference[quant], tmp_path / "subst1.bin", shallow=False)
    # the engine's counts are the daemon's, and a second run from a fresh daemon is the same run
    eng1 = stats_of(r1)
    assert (eng1["subst"], eng1["misses"]) == (st1["substitutions"], st1["demand_misses"]), (eng1, st1)
    assert (st2["substitutions"], st2["demand_misses"]) == (st1["substitutions"], st1["demand_misses"])
    untimed = lambda st: {k: v for k, v in st.items() if not k.endswith("_us")}   # times differ run to run
    assert untimed(stats_of(r2)) == untimed(eng1)
    assert filecmp.cmp(tmp_path / "subst1.bin", tmp_path / "subst2.bin", shallow=False), \
        "two substituted runs from fresh daemons differ"
    # every swap is a top-2k expert scoring >= r x the one it replaced, at most cap per block and
    # token; the routing weights are the router's probabilities of the ids run, normalised
    k, swaps = idx["top_k"], 0
    recs = moe_records(tmp_path / "moe.txt")
    assert len(recs) == len(idx["expert_layers"]) * (STEPS + 1)
    for rec in recs:
        n_tok = rec["probs"].shape[0]
        assert rec["subst"] == (n_tok == 1), "only one-token ubatches substitute"
        for t in range(n_tok):
            p, top, ids, w = rec["probs"][t], rec["topk"][t], rec["ids"][t], rec["weights"][t]
            rank = list(p.argsort(kind="stable")[::-1])
            changed = [j for j in range(k) if ids[j] != top[j]]
            assert len(changed) <= 1
            for j in changed:
                assert ids[j] not in top and k <= rank.index(ids[j]) < 2 * k
                assert p[ids[j]] >= 0.5 * p[top[j]]
            swaps += len(changed)
            want = p[ids] / p[ids].sum(dtype=np.float32)
            np.testing.assert_allclose(w, want, rtol=1e-6, err_msg=f"block {rec['block']}: weights not those of the ids run")
    assert swaps == st1["substitutions"]


@pytest.mark.parametrize("cap", ["1", "0"])
def test_substitution_that_never_qualifies_is_bit_identical(models, reference, tmp_path, cap):
    # r = 1: a candidate ranks below every requested expert, so none scores >= 1 x a missing
    # one (cap 0: no swap allowed); the candidates still go with every acquire that misses
    quant = "q8_0"
    idx = open_index(models[quant]).to_json()
    slots = len(idx["expert_layers"]) * idx["n_experts"] // 2
    r, st = served(models[quant], tmp_path, "r1", slots, "--moecached-subst", "1", "--moecached-subst-cap", cap)
    assert st["substitutions"] == 0 and st["demand_misses"] > 0, st
    assert stats_of(r)["subst"] == 0
    assert filecmp.cmp(reference[quant], tmp_path / "r1.bin", shallow=False), "logits differ from the resident run"


@pytest.mark.parametrize("flag,value", [("--moecached-subst", "1e9"), ("--moecached-subst", "half"),
                                        ("--moecached-subst-cap", "-1"), ("--moecached-gpu", "vram"),
                                        ("--moecached-gpu", "zerocopy")])   # (zerocopy: no CUDA device here)
def test_bad_substitution_setting_is_one_line(models, tmp_path, flag, value):
    sock = str(tmp_path / "d.sock")
    p = start_daemon(models["f32"], sock, "--slots", "32")
    try:
        r = decode(models["f32"], tmp_path / "out.bin", flag, value, endpoint=f"ipc://{sock}", check=False)
    finally:
        stop_daemon(p)
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.startswith("moecached:")]
    assert lines and flag in lines[0] and value in lines[0], r.stderr[-2000:]


@pytest.mark.engine
@pytest.mark.daemon   # the demo's engine step starts its own daemon and llama.cpp
def test_demo_engine_step_decodes_bit_identical(tmp_path):
    import argparse
    from moecached.tools.demo import engine_step
    lines = []
    res = engine_step(argparse.Namespace(workdir=str(tmp_path), keep=False), lines.append)
    assert res["built"] and res["identical"] and res["stats"]["misses"] > 0, res
    assert len(lines) == 1 and "bit-identical" in lines[0]
