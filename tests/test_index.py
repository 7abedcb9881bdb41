"""Round trips: synth a scaled model from every complete real layout, index it, and compare
with the layout JSON's own facts (``expert_bytes`` per layer, tensor table), then read every
expert slice through the index and check its stamp."""
import json
import os

import pytest
from gguf import GGUFReader

from fixtures import complete_layouts, layout_path, read_and_verify
from moecached.engine.index import ExpertIndex, PartSpan, open_index
from moecached.tools.inspect import main as inspect_main
from moecached.tools.synth import write_model

# (layers, experts) per layout: real per-expert sizes, small enough for a shared 2-core box
PARAMS = {
    "mixtral-8x7b-Q4_K_M": (1, 2),            # 114 MiB per expert
    "gpt-oss-20b-MXFP4": (4, 2),
    "qwen3-235b-a22b-Q4_K_M": (4, 2),
    "deepseek-r1-Q4_K_M": (4, 2),             # blocks 0-2 dense, block 3 routed
    "deepseek-v3-mla-Q4_K_M": (4, 2),
    "deepseek-v2-lite-Q4_K_M": (4, 4),
    "glm-4.7-flash-Q4_K_M": (4, 4),
    "olmoe-1b-7b-0924-Q4_K_M": (4, 4),
}
SHARED = {"deepseek-r1-Q4_K_M": 1, "deepseek-v3-mla-Q4_K_M": 1, "deepseek-v2-lite-Q4_K_M": 2,
          "glm-4.7-flash-Q4_K_M": 1, "qwen3-next-80b-a3b-Q4_K_M": 1, "qwen3-next-80b-a3b-Q4_K_M-fused-gate-up": 1}
LAYOUTS = complete_layouts() or ["qwen3-30b-a3b-Q4_K_M"]


def expected_from_layout(raw, src_layers, n_e):
    """Per kept expert block (renumbered): {part: (bytes_per_expert, type)} from the layout JSON."""
    eb = {e["layer"]: e for e in raw["expert_bytes"]}
    tensors = {t["name"]: t for t in raw["tensors"]}
    out = {}
    for dst, src in enumerate(src_layers):
        if src not in eb:
            continue
        parts = {p: (v["bytes_per_expert"], v["ggml_type"]) for p, v in eb[src].items() if p != "layer"}
        for p in ("gate", "up", "down", "gate_up"):
            bt = tensors.get(f"blk.{src}.ffn_{p}_exps.bias")
            if bt:
                assert bt["ggml_type"] == "F32"
                parts[f"{p}_bias"] = (bt["shape"][0] * 4, "F32")
        out[dst] = parts
    return out


@pytest.mark.parametrize("name", LAYOUTS)
def test_roundtrip_real_layout(tmp_path, name):
    lp = layout_path(name)
    raw = json.load(open(lp))
    layers, n_e = PARAMS.get(name, (4, 8))
    paths = write_model(lp, tmp_path / "m.gguf", layers=layers, experts=n_e, seed=7, progress=False)
    try:
        idx = open_index(paths[0])
        meta = raw["metadata"]
        arch = meta["general.architecture"]
        exp = expected_from_layout(raw, list(range(layers)), n_e)
        assert idx.n_layers == layers
        assert idx.expert_layers == sorted(exp)
        assert idx.n_experts == n_e
        assert idx.top_k == min(meta[f"{arch}.expert_used_count"], n_e)
        assert idx.n_shared_experts == SHARED.get(name, 0)
        # per-expert bytes and types, per block
        for b, parts in exp.items():
            c = idx.size_classes[idx.layer_class[b]]
            assert {p: (c.part_bytes[p], c.part_types[p]) for p in c.parts} == parts, b
            assert c.slot_bytes == sum(v[0] for v in parts.values())
        # size classes: blocks grouped exactly by their (part -> bytes, type) pattern
        groups = {}
        for b, parts in exp.items():
            groups.setdefault(tuple(sorted(parts.items())), []).append(b)
        assert sorted(sorted(g) for g in groups.values()) == sorted(c.layers for c in idx.size_classes)
        assert idx.routed_expert_bytes == sum(idx.size_classes[idx.layer_class[b]].slot_bytes for b in exp) * n_e
        # offsets agree with gguf's own reader
        r = GGUFReader(paths[0])
        by_name = {t.name: t for t in r.tensors}
        for b in idx.expert_layers:
            for e in (0, n_e - 1):
                for s in idx.parts(b, e):
                    stem = s.part[:-5] if s.part.endswith("_bias") else s.part
                    t = by_name[f"blk.{b}.ffn_{stem}_exps.{'bias' if s.part.endswith('_bias') else 'weight'}"]
                    assert s.offset == t.data_offset + e * s.nbytes
                    assert s.nbytes * n_e == t.n_bytes
        # every slice carries its own stamp
        assert read_and_verify(idx, seed=7) == []
        # and a wrong seed is noticed
        assert read_and_verify(idx, seed=8, experts=[0])
    finally:
        for p in paths:
            os.remove(p)


