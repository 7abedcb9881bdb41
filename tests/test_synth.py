"""synth: stamps, metadata consistency, scaling rules, split/legacy naming, layout loading."""
import json
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

from fixtures import layout_path, make_model
from fixtures import shared_layouts_dir
from moecached.facts.layout import DATA_DIR, LayoutError, load_layout
from moecached.tools.synth import (PAGE, SynthError, decode_stamp, expected_expert_bytes, main as synth_main,
                             plan_model, verify_expert_bytes, write_model)


def test_stamp_every_page_and_partial_tail():
    n = 3 * PAGE + 20  # partial last page shorter than a stamp
    b = expected_expert_bytes(5, "down", 17, n, seed=9)
    assert len(b) == n and b == expected_expert_bytes(5, "down", 17, n, seed=9)
    for pg in range(3):
        st = decode_stamp(b[pg * PAGE:])
        assert st == {"layer": 5, "part_code": 3, "part": "down", "expert": 17, "page": pg, "seed": 9, "nbytes": n}
    assert decode_stamp(b[3 * PAGE:]) is None  # only 20 bytes left
    # payload between stamps is seeded bytes, not constant
    assert len(set(b[64:PAGE])) > 200


@pytest.mark.parametrize("other", [(6, "down", 17, 9), (5, "up", 17, 9), (5, "down", 16, 9), (5, "down", 17, 10)])
def test_any_coordinate_changes_the_bytes(other):
    n = 2 * PAGE
    assert expected_expert_bytes(5, "down", 17, n, 9) != expected_expert_bytes(*other[:3], n, other[3])


def test_verify_names_the_slice_that_was_read():
    n = 4 * PAGE
    wrong = expected_expert_bytes(2, "gate", 3, n, 0)
    msg = verify_expert_bytes(wrong, 2, "gate", 4, 0)
    assert msg.startswith("block 2 part gate expert 4: first wrong byte at offset 12 (page 0)")
    assert "stamp there says block 2 part gate expert 3 page 0" in msg
    assert verify_expert_bytes(wrong, 2, "gate", 3, 0) is None
    shifted = expected_expert_bytes(2, "gate", 3, n + PAGE, 0)[PAGE:]
    assert "page 1" in verify_expert_bytes(shifted, 2, "gate", 3, 0)


def test_metadata_is_consistent_and_typed(model_factory):
    p = model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 8], experts=8)
    r = GGUFReader(p)
    f = {k: v for k, v in r.fields.items() if not k.startswith("GGUF.")}
    assert f["general.architecture"].contents() == "qwen3moe"
    assert f["qwen3moe.block_count"].contents() == 3
    assert f["qwen3moe.expert_count"].contents() == 8
    assert f["qwen3moe.expert_used_count"].contents() == 8
    assert f["qwen3moe.block_count"].types == [GGUFValueType.UINT32]
    assert f["moecached.tools.synth.source_blocks"].contents() == [0, 6, 8]
    for k in f:  # only real namespaced keys, no layout notes
        assert k.split(".")[0] in ("general", "qwen3moe", "moecached"), k
        assert "(" not in k
    assert "qwen3moe.leading_dense_block_count" not in f


def test_tensors_match_layout_types_shapes_and_byte_shapes(model_factory):
    p = model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 8], experts=8)
    lay = {t.name: t for t in load_layout(layout_path("qwen3-30b-a3b-Q4_K_M")).tensors}
    r = GGUFReader(p)
    src = {0: 0, 1: 6, 2: 8}
    assert len(r.tensors) == 3 + 3 * 12
    for t in r.tensors:
        parts = t.name.split(".")
        lname = t.name if parts[0] != "blk" else ".".join(["blk", str(src[int(parts[1])])] + parts[2:])
        lt = lay[lname]
        ne = list(lt.shape)
        if "_exps" in t.name or t.name.endswith("ffn_gate_inp.weight"):
            ne[-1] = 8
        assert t.tensor_type.name == lt.ggml_type and [int(x) for x in t.shape] == ne, t.name
        # the quantized raw byte shape gguf expects (uint8 rows of whole blocks)
        if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            assert t.data.dtype == np.uint8
            assert t.data.shape == quant_shape_to_byte_shape(tuple(reversed(ne)), t.tensor_type)
        assert t.data_offset % 32 == 0


