"""Every refusal of open_index on a small crafted file, asserting the exact one-line error.

Files are written with gguf.GGUFWriter, then patched at field offsets found with GGUFReader
(no hand-written header parsing)."""
import os
import shutil
import struct
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFWriter

from moecached import MoecacheError
from moecached.engine.index import GGUF_VERSION_STR, GGUFError, open_index

Q4K = GGMLQuantizationType.Q4_K
Q6K = GGMLQuantizationType.Q6_K


def tiny(path, *, layers=2, experts=4, expert_layers=None, layer_experts=None, kv=None, alignment=None,
         endian=GGUFEndian.LITTLE, split_max_tensors=0, legacy=False, skip_legacy=None, extra=()):
    """A tiny qwen3moe-like model: per block attn_norm F32 [64], ffn_{gate,up}_exps Q4_K
    [256, 8, E], ffn_down_exps Q6_K [256, 8, E] (or legacy per-expert 2-D tensors)."""
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    w = GGUFWriter(str(path), "qwen3moe", endianess=endian, split_max_tensors=split_max_tensors)
    w.add_uint32("qwen3moe.block_count", layers)
    w.add_uint32("qwen3moe.expert_count", experts)
    w.add_uint32("qwen3moe.expert_used_count", 2)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for k, (v, t) in (kv or {}).items():
        w.add_key_value(k, v, t)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    el = range(layers) if expert_layers is None else expert_layers
    for b in range(layers):
        w.add_tensor(f"blk.{b}.attn_norm.weight", np.ones(64, dtype=np.float32))
        if b not in el:
            w.add_tensor(f"blk.{b}.ffn_gate.weight", np.zeros((8, 144), dtype=np.uint8), raw_dtype=Q4K)
            continue
        e = (layer_experts or {}).get(b, experts)
        for part, qt, rb in (("down", Q6K, 210), ("gate", Q4K, 144), ("up", Q4K, 144)):
            if legacy:
                for x in range(e):
                    if skip_legacy == (b, part, x):
                        continue
                    w.add_tensor(f"blk.{b}.ffn_{part}.{x}.weight", np.full((8, rb), x, dtype=np.uint8), raw_dtype=qt)
            else:
                w.add_tensor(f"blk.{b}.ffn_{part}_exps.weight", np.full((e, 8, rb), b, dtype=np.uint8), raw_dtype=qt)
    for name, arr, qt in extra:
        w.add_tensor(name, arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return [str(p) for p in w.format_shard_names(path)] if split_max_tensors else [str(path)]


def _off(reader, part):
    return part.ctypes.data - reader.data.ctypes.data


def kv_value_offset(path, key):
    r = GGUFReader(path)
    f = r.fields[key]
    return _off(r, f.parts[-1])


def tensor_part_offset(path, name, which):
    """Byte offset of a tensor-info part: which in name/n_dims/dims/type/offset."""
    r = GGUFReader(path)
    t = next(t for t in r.tensors if t.name == name)
    i = {"name": 1, "n_dims": 2, "dims": 3, "type": 4, "offset": 5}[which]
    return _off(r, t.field.parts[i]), r, t


def patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def refusal(path):
    with pytest.raises(GGUFError) as ei:
        open_index(path)
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


def test_good_tiny_file_opens(tmp_path):
    p, = tiny(tmp_path / "m.gguf")
    idx = open_index(p)
    assert idx.n_experts == 4 and idx.expert_layers == [0, 1] and idx.top_k == 2
    assert idx.size_classes[0].part_bytes == {"gate": 1152, "up": 1152, "down": 1680}


def test_truncated_file(tmp_path):
    p, = tiny(tmp_path / "m.gguf")
    r = GGUFReader(p)
    last = max(r.tensors, key=lambda t: t.data_offset)
    size = os.path.getsize(p)
    os.truncate(p, size - 100)
    assert refusal(p) == (f"{p}: tensor {last.name}: found data end at byte {last.data_offset + last.n_bytes}, "
                          f"expected at most the file size {size - 100} (truncated file?)")


def test_truncated_shard(tmp_path):
    paths = tiny(tmp_path / "m.gguf", split_max_tensors=4)
    assert len(paths) == 3
    r = GGUFReader(paths[1])
    last = max(r.tensors, key=lambda t: t.data_offset)
    os.truncate(paths[1], last.data_offset + 10)
    assert refusal(paths[0]) == (f"{paths[1]}: tensor {last.name}: found data end at byte "
                                 f"{last.data_offset + last.n_bytes}, expected at most the file size "
                                 f"{last.data_offset + 10} (truncated file?)")


def test_offset_near_2_64_is_overflow_safe(tmp_path):
    p, = tiny(tmp_path / "m.gguf")
    off, r, t = tensor_part_offset(p, "blk.0.ffn_gate_exps.weight", "offset")
    huge = 2**64 - 32
    patch(p, off, struct.pack("<Q", huge))
    assert refusal(p) == (f"{p}: tensor blk.0.ffn_gate_exps.weight: found data end at byte "
                          f"{r.data_offset + huge + t.n_bytes}, expected at most the file size {os.path.getsize(p)} "
                          f"(truncated file?)")


def test_span_too_small_for_type_and_shape(tmp_path):
    p, = tiny(tmp_path / "m.gguf")
    off, r, t = tensor_part_offset(p, "blk.0.ffn_gate_exps.weight", "dims")
    assert [int(x) for x in t.field.parts[3]] == [256, 8, 4]
    patch(p, off + 8, struct.pack("<Q", 16))  # ne1 8 -> 16: twice the bytes, runs into the next tensor
    nxt = min((x for x in r.tensors if x.data_offset > t.data_offset), key=lambda x: x.data_offset)
    assert refusal(p) == (f"{p}: tensor blk.0.ffn_gate_exps.weight: found span of {nxt.data_offset - t.data_offset} "
                          f"bytes (next tensor {nxt.name} starts at byte {nxt.data_offset}), expected at least "
                          f"{2 * t.n_bytes} bytes for Q4_K [256, 16, 4]")


def test_overlapping_tensor_offsets(tmp_path):
    p, = tiny(tmp_path / "m.gguf")
    r = GGUFReader(p)
    a = next(t for t in r.tensors if t.name == "blk.1.ffn_down_exps.weight")
    off, _, b = tensor_part_offset(p, "blk.1.ffn_gate_exps.weight", "offset")
    patch(p, off, struct.pack("<Q", a.data_offset - r.data_offset + 64))
    assert refusal(p) == (f"{p}: tensor blk.1.ffn_down_exps.weight: found span of 64 bytes (next tensor "
                          f"blk.1.ffn_gate_exps.weight starts at byte {a.data_offset + 64}), expected at least "
                          f"{a.n_bytes} bytes for Q6_K [256, 8, 4]")


def test_misaligned_tensor_offset(tmp_path):
    p, = tiny(tmp_path / "m.gguf")
    off, r, t = tensor_part_offset(p, "blk.0.ffn_up_exps.weight", "offset")
    rel = t.data_offset - r.data_offset
    patch(p, off, struct.pack("<Q", rel + 8))
    assert refusal(p) == (f"{p}: tensor blk.0.ffn_up_exps.weight: found data offset {rel + 8}, "
                          f"expected a multiple of alignment 32")


@pytest.mark.parametrize("value", [48, 0])
def test_alignment_not_power_of_two(tmp_path, value):
    p, = tiny(tmp_path / "m.gguf", alignment=64)
    assert open_index(p).alignment == 64
    patch(p, kv_value_offset(p, "general.alignment"), struct.pack("<I", value))
    assert refusal(p) == f"{p}: key general.alignment: found {value}, expected a power of two"


def test_alignment_wrong_type(tmp_path):
    from gguf import GGUFValueType
    p, = tiny(tmp_path / "m.gguf", kv={"general.alignment": (32, GGUFValueType.UINT64)})
    assert refusal(p) == f"{p}: key general.alignment: found type UINT64 (value 32), expected UINT32"


def test_duplicate_tensor_name_in_file(tmp_path):
    p, = tiny(tmp_path / "m.gguf")
    off, _, _ = tensor_part_offset(p, "blk.1.ffn_up_exps.weight", "name")
    patch(p, off, b"blk.0")  # blk.1.ffn_up_exps.weight -> blk.0.ffn_up_exps.weight
    assert refusal(p) == (f"{p}: tensor blk.0.ffn_up_exps.weight: found a second tensor of this name "
                          f"(in the same file), expected unique names")


def test_duplicate_tensor_name_across_shards(tmp_path):
    paths = tiny(tmp_path / "m.gguf", split_max_tensors=4)
    names0 = [t.name for t in GGUFReader(paths[0]).tensors]
    names2 = [t.name for t in GGUFReader(paths[2]).tensors]
    assert "blk.0.ffn_up_exps.weight" not in names0 and "blk.1.ffn_up_exps.weight" in names2
    # shard 3 holds blk.1.ffn_up_exps.weight; rename it to shard 1's blk.0.ffn_gate_exps.weight? different
    # length -- use blk.0.ffn_down_exps.weight (shard 1) from blk.1.ffn_down_exps.weight (shard 2) instead
    names1 = [t.name for t in GGUFReader(paths[1]).tensors]
    assert "blk.0.ffn_down_exps.weight" in names0 and "blk.1.ffn_down_exps.weight" in names1
    off, _, _ = tensor_part_offset(paths[1], "blk.1.ffn_down_exps.weight", "name")
    patch(paths[1], off, b"blk.0")
    assert refusal(paths[2]) == (f"{paths[1]}: tensor blk.0.ffn_down_exps.weight: found a second tensor of this "
                                 f"name (in m-00001-of-00003.gguf), expected unique names")


def test_missing_shard(tmp_path):
    paths = tiny(tmp_path / "m.gguf", split_max_tensors=4)
    os.remove(paths[1])
    assert refusal(paths[0]) == (f"{paths[1]}: shard: found no such file, expected shard 2 of 3 of split set "
                                 f"m-NNNNN-of-00003.gguf")


def test_shard_of_another_split_set(tmp_path):
    a = tiny(tmp_path / "a" / "m.gguf", split_max_tensors=4)
    b = tiny(tmp_path / "b" / "m.gguf", layers=3, split_max_tensors=6)
    assert len(a) == len(b) == 3
    shutil.copy(b[1], a[1])
    assert refusal(a[2]) == (f"{a[1]}: key split.tensors.count: found 13, expected 9 as in m-00001-of-00003.gguf "
                             f"(shard of another split set?)")


def test_split_count_disagrees_with_name(tmp_path):
    paths = tiny(tmp_path / "m.gguf", split_max_tensors=4)
    patch(paths[2], kv_value_offset(paths[2], "split.count"), struct.pack("<H", 4))
    assert refusal(paths[0]) == f"{paths[2]}: key split.count: found 4, expected 3 (from the file name)"


def test_split_no_disagrees_with_name(tmp_path):
    paths = tiny(tmp_path / "m.gguf", split_max_tensors=4)
    patch(paths[1], kv_value_offset(paths[1], "split.no"), struct.pack("<H", 0))
    assert refusal(paths[0]) == f"{paths[1]}: key split.no: found 0, expected 1 (shard 2 of the file name)"


def test_split_tensors_count_disagrees_with_found(tmp_path):
    paths = tiny(tmp_path / "m.gguf", split_max_tensors=4)
    for p in paths:
        patch(p, kv_value_offset(p, "split.tensors.count"), struct.pack("<i", 10))
    assert refusal(paths[0]) == (f"{paths[0]}: key split.tensors.count: found 10, expected 9 "
                                 f"(tensors found in 3 shards)")


def test_split_keys_in_unsplit_name(tmp_path):
    paths = tiny(tmp_path / "m.gguf", split_max_tensors=4)
    lone = str(tmp_path / "lone.gguf")
    shutil.copy(paths[0], lone)
    assert refusal(lone) == (f"{lone}: key split.count: found 3, expected 1 for a file not named "
                             f"PREFIX-NNNNN-of-NNNNN.gguf")


def test_expert_count_metadata_vs_shapes(tmp_path):
    p, = tiny(tmp_path / "m.gguf")
    patch(p, kv_value_offset(p, "qwen3moe.expert_count"), struct.pack("<I", 5))
    assert refusal(p) == (f"{p}: key qwen3moe.expert_count: found 5, expected 4 "
                          f"(experts in tensor blk.0.ffn_gate_exps.weight)")


def test_expert_count_differs_between_tensors(tmp_path):
    p, = tiny(tmp_path / "m.gguf", layer_experts={1: 2})
    assert refusal(p) == f"{p}: tensor blk.1.ffn_gate_exps.weight: found 2 experts, expected 4 as blk.0.ffn_gate_exps.weight"


def test_legacy_missing_expert(tmp_path):
    p, = tiny(tmp_path / "m.gguf", legacy=True, skip_legacy=(1, "up", 2))
    assert refusal(p) == (f"{p}: tensor blk.1.ffn_up.2.weight: found none, expected experts 0..3 "
                          f"(blk.1.ffn_up.3.weight exists)")


def test_unknown_ggml_type(tmp_path):
    p, = tiny(tmp_path / "m.gguf")
    off, _, _ = tensor_part_offset(p, "blk.0.ffn_down_exps.weight", "type")
    patch(p, off, struct.pack("<I", 99))
    top = max(int(t) for t in GGMLQuantizationType)
    assert refusal(p) == (f"{p}: tensor blk.0.ffn_down_exps.weight: found ggml type 99, expected a type known "
                          f"to gguf {GGUF_VERSION_STR} (0..{top})")


def test_unsupported_version(tmp_path):
    p, = tiny(tmp_path / "m.gguf")
    patch(p, 4, struct.pack("<I", 7))
    assert refusal(p) == f"{p}: key GGUF.version: found 7, expected one of [2, 3] (versions gguf {GGUF_VERSION_STR} reads)"


@pytest.mark.skipif(sys.byteorder != "little", reason="little-endian host assumed")
def test_big_endian_file(tmp_path):
    p, = tiny(tmp_path / "m.gguf", endian=GGUFEndian.BIG)
    assert refusal(p) == (f"{p}: header: found byte order swapped relative to this host (big-endian GGUF), "
                          f"expected little-endian")


def test_bad_magic(tmp_path):
    p, = tiny(tmp_path / "m.gguf")
    patch(p, 0, b"GGUX")
    assert refusal(p) == f"{p}: not a GGUF file (expected the magic GGUF at its start)"


def test_truncated_header(tmp_path):
    p, = tiny(tmp_path / "m.gguf")
    os.truncate(p, 40)
    assert refusal(p).startswith(f"{p}: header: found unreadable GGUF header (")


def test_no_routed_experts(tmp_path):
    p, = tiny(tmp_path / "m.gguf", expert_layers=[])
    assert refusal(p) == (f"{p}: tensors: found no routed-expert tensors (blk.N.ffn_*_exps.* or blk.N.ffn_*.E.weight) "
                          f"among 5, expected at least one")


def test_block_beyond_block_count(tmp_path):
    p, = tiny(tmp_path / "m.gguf")
    patch(p, kv_value_offset(p, "qwen3moe.block_count"), struct.pack("<I", 1))
    assert refusal(p) == f"{p}: tensor blk.1.attn_norm.weight: found block 1, expected < qwen3moe.block_count 1"


def test_missing_file(tmp_path):
    p = str(tmp_path / "nope.gguf")
    assert refusal(p) == f"{p}: file: found no such file, expected a GGUF model"


def test_cli_prints_one_line_and_exits_1(tmp_path, capsys):
    from moecached.tools.ctl import main
    p, = tiny(tmp_path / "m.gguf")
    patch(p, 4, struct.pack("<I", 7))
    assert main(["inspect", p]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"moecache-ctl inspect: error: {p}: key GGUF.version: found 7, expected one of [2, 3] "
                   f"(versions gguf {GGUF_VERSION_STR} reads)")
    assert issubclass(GGUFError, MoecacheError)