def test_inspect_json_cli(model_factory, capsys):
    p = model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 8], experts=8)
    assert inspect_main([p, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    for k in ("files", "n_layers", "expert_layers", "n_experts", "top_k", "n_shared_experts",
              "routed_expert_bytes", "size_classes"):
        assert k in d
    assert d["files"] == [os.path.abspath(p)]
    assert d["expert_layers"] == [0, 1, 2] and d["n_experts"] == 8 and d["top_k"] == 8
    cls = {tuple(c["layers"]): c for c in d["size_classes"]}
    assert set(cls) == {(0, 2), (1,)}
    assert cls[(0, 2)]["part_bytes"] == {"gate": 884736, "up": 884736, "down": 1290240}
    assert cls[(0, 2)]["part_types"] == {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}
    assert cls[(1,)]["slot_bytes"] == 3 * 884736
    assert d["routed_expert_bytes"] == 8 * (2 * 3059712 + 2654208)


def test_inspect_human(model_factory, capsys):
    p = model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 8], experts=8)
    assert inspect_main([p]) == 0
    out = capsys.readouterr().out
    assert "size class 0: 2 blocks (0,2), slot 3,059,712 B" in out
    assert "size class 1: 1 blocks (1), slot 2,654,208 B" in out
    assert "down       Q6_K          1,290,240  768x2048" in out
    assert out.strip().splitlines()[-1].startswith("total: routed experts 70,189,056 B")


def test_split_set_roundtrip(model_factory):
    p = model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 8], experts=4, split=3, seed=3)
    assert p.endswith("-00001-of-00003.gguf")
    idx = open_index(p)
    assert len(idx.files) == 3
    assert {s.file for b in idx.expert_layers for s in idx.parts(b, 0)} == {0, 1, 2}
    assert read_and_verify(idx, seed=3) == []
    for other in idx.files[1:]:
        j = open_index(other)
        assert j.files == idx.files and j.fingerprint() == idx.fingerprint()
    single = open_index(model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 8], experts=4, seed=3))
    a, b = single.to_json(), idx.to_json()
    for k in ("files", "fingerprint", "shared"):
        a.pop(k), b.pop(k)
    assert a == b


def test_legacy_per_expert_roundtrip(model_factory):
    p = model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6], experts=4, legacy=True, seed=1)
    r = GGUFReader(p)
    names = {t.name for t in r.tensors}
    assert "blk.0.ffn_gate.3.weight" in names and not any("_exps" in n for n in names)
    idx = open_index(p)
    merged = open_index(model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6], experts=4, seed=1))
    assert [(c.layers, c.parts, c.part_bytes, c.part_types) for c in idx.size_classes] == \
           [(c.layers, c.parts, c.part_bytes, c.part_types) for c in merged.size_classes]
    assert read_and_verify(idx, seed=1) == []
    by_name = {t.name: t for t in r.tensors}
    s = idx.parts(1, 2)
    assert s[0] == PartSpan("gate", 0, by_name["blk.1.ffn_gate.2.weight"].data_offset, 884736, "Q4_K", (2048, 768))


@pytest.mark.parametrize("name", ["mixtral-8x7b-Q4_K_M"])
def test_legacy_mixtral_roundtrip(tmp_path, name):
    paths = write_model(layout_path(name), tmp_path / "m.gguf", layers=1, experts=2, legacy=True, progress=False)
    try:
        idx = open_index(paths[0])
        c = idx.size_classes[0]
        assert c.part_bytes == {"gate": 33030144, "up": 33030144, "down": 48168960}
        assert read_and_verify(idx) == []
    finally:
        os.remove(paths[0])


def test_part_table_matches_parts(model_factory):
    idx = open_index(model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 8], experts=8))
    for b in idx.expert_layers:
        offs, fids = idx.part_table(b)
        assert offs.shape == fids.shape == (8, 3) and str(offs.dtype) == "int64" and str(fids.dtype) == "int32"
        assert not offs.flags.writeable
        for e in range(8):
            assert [s.offset for s in idx.parts(b, e)] == offs[e].tolist()
            assert [s.file for s in idx.parts(b, e)] == fids[e].tolist()