def test_q6k_layer_pattern_is_kept(model_factory):
    r = GGUFReader(model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 8], experts=8))
    types = {t.name: t.tensor_type.name for t in r.tensors if t.name.endswith("ffn_down_exps.weight")}
    assert types == {"blk.0.ffn_down_exps.weight": "Q6_K", "blk.1.ffn_down_exps.weight": "Q4_K",
                     "blk.2.ffn_down_exps.weight": "Q6_K"}


def test_deepseek_dense_layers_and_counts():
    lay = load_layout(layout_path("deepseek-r1-Q4_K_M"))
    ts, meta, info = plan_model(lay, 4, 2)
    m = {k: v for k, v, _ in meta}
    assert info["expert_layers"] == [3]
    assert m["deepseek2.block_count"] == 4 and m["deepseek2.leading_dense_block_count"] == 3
    assert m["deepseek2.expert_count"] == 2 and m["deepseek2.expert_used_count"] == 2
    names = {t.name: t for t in ts}
    assert names["blk.3.exp_probs_b.bias"].shape == (2,)
    assert names["blk.3.ffn_gate_inp.weight"].shape == (7168, 2)
    assert names["blk.0.ffn_gate.weight"].shape == (7168, 18432)  # dense FFN untouched
    assert names["blk.3.ffn_gate_shexp.weight"].shape == (7168, 2048)
    with pytest.raises(SynthError, match="found no routed experts in kept blocks"):
        plan_model(lay, 3, 2)


def test_gpt_oss_biases_scaled():
    ts, meta, info = plan_model(load_layout(layout_path("gpt-oss-20b-MXFP4")), 1, 3)
    names = {t.name: t for t in ts}
    assert names["blk.0.ffn_up_exps.bias"].shape == (2880, 3) and names["blk.0.ffn_up_exps.bias"].part == "up_bias"
    assert names["blk.0.ffn_gate_inp.bias"].shape == (3,)
    assert names["blk.0.ffn_down_exps.weight"].nbytes == 3 * 4406400


def test_scaling_bounds():
    lay = load_layout("qwen3-30b-a3b-Q4_K_M")
    with pytest.raises(SynthError, match=r"experts: found 129, expected 1..128"):
        plan_model(lay, 2, 129)
    with pytest.raises(SynthError, match=r"layers: found 49, expected 1..48"):
        plan_model(lay, 49, 2)
    with pytest.raises(SynthError, match="legacy"):
        plan_model(load_layout(layout_path("gpt-oss-20b-MXFP4")), 1, 2, legacy=True)


def test_split_keys_and_names(model_factory):
    p = model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 8], experts=4, split=3, seed=3)
    d = os.path.dirname(p)
    files = sorted(os.listdir(d))
    assert files == ["model-00001-of-00003.gguf", "model-00002-of-00003.gguf", "model-00003-of-00003.gguf"]
    total = 0
    for i, f in enumerate(files):
        r = GGUFReader(os.path.join(d, f))
        assert r.fields["split.no"].contents() == i and r.fields["split.no"].types == [GGUFValueType.UINT16]
        assert r.fields["split.count"].contents() == 3 and r.fields["split.count"].types == [GGUFValueType.UINT16]
        assert r.fields["split.tensors.count"].types == [GGUFValueType.INT32]
        assert ("qwen3moe.expert_count" in r.fields) == (i == 0)
        assert len(r.tensors) > 0
        total += len(r.tensors)
    assert total == r.fields["split.tensors.count"].contents() == 39


