"""Runnable MoE GGUF models for engine tests and benchmarks (``moecache-ctl synth --runnable``).

:mod:`moecached.tools.synth` writes real layouts with stamped (meaningless) expert bytes; llama.cpp
cannot run those. This module writes a small model llama.cpp loads and decodes: a softmax router
(``blk.N.ffn_gate_inp``) over SwiGLU experts in merged ``blk.N.ffn_{gate,up,down}_exps``
tensors, random weights of sane scale (normal, std 1/sqrt(fan-in); norms 1) from ``seed``, and
a byte-level vocabulary: ``<unk>``, ``<s>``, ``</s>`` then the 256 byte tokens ``<0x00>`` ..
``<0xFF>`` (SentencePiece byte fallback), so any text tokenizes.

Architectures (``arch``, the GGUF ``general.architecture``; llama.cpp's graph for each):

* ``qwen3moe``: per-head q/k RMS norms (``attn_{q,k}_norm`` of ``head_dim``), NeoX RoPE, top-k
  weights renormalised, expert FFN size in ``qwen3moe.expert_feed_forward_length``;
* ``llama``: Mixtral-style llama-MoE (no q/k norms, normal RoPE over the whole head,
  ``llama.rope.dimension_count``, top-k weights renormalised, the expert FFN size is
  ``llama.feed_forward_length``);
* ``olmoe``: q/k RMS norms over the whole projection (``attn_{q,k}_norm`` of ``hidden``, so
  ``heads x head_dim = hidden`` and no grouped KV: ``head_dim`` is ``hidden / heads``), top-k
  weights not renormalised, the expert FFN size is ``olmoe.feed_forward_length``.

Quantisation (``quant``): ``f32``; ``q8_0`` (every matrix Q8_0 via ``gguf.quants``; dimensions
must be multiples of 32); or any llama-quantize type name such as ``Q4_K_M`` when
``quantize_bin`` names a built ``llama-quantize`` (F32 is written first, then quantised; Q4_K_M
gives Q4_K and Q6_K expert tensors, so two size classes).

Trained weights (``weights``: GGUF tensor name -> numpy array in numpy's reversed ggml shape, as
:func:`tensor_shapes` lists them) replace the random ones, with their own vocabulary (``vocab``:
tokens, scores, types) and head geometry; ``benchmarks/train_moe.py`` exports its model this way.

``geometry="qwen3-30b-a3b"`` takes the real expert geometry of Qwen3-30B-A3B (hidden 2048,
expert FFN 768, 128 experts, top-8, 32 heads of 128, 4 KV heads) with ``blocks`` blocks (48 in
the real model; fewer keep the per-expert sizes) for benchmarks.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from moecached import MoecacheError

ARCHS = ("qwen3moe", "llama", "olmoe")
GEOMETRIES = {
    # hidden, expert_ff, experts, top_k, heads, kv_heads, head_dim
    "tiny": dict(hidden=64, expert_ff=64, experts=16, top_k=4, heads=4, kv_heads=2, head_dim=16),
    "qwen3-30b-a3b": dict(hidden=2048, expert_ff=768, experts=128, top_k=8, heads=32, kv_heads=4, head_dim=128),
}
N_VOCAB = 3 + 256


class RunnableError(MoecacheError):
    """The runnable model cannot be written as asked (one line)."""


def _vocab():
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256   # UNKNOWN, CONTROL, CONTROL, BYTE
    return tokens, [0.0] * len(tokens), types


def tensor_shapes(arch: str, blocks: int, *, hidden: int, expert_ff: int, experts: int, heads: int,
                  kv_heads: int, head_dim: int, n_vocab: int = N_VOCAB) -> dict:
    """GGUF tensor name -> numpy shape (reversed ggml shape) of every tensor the model has, in file order."""
    H, F, E, nh, nkv, hd = hidden, expert_ff, experts, heads, kv_heads, head_dim
    out = {"token_embd.weight": (n_vocab, H)}
    for b in range(blocks):
        p = f"blk.{b}."
        out[p + "attn_norm.weight"] = (H,)
        out[p + "attn_q.weight"] = (nh * hd, H)
        out[p + "attn_k.weight"] = (nkv * hd, H)
        out[p + "attn_v.weight"] = (nkv * hd, H)
        out[p + "attn_output.weight"] = (H, nh * hd)
        if arch == "qwen3moe":
            out[p + "attn_q_norm.weight"] = (hd,)
            out[p + "attn_k_norm.weight"] = (hd,)
        elif arch == "olmoe":
            out[p + "attn_q_norm.weight"] = (H,)
            out[p + "attn_k_norm.weight"] = (H,)
        out[p + "ffn_norm.weight"] = (H,)
        out[p + "ffn_gate_inp.weight"] = (E, H)
        out[p + "ffn_gate_exps.weight"] = (E, F, H)
        out[p + "ffn_up_exps.weight"] = (E, F, H)
        out[p + "ffn_down_exps.weight"] = (E, H, F)
    out["output_norm.weight"] = (H,)
    out["output.weight"] = (n_vocab, H)
    return out


def write_runnable(out: str, *, arch: str = "qwen3moe", blocks: int = 2, geometry: str = "tiny",
                   hidden: int | None = None, expert_ff: int | None = None, experts: int | None = None,
                   top_k: int | None = None, quant: str = "f32", seed: int = 0,
                   quantize_bin: str | None = None, heads: int | None = None, kv_heads: int | None = None,
                   head_dim: int | None = None, rope_base: float = 1000000.0, context_length: int = 4096,
                   weights=None, vocab=None, add_space_prefix: bool | None = None,
                   name: str | None = None) -> str:
    """Write the model to ``out`` (overwritten); returns ``out``. ``weights`` (name -> array, every
    tensor of :func:`tensor_shapes`) replaces the random weights; ``vocab`` is (tokens, scores, types)
    of a SentencePiece-style vocabulary (default: the byte-level one); ``add_space_prefix`` writes
    ``tokenizer.ggml.add_space_prefix`` (llama.cpp's default for this vocabulary is true)."""
    model_name = name   # (``name`` is reused below)
    if arch not in ARCHS:
        raise RunnableError(f"--arch {arch}: expected one of {', '.join(ARCHS)} (Mixtral-style MoE is llama)")
    if geometry not in GEOMETRIES:
        raise RunnableError(f"--geometry {geometry}: expected one of {', '.join(GEOMETRIES)}")
    g = dict(GEOMETRIES[geometry])
    for k, v in (("hidden", hidden), ("expert_ff", expert_ff), ("experts", experts), ("top_k", top_k),
                 ("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        if v is not None:
            g[k] = v
    if blocks < 1:
        raise RunnableError(f"--blocks {blocks}: expected an integer >= 1")
    if not 1 <= g["top_k"] <= g["experts"]:
        raise RunnableError(f"--top-k {g['top_k']}: expected 1..{g['experts']} (the expert count)")
    if arch == "olmoe":
        # q/k norms over the whole projection: heads x head_dim = hidden, as many KV heads
        if g["hidden"] % g["heads"]:
            raise RunnableError(f"--hidden {g['hidden']}: olmoe needs a multiple of the head count {g['heads']}")
        g["head_dim"], g["kv_heads"] = g["hidden"] // g["heads"], g["heads"]
    q = quant.lower()
    if q == "q8_0":
        for name in ("hidden", "expert_ff"):
            if g[name] % 32:
                raise RunnableError(f"--{name.replace('_', '-')} {g[name]}: Q8_0 needs a multiple of 32")
    elif q != "f32":
        if not quantize_bin:
            raise RunnableError(f"--quant {quant}: needs --llama-quantize PATH (a built llama-quantize); "
                                f"f32 and q8_0 are written directly")
        if not os.access(quantize_bin, os.X_OK):
            raise RunnableError(f"--llama-quantize {quantize_bin}: not an executable file")
        with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(out)) or ".") as td:
            f32 = os.path.join(td, "f32.gguf")
            write_runnable(f32, arch=arch, blocks=blocks, geometry=geometry, hidden=g["hidden"],
                           expert_ff=g["expert_ff"], experts=g["experts"], top_k=g["top_k"],
                           quant="f32", seed=seed, heads=g["heads"], kv_heads=g["kv_heads"],
                           head_dim=g["head_dim"], rope_base=rope_base, context_length=context_length,
                           weights=weights, vocab=vocab, add_space_prefix=add_space_prefix, name=model_name)
            r = subprocess.run([quantize_bin, f32, out, quant], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
            if r.returncode != 0:
                tail = r.stdout.strip().splitlines()[-1:] or ["(no output)"]
                raise RunnableError(f"{quantize_bin} {quant} failed ({r.returncode}): {tail[0]}")
        return out

    H, F, E, K = g["hidden"], g["expert_ff"], g["experts"], g["top_k"]
    nh, nkv, hd = g["heads"], g["kv_heads"], g["head_dim"]
    rng = np.random.default_rng(seed)
    tokens, scores, types = vocab if vocab is not None else _vocab()
    n_vocab = len(tokens)
    if weights is not None:
        want = tensor_shapes(arch, blocks, hidden=H, expert_ff=F, experts=E, heads=nh, kv_heads=nkv,
                             head_dim=hd, n_vocab=n_vocab)
        bad = [f"{k}: {tuple(np.shape(weights[k])) if k in weights else 'missing'} (expected {v})"
               for k, v in want.items() if k not in weights or tuple(np.shape(weights[k])) != v]
        if bad:
            raise RunnableError(f"weights do not fit the model: {bad[0]}" + (f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""))

    def mat(*shape, fan_in):
        return (rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(fan_in))).astype(np.float32)

    w = GGUFWriter(out, arch)
    w.add_name(model_name or f"moecached runnable {arch} {geometry} {blocks}x{E}")
    w.add_block_count(blocks)
    w.add_context_length(context_length)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)   # the expert FFN size for llama and olmoe
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(F)
    if arch == "llama":
        w.add_rope_dimension_count(hd)
    w.add_file_type(7 if q == "q8_0" else 0)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)

    # tensors are made one at a time while writing (real geometries do not fit in memory at once)
    plan = []   # (name, shape as numpy (reversed ggml), maker, quantized)

    def add(name, shape, maker, quantizable=True):
        if weights is not None:   # trained weights replace the maker (same order, same shapes)
            maker = (lambda n=name: np.ascontiguousarray(weights[n], dtype=np.float32))
        plan.append((name, shape, maker, q == "q8_0" and quantizable and len(shape) >= 2))

    def mat_maker(shape, fan_in, scale=1.0):
        def make():
            if len(shape) == 3:   # per expert, so the generator's stream does not depend on chunking
                return np.stack([mat(*shape[1:], fan_in=fan_in) * np.float32(scale) for _ in range(shape[0])])
            return mat(*shape, fan_in=fan_in) * np.float32(scale)
        return make

    ones = lambda n: (lambda: np.ones(n, np.float32))
    # numpy shapes are reversed ggml shapes: (ne1, ne0) / (ne2, ne1, ne0)
    add("token_embd.weight", (n_vocab, H), lambda: rng.standard_normal((n_vocab, H), dtype=np.float32))
    for b in range(blocks):
        p = f"blk.{b}."
        add(p + "attn_norm.weight", (H,), ones(H), False)
        add(p + "attn_q.weight", (nh * hd, H), mat_maker((nh * hd, H), H))
        add(p + "attn_k.weight", (nkv * hd, H), mat_maker((nkv * hd, H), H))
        add(p + "attn_v.weight", (nkv * hd, H), mat_maker((nkv * hd, H), H))
        add(p + "attn_output.weight", (H, nh * hd), mat_maker((H, nh * hd), nh * hd))
        if arch == "qwen3moe":
            add(p + "attn_q_norm.weight", (hd,), ones(hd), False)
            add(p + "attn_k_norm.weight", (hd,), ones(hd), False)
        elif arch == "olmoe":
            add(p + "attn_q_norm.weight", (H,), ones(H), False)
            add(p + "attn_k_norm.weight", (H,), ones(H), False)
        add(p + "ffn_norm.weight", (H,), ones(H), False)
        # the router stays F32 (as real conversions keep it at high precision)
        add(p + "ffn_gate_inp.weight", (E, H), mat_maker((E, H), H, 4.0), False)
        add(p + "ffn_gate_exps.weight", (E, F, H), mat_maker((E, F, H), H))
        add(p + "ffn_up_exps.weight", (E, F, H), mat_maker((E, F, H), H))
        add(p + "ffn_down_exps.weight", (E, H, F), mat_maker((E, H, F), F))
    add("output_norm.weight", (H,), ones(H), False)
    add("output.weight", (n_vocab, H), mat_maker((n_vocab, H), H))
    q8 = GGMLQuantizationType.Q8_0
    for name, shape, _, quant_it in plan:
        if quant_it:
            bshape = tuple(shape[:-1]) + (shape[-1] // 32 * 34,)
            w.add_tensor_info(name, bshape, np.dtype(np.uint8), int(np.prod(bshape)), raw_dtype=q8)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, make, quant_it in plan:
        arr = make()
        w.write_tensor_data(quantize(arr, q8) if quant_it else arr)
    w.close()
    return out


def main(argv=None) -> int:
    """``moecache-ctl synth --runnable --out PATH [--arch qwen3moe|llama|olmoe] [--blocks N] [--geometry tiny|
    qwen3-30b-a3b] [--hidden H] [--expert-ff F] [--experts E] [--top-k K] [--quant f32|q8_0|TYPE]
    [--llama-quantize PATH] [--seed S]``"""
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="moecache-ctl synth --runnable",
                                 description="write a small MoE GGUF model that llama.cpp runs "
                                             "(random weights, byte-level vocabulary)")
    ap.add_argument("--out", required=True, help="output .gguf path (overwritten)")
    ap.add_argument("--arch", default="qwen3moe", help=f"architecture: {', '.join(ARCHS)} (default qwen3moe; llama is "
                                                         f"Mixtral-style llama-MoE)")
    ap.add_argument("--blocks", type=int, default=2, help="transformer blocks (default 2)")
    ap.add_argument("--geometry", default="tiny", help=f"base geometry ({', '.join(GEOMETRIES)}; default tiny)")
    ap.add_argument("--hidden", type=int, help="hidden size (overrides the geometry)")
    ap.add_argument("--expert-ff", type=int, help="expert FFN size (overrides the geometry)")
    ap.add_argument("--experts", type=int, help="experts per block (overrides the geometry)")
    ap.add_argument("--top-k", type=int, help="experts used per token (overrides the geometry)")
    ap.add_argument("--quant", default="f32", help="f32 (default), q8_0, or a llama-quantize type "
                                                   "(Q4_K_M, ...) with --llama-quantize")
    ap.add_argument("--llama-quantize", help="path of a built llama-quantize")
    ap.add_argument("--seed", type=int, default=0, help="selects the weights (default 0)")
    a = ap.parse_args(argv)
    out = write_runnable(a.out, arch=a.arch, blocks=a.blocks, geometry=a.geometry, hidden=a.hidden,
                         expert_ff=a.expert_ff, experts=a.experts, top_k=a.top_k, quant=a.quant,
                         seed=a.seed, quantize_bin=a.llama_quantize)
    print(out)
    print(f"wrote {Path(out).stat().st_size / 2**20:.1f} MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