def test_bad_layer_and_expert(model_factory):
    idx = open_index(model_factory("deepseek-v2-lite-Q4_K_M", layers=2, experts=2))
    assert idx.expert_layers == [1]  # block 0 is dense: trace layer 0 == block 1
    with pytest.raises(KeyError, match="block 0 has no routed experts"):
        idx.parts(0, 0)
    with pytest.raises(KeyError):
        idx.part_table(5)
    with pytest.raises(ValueError, match="expert 2 out of range"):
        idx.parts(1, 2)
    with pytest.raises(ValueError):
        idx.parts(1, -1)
    kinds = {(s["layer"], s["kind"]) for s in idx.shared}
    assert (0, "dense_ffn") in kinds and (1, "shared_expert") in kinds


def test_fingerprint_stable_and_sensitive(tmp_path):
    paths = write_model(layout_path("qwen3-30b-a3b-Q4_K_M"), tmp_path / "m.gguf", layers=[6], experts=2,
                        progress=False)
    a = open_index(paths[0]).fingerprint()
    assert a == open_index(paths[0]).fingerprint()
    st = os.stat(paths[0])
    os.utime(paths[0], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert open_index(paths[0]).fingerprint() != a


def test_index_reads_no_tensor_data(tmp_path):
    """Opening the index touches headers only: a model whose expert bytes are holes opens fast
    and identically."""
    paths = write_model(layout_path("qwen3-30b-a3b-Q4_K_M"), tmp_path / "m.gguf", layers=[0], experts=2,
                        progress=False)
    idx = open_index(paths[0])
    assert isinstance(idx, ExpertIndex) and idx.size_classes[0].parts == ["gate", "up", "down"]


@pytest.mark.parametrize("shift", [4096, 32, -4096])
def test_misplaced_reads_are_caught(model_factory, shift):
    """The check itself can fail: an index whose offsets are off by a page or an alignment step
    (or that swaps two experts) is reported by read_and_verify."""
    idx = open_index(model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 8], experts=8))
    b = idx.expert_layers[1]
    offs, fids = idx.part_table(b)
    bad = offs.copy()
    bad[3, 1] += shift
    idx._tables[b] = (bad, fids)
    errs = read_and_verify(idx)
    assert len(errs) == 1 and errs[0].startswith(f"block {b} part up expert 3:")
    swapped = offs.copy()
    swapped[[2, 5]] = swapped[[5, 2]]
    idx._tables[b] = (swapped, fids)
    assert len(read_and_verify(idx)) == 2 * 3


# -- inspect of what is not a GGUF file: accurate one-liners -------------------------------------

def _inspect_ctl(path, capsys):
    from moecached.tools import ctl
    rc = ctl.main(["inspect", str(path)])
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.count("\n") == 1 and "Traceback" not in cap.err
    assert "truncated file?" not in cap.err
    return rc, cap.err.removeprefix("moecache-ctl inspect: error: ").rstrip("\n")


def test_inspect_directory(tmp_path, capsys):
    assert _inspect_ctl(tmp_path, capsys) == (1, f"{tmp_path}: is a directory, expected a GGUF file")


def test_inspect_empty_file(tmp_path, capsys):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"")
    assert _inspect_ctl(p, capsys) == (1, f"{p}: empty file (0 bytes), expected a GGUF file")


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="no /dev/null")
def test_inspect_dev_null(capsys):
    assert _inspect_ctl("/dev/null", capsys) == (
        1, "/dev/null: not a regular file (a character device), expected a GGUF file")


def test_inspect_fifo(tmp_path, capsys):
    import threading
    p = tmp_path / "fifo"
    os.mkfifo(p)

    def unblock():  # a reader stuck opening the FIFO (the bug) gets a writer and fails
        try:
            os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    timer = threading.Timer(3.0, unblock)
    timer.daemon = True
    timer.start()
    try:
        assert _inspect_ctl(p, capsys) == (1, f"{p}: not a regular file (a FIFO), expected a "
                                              f"GGUF file")
    finally:
        timer.cancel()


def test_inspect_short_and_text_files(tmp_path, capsys):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert _inspect_ctl(p, capsys) == (1, f"{p}: file too short (8 bytes), expected a GGUF file "
                                          f"(a GGUF header takes at least 24 bytes)")
    p.write_text("root:x:0:0:root:/root:/bin/bash\n")   # its bytes are not echoed
    assert _inspect_ctl(p, capsys) == (1, f"{p}: not a GGUF file (expected the magic GGUF at its "
                                          f"start)")