def test_non_expert_tensors_are_holes_or_zeros(tmp_path):
    sp = write_model("qwen3-30b-a3b-Q4_K_M", tmp_path / "s.gguf", layers=[6], experts=2, progress=False)[0]
    de = write_model("qwen3-30b-a3b-Q4_K_M", tmp_path / "d.gguf", layers=[6], experts=2, progress=False,
                     sparse=False)[0]
    assert os.path.getsize(sp) == os.path.getsize(de)
    with open(sp, "rb") as a, open(de, "rb") as b:
        while True:
            x, y = a.read(1 << 24), b.read(1 << 24)
            assert x == y
            if not x:
                break
    assert os.stat(sp).st_blocks < os.stat(de).st_blocks


def test_cli_writes_and_reports(tmp_path, capsys):
    out = tmp_path / "c.gguf"
    assert synth_main(["--layout", "qwen3-30b-a3b-Q4_K_M", "--out", str(out), "--layers", "0,6",
                       "--experts", "2", "--seed", "4", "--quiet"]) == 0
    cap = capsys.readouterr()
    assert cap.out.strip() == str(out)
    assert "GiB written" in cap.err
    assert GGUFReader(str(out)).fields["moecached.tools.synth.seed"].contents() == 4


def test_partial_layouts_refused():
    d = shared_layouts_dir()
    if d is None:
        pytest.skip("shared layouts not found")
    for p in d.glob("*.partial.json"):
        with pytest.raises(LayoutError) as ei:
            load_layout(p)
        assert str(ei.value) == f"{p}: key complete: found false (partial layout, tensor types unknown), expected true"


def test_layout_validation_errors(tmp_path):
    good = {"metadata": {"general.architecture": "x"},
            "tensors": [{"name": "blk.0.ffn_up_exps.weight", "ggml_type": "Q4_K", "shape": [256, 4, 2]}]}

    def err(mut):
        d = json.loads(json.dumps(good))
        mut(d)
        p = tmp_path / "l.json"
        p.write_text(json.dumps(d))
        with pytest.raises(LayoutError) as ei:
            load_layout(p)
        return str(ei.value).split(": ", 1)[1]

    assert load_layout_ok(tmp_path, good).tensors[0].nbytes == 4 * 2 * 144
    assert err(lambda d: d["tensors"][0].update(ggml_type="Q9_Z")).startswith(
        "tensor blk.0.ffn_up_exps.weight: found ggml_type 'Q9_Z', expected one of gguf's types")
    assert err(lambda d: d["tensors"][0].update(shape=[100, 4, 2])) == (
        "tensor blk.0.ffn_up_exps.weight: found shape [100, 4, 2] (ne0 100 is not a multiple of Q4_K block size "
        "256), expected ne0 a multiple of the block size")
    assert err(lambda d: d["tensors"][0].update(nbytes=5)) == (
        "tensor blk.0.ffn_up_exps.weight: found nbytes 5, expected 1152 for Q4_K [256, 4, 2]")
    assert err(lambda d: d["tensors"].append(dict(d["tensors"][0]))) == (
        "tensor blk.0.ffn_up_exps.weight: found a second entry, expected unique names")
    assert err(lambda d: d.update(alignment=48)) == "key alignment: found 48, expected a power of two"


def load_layout_ok(tmp_path, d):
    p = tmp_path / "ok.json"
    p.write_text(json.dumps(d))
    return load_layout(p)


def test_embedded_default_is_small_and_matches_shared():
    p = DATA_DIR / "qwen3-30b-a3b-Q4_K_M.layout.json"
    assert p.stat().st_size < 200_000
    emb = load_layout("qwen3-30b-a3b-Q4_K_M")
    assert len(emb.tensors) == 579 and emb.arch == "qwen3moe"
    d = shared_layouts_dir()
    if d is None:
        pytest.skip("shared layouts not found")
    ref = load_layout(d / "qwen3-30b-a3b-Q4_K_M.json")
    assert [(t.name, t.ggml_type, t.shape, t.nbytes) for t in emb.tensors] == \
           [(t.name, t.ggml_type, t.shape, t.nbytes) for t in ref.tensors]
    assert emb.gguf_metadata()[0] == [x for x in ref.gguf_metadata()[0]]


