"""Train a small MoE language model in llama.cpp's qwen3moe architecture, export it to GGUF and check
it against llama.cpp: a model whose routing is learned, for the engine tests and benchmarks.

    python benchmarks/train_moe.py train --out DIR [--device cuda] [--tokens 150M] [geometry flags]
    python benchmarks/train_moe.py export --weights DIR/weights.npz --out model.gguf [--quant q8_0]
    python benchmarks/train_moe.py check --model model.gguf --text FILE [--weights DIR/weights.npz]
    python benchmarks/train_moe.py route --model model.gguf|weights.npz --text FILE --out trace.npz
    python benchmarks/train_moe.py predict --model model.gguf --text FILE

The model (PyTorch, the same graph as llama.cpp's ``qwen3moe``): token embedding; per block an
RMSNorm, GQA attention with per-head q/k RMSNorm and NeoX RoPE, an RMSNorm and a softmax router over
``experts`` SwiGLU experts of which the top ``top_k`` are used with their weights renormalised to sum
1 (qwen3moe always renormalises; no shared expert); a final RMSNorm and an untied output matrix.
Training adds the Switch-style load-balancing loss (``--aux``) so that every expert is used.

Tokenizer: bytes, written as a SentencePiece vocabulary llama.cpp reproduces exactly: ``<unk>``,
``<s>``, ``</s>``, the 256 byte tokens ``<0xNN>`` and one normal token ``▁`` (id 259). llama.cpp's
SPM path turns every space into ``▁`` (U+2581), so a space (and a literal ``▁``) is token 259 and
every other byte its byte token; ``add_space_prefix`` is written false, so no space is prepended, and
``<s>`` (BOS) starts every sequence as llama.cpp starts every prompt.

Corpus: the ``.py`` files under ``--corpus DIR`` (default: the running Python's standard library,
``sysconfig`` ``stdlib``), without ``site-packages``, sorted by path, each followed by ``</s>``; a file whose path's CRC-32 is 0 mod 20
is held out. ``train`` prints the corpus's size and SHA-256, the held-out perplexity and a unigram
model's on the same tokens, and writes ``weights.npz`` (GGUF names and shapes, float32),
``config.json`` and ``heldout.txt`` (the first held-out text, for ``check`` and ``route``).

Deterministic: one ``--seed`` selects the initial weights and the batches; the token budget is fixed
(``--tokens``; the cosine schedule spans it). On CUDA some kernels are not bitwise deterministic, so
a second run agrees in its figures, not in every bit.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

BOS, EOS, SPACE = 1, 2, 259
N_VOCAB = 260
DEFAULTS = dict(blocks=8, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=32, expert_ff=64, top_k=4,
                rope_base=10000.0, norm_eps=1e-6, context=512)


# ---------------------------------------------------------------------------------------------
# tokenizer


def vocab():
    """(tokens, scores, types) of the GGUF vocabulary."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581"]
    types = [2, 3, 3] + [6] * 256 + [1]   # UNKNOWN, CONTROL, CONTROL, BYTE..., NORMAL
    return tokens, [0.0] * len(tokens), types


def encode(text: str) -> np.ndarray:
    """Token ids of ``text`` (no BOS), as llama.cpp tokenizes it with this vocabulary."""
    b = np.frombuffer(text.replace("\u2581", " ").encode("utf-8"), dtype=np.uint8)
    ids = b.astype(np.int16) + 3
    ids[b == 0x20] = SPACE
    return ids


def decode(ids) -> bytes:
    out = bytearray()
    for t in ids:
        t = int(t)
        if t == SPACE:
            out += b" "
        elif 3 <= t < 259:
            out.append(t - 3)
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# corpus


def corpus_files(root: str):
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        files += [os.path.join(d, n) for n in names if n.endswith(".py")]
    return sorted(files, key=lambda p: os.path.relpath(p, root))


def load_corpus(root: str):
    """(train ids, held-out ids, held-out text head, info): ``</s>`` after every file."""
    parts = {False: [], True: []}
    heldout_text = []
    h = hashlib.sha256()
    n_files = {False: 0, True: 0}
    eos = np.array([EOS], np.int16)
    for p in corpus_files(root):
        rel = os.path.relpath(p, root)
        try:
            with open(p, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        h.update(rel.encode() + b"\0" + text.encode("utf-8") + b"\0")
        held = zlib.crc32(rel.encode()) % 20 == 0
        parts[held] += [encode(text), eos]
        n_files[held] += 1
        if held and sum(len(t) for t in heldout_text) < 200_000:
            heldout_text.append(text)
    train, held = np.concatenate(parts[False]), np.concatenate(parts[True])
    info = dict(root=root, python=sys.version.split()[0], files=n_files[False] + n_files[True],
                heldout_files=n_files[True], train_tokens=int(len(train)), heldout_tokens=int(len(held)),
                sha256=h.hexdigest())
    return train, held, "\n".join(heldout_text), info


def unigram_ppl(train, held):
    c = np.bincount(train.astype(np.int64), minlength=N_VOCAB).astype(np.float64) + 1.0
    logp = np.log(c / c.sum())
    return float(np.exp(-logp[held.astype(np.int64)].mean()))


# ---------------------------------------------------------------------------------------------
# model


def build_model(cfg):
    import torch
    import torch.nn as nn
    import torch.nn.functional as Fn

    H, E, F, K = cfg["hidden"], cfg["experts"], cfg["expert_ff"], cfg["top_k"]
    nh, nkv, hd, L = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["blocks"]
    eps = cfg["norm_eps"]

    def rms(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm = nn.Parameter(torch.ones(H))
            self.wq = nn.Linear(H, nh * hd, bias=False)
            self.wk = nn.Linear(H, nkv * hd, bias=False)
            self.wv = nn.Linear(H, nkv * hd, bias=False)
            self.wo = nn.Linear(nh * hd, H, bias=False)
            self.q_norm = nn.Parameter(torch.ones(hd))
            self.k_norm = nn.Parameter(torch.ones(hd))
            self.ffn_norm = nn.Parameter(torch.ones(H))
            self.router = nn.Linear(H, E, bias=False)
            self.gate = nn.Parameter(torch.empty(E, F, H))
            self.up = nn.Parameter(torch.empty(E, F, H))
            self.down = nn.Parameter(torch.empty(E, H, F))

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            h = rms(x, self.attn_norm)
            q = rms(self.wq(h).view(B, T, nh, hd), self.q_norm)
            k = rms(self.wk(h).view(B, T, nkv, hd), self.k_norm)
            v = self.wv(h).view(B, T, nkv, hd)

            def rope(t):   # NeoX: the halves of each head rotate together
                t1, t2 = t[..., : hd // 2], t[..., hd // 2:]
                return torch.cat([t1 * cos - t2 * sin, t1 * sin + t2 * cos], -1)

            v = v.transpose(1, 2)
            q, k = rope(q).transpose(1, 2).to(v.dtype), rope(k).transpose(1, 2).to(v.dtype)
            k = k.repeat_interleave(nh // nkv, 1)   # query head i reads KV head i // (nh / nkv)
            v = v.repeat_interleave(nh // nkv, 1)
            a = Fn.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.wo(a.transpose(1, 2).reshape(B, T, nh * hd))

            self.ffn_inp = x if getattr(self, "keep_ffn_inp", False) else None   # for ``predict``
            h = rms(x, self.ffn_norm).reshape(B * T, H)
            logits = self.router(h).float()
            probs = logits.softmax(-1)
            top_w, top_i = probs.topk(K, -1)
            top_w = top_w / top_w.sum(-1, keepdim=True)
            # every expert on every token, weighted by the (mostly zero) routing weights: the same
            # sums as the routed computation, as three wide matmuls
            g = h @ self.gate.reshape(E * F, H).t()
            u = h @ self.up.reshape(E * F, H).t()
            dense_w = torch.zeros_like(probs).scatter(1, top_i, top_w).to(g.dtype)
            act = (Fn.silu(g) * u).view(-1, E, F) * dense_w.unsqueeze(-1)
            y = act.reshape(-1, E * F) @ self.down.permute(0, 2, 1).reshape(E * F, H)
            x = x + y.view(B, T, H)
            # Switch load balance: E * sum_e (fraction of routed slots on e) * (mean probability of e)
            frac = torch.zeros(E, device=x.device).index_add_(0, top_i.reshape(-1), torch.ones(top_i.numel(), device=x.device)) / top_i.numel()
            aux = E * (frac * probs.mean(0)).sum()
            return x, aux, top_i

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embd = nn.Parameter(torch.empty(N_VOCAB, H))
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.output_norm = nn.Parameter(torch.ones(H))
            self.output = nn.Linear(H, N_VOCAB, bias=False)
            inv = 1.0 / (cfg["rope_base"] ** (torch.arange(0, hd // 2, dtype=torch.float64) * 2 / hd))
            self.register_buffer("inv_freq", inv.float(), persistent=False)

        def init_weights(self):
            std = 0.02
            nn.init.normal_(self.tok_embd, std=std)
            nn.init.normal_(self.output.weight, std=std)
            for b in self.blocks:
                for lin in (b.wq, b.wk, b.wv, b.router):
                    nn.init.normal_(lin.weight, std=std)
                nn.init.normal_(b.wo.weight, std=std / math.sqrt(2 * L))
                nn.init.normal_(b.gate, std=std)
                nn.init.normal_(b.up, std=std)
                nn.init.normal_(b.down, std=std / math.sqrt(2 * L))

        def forward(self, ids, routing=False):
            B, T = ids.shape
            pos = torch.arange(T, device=ids.device, dtype=torch.float32)
            ang = pos[:, None] * self.inv_freq[None, :]
            cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
            x = self.tok_embd[ids]
            aux, routes = 0.0, []
            for b in self.blocks:
                x, a, top_i = b(x, cos.to(x.dtype), sin.to(x.dtype))
                aux = aux + a
                if routing:
                    routes.append(top_i.view(B, T, K))
            logits = self.output(rms(x, self.output_norm))
            return (logits, aux / L, routes) if routing else (logits, aux / L)

        def gguf_weights(self):
            """GGUF tensor name -> float32 numpy array (numpy shapes are reversed ggml shapes)."""
            n = lambda t: t.detach().float().cpu().numpy()
            w = {"token_embd.weight": n(self.tok_embd)}
            for i, b in enumerate(self.blocks):
                p = f"blk.{i}."
                w[p + "attn_norm.weight"] = n(b.attn_norm)
                w[p + "attn_q.weight"] = n(b.wq.weight)
                w[p + "attn_k.weight"] = n(b.wk.weight)
                w[p + "attn_v.weight"] = n(b.wv.weight)
                w[p + "attn_output.weight"] = n(b.wo.weight)
                w[p + "attn_q_norm.weight"] = n(b.q_norm)
                w[p + "attn_k_norm.weight"] = n(b.k_norm)
                w[p + "ffn_norm.weight"] = n(b.ffn_norm)
                w[p + "ffn_gate_inp.weight"] = n(b.router.weight)
                w[p + "ffn_gate_exps.weight"] = n(b.gate)
                w[p + "ffn_up_exps.weight"] = n(b.up)
                w[p + "ffn_down_exps.weight"] = n(b.down)
            w["output_norm.weight"] = n(self.output_norm)
            w["output.weight"] = n(self.output.weight)
            return w

        def load_gguf_weights(self, w):
            t = lambda a: torch.from_numpy(np.array(a, dtype=np.float32))
            with torch.no_grad():
                self.tok_embd.copy_(t(w["token_embd.weight"]))
                for i, b in enumerate(self.blocks):
                    p = f"blk.{i}."
                    for name, dst in (("attn_norm", b.attn_norm), ("attn_q", b.wq.weight), ("attn_k", b.wk.weight),
                                      ("attn_v", b.wv.weight), ("attn_output", b.wo.weight),
                                      ("attn_q_norm", b.q_norm), ("attn_k_norm", b.k_norm), ("ffn_norm", b.ffn_norm),
                                      ("ffn_gate_inp", b.router.weight), ("ffn_gate_exps", b.gate),
                                      ("ffn_up_exps", b.up), ("ffn_down_exps", b.down)):
                        dst.copy_(t(w[p + name + ".weight"]))
                self.output_norm.copy_(t(w["output_norm.weight"]))
                self.output.weight.copy_(t(w["output.weight"]))

    return MoE()


def load_trained(weights_path, device="cpu"):
    """(model, cfg) from ``weights.npz`` and the ``config.json`` beside it."""
    with open(os.path.join(os.path.dirname(os.path.abspath(weights_path)), "config.json")) as f:
        cfg = json.load(f)["model"]
    model = build_model(cfg)
    model.load_gguf_weights(dict(np.load(weights_path)))
    return model.to(device).eval(), cfg


def read_gguf(path):
    """(weights, cfg) of a qwen3moe GGUF this script exported (F32 or Q8_0, dequantised)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    r = GGUFReader(path)

    def kv(key):
        f = r.fields[key]
        return f.parts[f.data[0]].tolist()[0]

    a = "qwen3moe."
    cfg = dict(blocks=kv(a + "block_count"), hidden=kv(a + "embedding_length"), heads=kv(a + "attention.head_count"),
               kv_heads=kv(a + "attention.head_count_kv"), head_dim=kv(a + "attention.key_length"),
               experts=kv(a + "expert_count"), expert_ff=kv(a + "expert_feed_forward_length"),
               top_k=kv(a + "expert_used_count"), rope_base=float(kv(a + "rope.freq_base")),
               norm_eps=float(kv(a + "attention.layer_norm_rms_epsilon")), context=kv(a + "context_length"))
    w = {}
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        w[t.name] = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    return w, cfg


def load_model(path, device="cpu"):
    """(model, cfg) from ``weights.npz`` (with the ``config.json`` beside it) or from an exported GGUF."""
    if path.endswith(".gguf"):
        w, cfg = read_gguf(path)
        model = build_model(cfg)
        model.load_gguf_weights(w)
        return model.to(device).eval(), cfg
    return load_trained(path, device)


def count_params(model):
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# commands


def parse_count(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def evaluate(model, held, seq, device, max_tokens, batch=16):
    """Held-out mean NLL per token: non-overlapping windows, each after ``<s>``."""
    import torch
    n_win = min(len(held) // seq, max(1, max_tokens // seq))
    tot, cnt = 0.0, 0
    model.eval()
    with torch.no_grad():
        for s in range(0, n_win, batch):
            idx = np.arange(s, min(n_win, s + batch))
            tgt = np.stack([held[i * seq:(i + 1) * seq] for i in idx]).astype(np.int64)
            inp = np.concatenate([np.full((len(idx), 1), BOS), tgt[:, :-1]], 1)
            logits, _ = model(torch.from_numpy(inp).to(device))
            nll = torch.nn.functional.cross_entropy(logits.float().reshape(-1, N_VOCAB),
                                                    torch.from_numpy(tgt).to(device).reshape(-1), reduction="sum")
            tot += float(nll)
            cnt += tgt.size
    model.train()
    return tot / cnt, cnt


def cmd_train(a):
    import torch
    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    dev = torch.device(a.device)
    cfg = {k: getattr(a, k) for k in DEFAULTS}
    cfg["context"] = max(cfg["context"], a.seq)
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    root = a.corpus or sysconfig.get_paths()["stdlib"]
    train, held, held_text, info = load_corpus(root)
    print(f"corpus: {info['files']} files under {root} (Python {info['python']} running), {info['train_tokens']} train tokens, "
          f"{info['heldout_tokens']} held-out tokens ({info['heldout_files']} files), sha256 {info['sha256'][:16]}, "
          f"read in {time.time() - t0:.1f} s", flush=True)
    uni = unigram_ppl(train, held)
    print(f"unigram model: held-out perplexity {uni:.2f}", flush=True)

    model = build_model(cfg)
    model.init_weights()
    model.to(dev)
    n_params = count_params(model)
    n_active = n_params - cfg["blocks"] * 3 * cfg["hidden"] * cfg["expert_ff"] * (cfg["experts"] - cfg["top_k"])
    print(f"model: {n_params / 1e6:.2f} M parameters ({n_active / 1e6:.2f} M active per token), {cfg}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
    step_tokens = a.batch * a.seq
    steps = max(1, a.tokens // step_tokens)
    warm = min(a.warmup, steps // 10 + 1)

    def lr_at(s):
        if s < warm:
            return a.lr * (s + 1) / warm
        p = (s - warm) / max(1, steps - warm)
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    rng = np.random.default_rng(a.seed)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    print(f"training: {steps} steps of {a.batch} x {a.seq} tokens = {steps * step_tokens / 1e6:.1f} M tokens, "
          f"lr {a.lr} (warmup {warm}, cosine to 10 %), aux {a.aux}, seed {a.seed}, {dev}", flush=True)
    t_train = time.time()
    s = 0
    stopped = False
    for s in range(steps):
        starts = rng.integers(0, len(train) - a.seq, a.batch)
        tgt = np.stack([train[i:i + a.seq] for i in starts]).astype(np.int64)
        inp = np.concatenate([np.full((a.batch, 1), BOS), tgt[:, :-1]], 1)
        inp_t, tgt_t = torch.from_numpy(inp).to(dev, non_blocking=True), torch.from_numpy(tgt).to(dev, non_blocking=True)
        for g in opt.param_groups:
            g["lr"] = lr_at(s)
        with amp:
            logits, aux = model(inp_t)
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, N_VOCAB), tgt_t.reshape(-1))
        (loss + a.aux * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if s % a.log_every == 0 or s == steps - 1:
            el = time.time() - t_train
            print(f"step {s}/{steps} loss {loss.item():.4f} aux {aux.item():.3f} lr {lr_at(s):.2e} "
                  f"{(s + 1) * step_tokens / max(el, 1e-9) / 1e3:.0f} k tok/s {el:.0f} s", flush=True)
        if a.eval_every and (s + 1) % a.eval_every == 0 and s + 1 < steps:
            nll_s, _ = evaluate(model, held, a.seq, dev, 64 * a.seq)
            print(f"eval step {s + 1}: held-out perplexity {math.exp(nll_s):.3f} (first {64 * a.seq} tokens; "
                  f"train loss {loss.item():.4f})", flush=True)
        if a.max_seconds and time.time() - t_train > a.max_seconds:
            print(f"STOPPED by --max-seconds {a.max_seconds} at step {s + 1} of {steps}: the token budget was not reached",
                  flush=True)
            stopped = True
            break
    train_s = time.time() - t_train
    model.float()
    nll, n_eval = evaluate(model, held, a.seq, dev, a.eval_tokens)
    ppl = math.exp(nll)
    print(f"held-out: perplexity {ppl:.3f} ({nll / math.log(2):.3f} bits per token) over {n_eval} tokens; "
          f"unigram {uni:.2f}", flush=True)
    w = model.gguf_weights()
    np.savez(os.path.join(a.out, "weights.npz"), **w)
    with open(os.path.join(a.out, "heldout.txt"), "w", encoding="utf-8") as f:
        f.write(held_text)
    result = dict(model=cfg, params=n_params, active_params=n_active, corpus=info, seed=a.seed,
                  tokens=(s + 1) * step_tokens, steps=s + 1, planned_steps=steps, stopped_early=stopped,
                  batch=a.batch, seq=a.seq, lr=a.lr, aux=a.aux, wd=a.wd, train_seconds=round(train_s, 1),
                  device=str(torch.cuda.get_device_name(0)) if dev.type == "cuda" else "cpu", torch=torch.__version__,
                  heldout_ppl=ppl, heldout_eval_tokens=n_eval, unigram_ppl=uni)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k not in ("model", "corpus")}))
    return 0


def export(weights_path: str, out: str, quant: str = "f32", quantize_bin: str | None = None) -> str:
    """Write the trained model as a GGUF llama.cpp runs (qwen3moe)."""
    with open(os.path.join(os.path.dirname(os.path.abspath(weights_path)), "config.json")) as f:
        meta = json.load(f)
    name = f"moecached trained qwen3moe {meta['model']['blocks']}x{meta['model']['experts']} " \
           f"(Python stdlib, {meta['tokens'] / 1e6:.0f}M tokens, seed {meta['seed']})"
    return write_gguf(out, dict(np.load(weights_path)), meta["model"], quant, quantize_bin, name)


def write_gguf(out: str, w: dict, c: dict, quant: str = "f32", quantize_bin: str | None = None,
               name: str | None = None) -> str:
    """GGUF tensors ``w`` of the model ``c`` (``config.json``'s ``model``) written by synth_runnable."""
    from moecached.tools.synth_runnable import write_runnable
    return write_runnable(out, arch="qwen3moe", blocks=c["blocks"], hidden=c["hidden"], expert_ff=c["expert_ff"],
                          experts=c["experts"], top_k=c["top_k"], heads=c["heads"], kv_heads=c["kv_heads"],
                          head_dim=c["head_dim"], rope_base=c["rope_base"], context_length=c["context"],
                          quant=quant, quantize_bin=quantize_bin, weights=w, vocab=vocab(), add_space_prefix=False,
                          name=name or f"moecached trained qwen3moe {c['blocks']}x{c['experts']}")


def cmd_export(a):
    out = export(a.weights, a.out, a.quant, a.llama_quantize)
    print(f"{out}: {os.path.getsize(out) / 2**20:.2f} MiB")
    return 0


def torch_greedy(model, ids, steps):
    """PyTorch greedy decode: (logits rows as llama.cpp's mc-decode dumps them, generated ids)."""
    import torch
    seq = list(ids)
    rows = []
    with torch.no_grad():
        for _ in range(steps + 1):
            logits, _ = model(torch.tensor([seq]))
            row = logits[0, -1].float().numpy()
            rows.append(row)
            seq.append(int(row.argmax()))
    return np.stack(rows), seq[len(ids):]


def cmd_check(a):
    """Prompt ids, logits and greedy text of PyTorch against llama.cpp (mc-decode, llama-tokenize)."""
    import subprocess
    import tempfile
    from moecached.tools.engine_llama import decode as mc_decode, llama_bin
    model, cfg = load_model(a.weights or a.model)
    text = open(a.text, encoding="utf-8").read()
    prompt = text[a.offset:a.offset + a.chars]
    ids = [BOS] + encode(prompt).tolist()
    bin_dir = llama_bin()
    if bin_dir is None:
        print("no llama.cpp build (clients/llama.cpp/build.sh)")
        return 2
    res = {"prompt": prompt, "prompt_tokens": len(ids)}
    tok = bin_dir / "llama-tokenize"
    if tok.exists():
        r = subprocess.run([str(tok), "-m", a.model, "-p", prompt, "--ids", "--no-escape", "--log-disable"], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
        got = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
        res["tokenizer_identical"] = got == ids
        if got != ids:
            print(f"llama-tokenize ids differ: {got[:20] if got else r.returncode} vs {ids[:20]}")
    ref_rows, ref_gen = torch_greedy(model, ids, a.steps)
    with tempfile.TemporaryDirectory() as td:
        dump = os.path.join(td, "logits.bin")
        r = mc_decode(bin_dir, a.model, dump, prompt=prompt, steps=a.steps, threads=a.threads)
        if r.returncode != 0:
            print(r.stderr[-2000:])
            return 1
        gen = [int(x) for x in __import__("re").findall(r"^step \d+ token (\d+)$", r.stdout, __import__("re").M)]
        rows = np.fromfile(dump, dtype=np.float32).reshape(-1, N_VOCAB)
    first = rows[0] - ref_rows[0]
    res.update(logits_max_abs_diff_first=float(np.abs(first).max()),
               logits_scale=float(np.abs(ref_rows[0]).max()),
               greedy_identical=gen == ref_gen,
               greedy_steps=len(gen),
               torch_text=decode(ref_gen).decode("utf-8", "replace"),
               llama_text=decode(gen).decode("utf-8", "replace"))
    n = 0
    while n < len(gen) and n < len(ref_gen) and gen[n] == ref_gen[n]:
        n += 1
    res["greedy_agree_steps"] = n
    # over the steps where both decoded the same prefix, the rows compare like for like
    res["logits_max_abs_diff_agreeing"] = float(np.abs(rows[:n + 1] - ref_rows[:n + 1]).max())
    print(json.dumps(res, indent=1))
    return 0 if res["greedy_identical"] else 1


def model_of(a):
    """``--model``, or with ``--random-weights`` synth --runnable's random weights (``--seed``) in its
    geometry, for comparison."""
    import tempfile
    model, cfg = load_model(a.model)
    if a.random_weights:
        from moecached.tools.synth_runnable import write_runnable
        with tempfile.TemporaryDirectory() as td:
            rnd = write_runnable(os.path.join(td, "random.gguf"), blocks=cfg["blocks"], hidden=cfg["hidden"],
                                 expert_ff=cfg["expert_ff"], experts=cfg["experts"], top_k=cfg["top_k"],
                                 heads=cfg["heads"], kv_heads=cfg["kv_heads"], head_dim=cfg["head_dim"],
                                 rope_base=cfg["rope_base"], context_length=cfg["context"], vocab=vocab(),
                                 add_space_prefix=False, seed=a.seed)
            model, cfg = load_model(rnd)
    return model, cfg


def cmd_route(a):
    """Routing of held-out text through the PyTorch model as a decode trace (``moecached.engine.trace``)."""
    import torch
    from moecached.engine.trace import Trace, save_trace
    model, cfg = model_of(a)
    text = open(a.text, encoding="utf-8").read()
    ids = encode(text)[: a.tokens]
    L, K = cfg["blocks"], cfg["top_k"]
    chunks = []
    with torch.no_grad():
        # windows as llama-perplexity -c SEQ cuts them: <s> then the next SEQ - 1 tokens, the SEQ-th
        # token of each window skipped (its place is the next window's <s>)
        for s in range(0, len(ids), a.seq):
            inp = torch.from_numpy(np.concatenate([[BOS], ids[s:s + a.seq - 1]]).astype(np.int64))[None]
            _, _, routes = model(inp, routing=True)
            r = torch.stack(routes, 1)[0]   # [L, T, K]
            chunks.append(r[:, 1:].permute(1, 0, 2).numpy().astype(np.int32))   # [T, L, K], BOS dropped
    out = np.concatenate(chunks)
    save_trace(a.out, Trace(experts=out.astype(np.int16), is_prompt=np.zeros(len(out), bool),
                            meta=dict(n_experts=cfg["experts"], source=f"train_moe.py route {os.path.basename(a.model)}"
                                      + (f" --random-weights --seed {a.seed}" if a.random_weights else ""),
                                      text=os.path.basename(a.text))))
    print(f"{a.out}: {out.shape[0]} tokens x {L} blocks x top-{K}")
    # temporal locality: the fraction of a token's experts (per block) the previous token also used,
    # against the same tokens in shuffled order and against uniform routing (k / E)
    E = cfg["experts"]

    def reuse(x):
        m = np.zeros((len(x), L, E), bool)
        np.put_along_axis(m, x.astype(np.int64), True, axis=2)
        return float((m[1:] & m[:-1]).sum() / (len(x) - 1) / L / K)

    perm = np.random.default_rng(0).permutation(len(out))
    use = np.bincount(out.reshape(-1), minlength=E) / out.size
    print(f"locality: {reuse(out):.3f} of a token's experts were the previous token's too "
          f"(shuffled tokens {reuse(out[perm]):.3f}, uniform {K / E:.3f}); "
          f"busiest expert {use.max() * E:.2f}x its fair share")
    return 0


def cmd_predict(a):
    """Gate-ahead prediction: block l+d's norm and router applied to block l's FFN input (the residual
    stream after l's attention) predict l+d's experts; recall of the routed top-k at k and 2k guesses."""
    import torch
    model, cfg = model_of(a)
    L, K = cfg["blocks"], cfg["top_k"]
    ids = encode(open(a.text, encoding="utf-8").read())[: a.tokens]
    for b in model.blocks:
        b.keep_ffn_inp = True
    hits = {(d, m): [0, 0] for d in (1, 2) for m in (1, 2)}
    eps = cfg["norm_eps"]
    with torch.no_grad():
        for s in range(0, len(ids), a.seq):
            inp = torch.from_numpy(np.concatenate([[BOS], ids[s:s + a.seq - 1]]).astype(np.int64))[None]
            _, _, routes = model(inp, routing=True)
            xs = [b.ffn_inp[0, 1:] for b in model.blocks]            # BOS dropped
            routed = [r[0, 1:] for r in routes]
            for d in (1, 2):
                for l in range(L - d):
                    nb = model.blocks[l + d]
                    x = xs[l]
                    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * nb.ffn_norm
                    order = nb.router(h).argsort(-1, descending=True)
                    for m in (1, 2):
                        guess = order[:, : m * K]
                        got = (guess[:, :, None] == routed[l + d][:, None, :]).any(1).sum()
                        hits[(d, m)][0] += int(got)
                        hits[(d, m)][1] += routed[l + d].numel()
    for (d, m), (h, n) in sorted(hits.items()):
        print(f"{d} block(s) ahead, {m * K} guesses: recall {h / n:.3f} of the routed top-{K}")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train on the Python standard library and write weights.npz")
    t.add_argument("--out", required=True)
    t.add_argument("--device", default="cuda" if os.environ.get("CUDA_VISIBLE_DEVICES") != "" else "cpu")
    t.add_argument("--corpus", help="directory of .py files (default: this Python's standard library)")
    t.add_argument("--tokens", type=parse_count, default=parse_count("150M"), help="token budget (default 150M)")
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--seq", type=int, default=512)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=150)
    t.add_argument("--wd", type=float, default=0.1)
    t.add_argument("--aux", type=float, default=0.01, help="load-balancing loss weight (default 0.01)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--eval-tokens", type=parse_count, default=parse_count("1M"))
    t.add_argument("--log-every", type=int, default=100)
    t.add_argument("--eval-every", type=int, default=1000, help="steps between short held-out evaluations (0: none)")
    t.add_argument("--max-seconds", type=float, default=0, help="stop early (and say so) after this long")
    for k, v in DEFAULTS.items():
        t.add_argument("--" + k.replace("_", "-"), type=type(v), default=v)
    e = sub.add_parser("export", help="weights.npz -> GGUF (qwen3moe)")
    e.add_argument("--weights", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--quant", default="f32", help="f32, q8_0, or a llama-quantize type with --llama-quantize")
    e.add_argument("--llama-quantize")
    c = sub.add_parser("check", help="PyTorch against llama.cpp: prompt ids, logits, greedy tokens")
    c.add_argument("--weights", help="weights.npz (default: the weights of --model, dequantised)")
    c.add_argument("--model", required=True, help="the exported GGUF")
    c.add_argument("--text", required=True, help="held-out text (heldout.txt)")
    c.add_argument("--offset", type=int, default=0)
    c.add_argument("--chars", type=int, default=200)
    c.add_argument("--steps", type=int, default=32)
    c.add_argument("--threads", type=int, default=2)
    r = sub.add_parser("route", help="top-k routing of held-out text as a trace file (.npz)")
    r.add_argument("--model", required=True, help="weights.npz or a qwen3moe GGUF (e.g. synth --runnable's)")
    r.add_argument("--text", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--tokens", type=int, default=20000)
    r.add_argument("--seq", type=int, default=512)
    r.add_argument("--random-weights", action="store_true",
                   help="route through synth --runnable's random weights in --model's geometry instead")
    r.add_argument("--seed", type=int, default=0, help="seed of --random-weights (default 0)")
    g = sub.add_parser("predict", help="gate-ahead recall: block l+1's and l+2's router on block l's FFN input")
    g.add_argument("--model", required=True)
    g.add_argument("--text", required=True)
    g.add_argument("--tokens", type=int, default=20000)
    g.add_argument("--seq", type=int, default=512)
    g.add_argument("--random-weights", action="store_true", help="as route --random-weights")
    g.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.cmd == "train" and a.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            a.device = "cpu"
    return {"train": cmd_train, "export": cmd_export, "check": cmd_check, "route": cmd_route,
            "predict": cmd_predict}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