def test_make_model_caches(tmp_path):
    a = make_model(tmp_path, "qwen3-30b-a3b-Q4_K_M", layers=[6], experts=2)
    m = os.stat(a).st_mtime_ns
    assert make_model(tmp_path / "other", "qwen3-30b-a3b-Q4_K_M", layers=[6], experts=2) == a
    assert os.stat(a).st_mtime_ns == m


# -- output path and --split refusals: one line, no traceback -----------------------------------

SYNTH_ARGS = ["--layout", "qwen3-30b-a3b-Q4_K_M", "--layers", "1", "--experts", "2", "--quiet"]


def _synth_ctl(argv, capsys):
    from moecached.tools import ctl
    rc = ctl.main(["synth"] + SYNTH_ARGS + argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_cli_out_is_a_directory(tmp_path, capsys):
    rc, out, err = _synth_ctl(["--out", str(tmp_path)], capsys)
    assert rc == 1 and out == ""
    assert err == (f"moecache-ctl synth: error: {tmp_path}: is a directory, expected a .gguf "
                   f"file path to write\n")


def test_cli_out_missing_parent_is_refused_not_created(tmp_path, capsys):
    d = tmp_path / "no" / "such"
    rc, out, err = _synth_ctl(["--out", str(d / "x.gguf")], capsys)
    assert rc == 1 and out == ""
    assert err == (f"moecache-ctl synth: error: {d / 'x.gguf'}: directory {d} does not exist, "
                   f"expected an existing directory (create it first)\n")
    assert not (tmp_path / "no").exists()


def test_cli_out_parent_is_a_file(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    rc, out, err = _synth_ctl(["--out", str(f / "x.gguf")], capsys)
    assert rc == 1 and err == (f"moecache-ctl synth: error: {f / 'x.gguf'}: {f} is not a "
                               f"directory, expected an existing directory\n")


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="no /dev/null")
def test_cli_out_not_a_regular_file(capsys):
    rc, out, err = _synth_ctl(["--out", "/dev/null"], capsys)
    assert rc == 1 and err == ("moecache-ctl synth: error: /dev/null: not a regular file, "
                               "expected a .gguf file path to write\n")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no procfs")
def test_cli_out_unwritable_oserror_is_one_line(capsys):
    rc, out, err = _synth_ctl(["--out", "/proc/moecached-test.gguf"], capsys)
    assert rc == 1 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("moecache-ctl synth: error: /proc/moecached-test.gguf: cannot write (")
    assert err.endswith("), expected a writable .gguf file path\n")


def test_write_model_oserror_becomes_synth_error(tmp_path, monkeypatch):
    import moecached.tools.synth as synth

    def boom(*a, **k):
        raise OSError(28, "No space left on device", str(tmp_path / "m.gguf"))
    monkeypatch.setattr(synth, "_write", boom)
    with pytest.raises(SynthError) as ei:
        write_model("qwen3-30b-a3b-Q4_K_M", tmp_path / "m.gguf", layers=[0], experts=2,
                    progress=False)
    assert str(ei.value) == (f"{tmp_path / 'm.gguf'}: cannot write (No space left on device), "
                             f"expected a writable .gguf file path")


@pytest.mark.parametrize("k", ["0", "-2"])
def test_cli_split_below_one_refused(tmp_path, capsys, k):
    rc, out, err = _synth_ctl(["--out", str(tmp_path / "m.gguf"), "--split", k], capsys)
    assert rc == 1 and out == ""
    assert err == f"moecache-ctl synth: error: --split {k}: expected an integer >= 1 (1 = no split)\n"
    assert not list(tmp_path.iterdir())
    with pytest.raises(SynthError, match="split: found 0"):
        write_model("qwen3-30b-a3b-Q4_K_M", tmp_path / "m.gguf", layers=[0], experts=2,
                    split=0, progress=False)


def test_cli_split_one_is_one_file(tmp_path, capsys):
    rc, out, _ = _synth_ctl(["--out", str(tmp_path / "m.gguf"), "--split", "1"], capsys)
    assert rc == 0 and out.strip() == str(tmp_path / "m.gguf")
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_synth_runnable_is_indexed_and_refuses_bad_shapes(tmp_path):
    from moecached.tools.ctl import main as ctl_main
    from moecached.engine.index import open_index
    from moecached.tools.synth_runnable import RunnableError, write_runnable
    out = str(tmp_path / "r.gguf")
    assert ctl_main(["synth", "--runnable", "--out", out, "--blocks", "3", "--experts", "8", "--top-k", "2",
                     "--quant", "q8_0"]) == 0
    idx = open_index(out).to_json()
    assert idx["arch"] == "qwen3moe" and idx["expert_layers"] == [0, 1, 2]
    assert idx["n_experts"] == 8 and idx["top_k"] == 2
    (sc,) = idx["size_classes"]
    assert sc["part_types"] == {"gate": "Q8_0", "up": "Q8_0", "down": "Q8_0"}
    assert sc["part_shapes"]["down"] == [64, 64]
    with pytest.raises(RunnableError, match="--hidden 48: Q8_0 needs a multiple of 32"):
        write_runnable(out, hidden=48, quant="q8_0")
    with pytest.raises(RunnableError, match="needs --llama-quantize"):
        write_runnable(out, quant="Q4_K_M")


@pytest.mark.parametrize("arch", ["llama", "olmoe"])
def test_synth_runnable_arch_writes_that_archs_keys_and_tensors(tmp_path, capsys, arch):
    from moecached.tools.ctl import main as ctl_main
    from moecached.engine.index import open_index
    out = str(tmp_path / "r.gguf")
    assert ctl_main(["synth", "--runnable", "--arch", arch, "--out", out, "--blocks", "2", "--experts", "8",
                     "--top-k", "2", "--quant", "q8_0"]) == 0
    f = GGUFReader(out)
    kv = {k: f.fields[k].contents() for k in f.fields if k.startswith(arch + ".")}
    assert f.fields["general.architecture"].contents() == arch
    assert kv[f"{arch}.expert_count"] == 8 and kv[f"{arch}.expert_used_count"] == 2
    # llama and olmoe take the expert FFN size from feed_forward_length (no expert_* key)
    assert kv[f"{arch}.feed_forward_length"] == 64 and f"{arch}.expert_feed_forward_length" not in kv
    shapes = {t.name: [int(n) for n in t.shape] for t in f.tensors}
    assert shapes["blk.1.ffn_gate_inp.weight"] == [64, 8]
    assert shapes["blk.1.ffn_down_exps.weight"] == [64, 64, 8]
    if arch == "llama":
        assert kv["llama.rope.dimension_count"] == kv["llama.attention.key_length"] == 16
        assert not [n for n in shapes if "_norm" in n and n.startswith("blk.") and "attn_q" in n]
    else:
        # q/k norms over the whole projection; no grouped KV
        assert shapes["blk.0.attn_q_norm.weight"] == shapes["blk.0.attn_k_norm.weight"] == [64]
        assert kv["olmoe.attention.head_count_kv"] == kv["olmoe.attention.head_count"] == 4
        assert kv["olmoe.attention.key_length"] == 16
    idx = open_index(out).to_json()
    assert idx["arch"] == arch and idx["expert_layers"] == [0, 1] and idx["top_k"] == 2


def test_synth_runnable_refuses_unknown_arch_and_olmoe_heads(tmp_path, capsys):
    from moecached.tools.ctl import main as ctl_main
    out = str(tmp_path / "r.gguf")
    assert ctl_main(["synth", "--runnable", "--arch", "mixtral", "--out", out]) == 1
    assert capsys.readouterr().err == ("moecache-ctl synth: error: --arch mixtral: expected one of qwen3moe, "
                                       "llama, olmoe (Mixtral-style MoE is llama)\n")
    assert ctl_main(["synth", "--runnable", "--arch", "olmoe", "--hidden", "96", "--out", out]) == 0
    capsys.readouterr()
    assert ctl_main(["synth", "--runnable", "--arch", "olmoe", "--hidden", "66", "--out", out]) == 1
    assert capsys.readouterr().err == ("moecache-ctl synth: error: --hidden 66: olmoe needs a multiple of the "
                                       "head count 4\n")
