#!/usr/bin/env python3
"""Golden reference for tessel's tiny models, computed with plain PyTorch (float32).

For each of `gpt2-tiny` and `llama-tiny` this builds the model exactly as tessel defines it
(parameter names and [out, in] weight layout of src/tessel/model, padded vocabulary, loss over the
first V logit columns with ignore_index -1), initialises it from a fixed seed, and records:

  <model>/config/<field>        i32 scalars (n_layer, n_embd, ...), so the C++ test can check that
                                the engine's preset is the model this file describes
  <model>/param/<hf name>       initial weights
  <model>/tokens, /targets      i32 [B, T] (targets hold a few -1 = ignored)
  <model>/logits                f32 [B, T, Vp] (padding columns included, as the engine computes)
  <model>/loss                  f32 scalar, mean cross-entropy over valid targets
  <model>/grad/<hf name>        gradient of that loss for every parameter
  <model>/adamw/<hyperparam>    f32 scalars lr, beta1, beta2, eps, weight_decay
  <model>/train_losses          f32 [5]: loss of each of 5 AdamW steps on the same batch (each
                                computed before that step's update; the first equals /loss)
  <model>/final_loss            f32 scalar: loss after the 5th update (so every update is tested)

Weights are float32 values (drawn in float32, as stored), but by default the forward, backward and
AdamW steps run in float64: the golden values are then the exact answer for those weights to
float32 precision, and the C++ test's error measures the engine's float32 rounding alone rather
than the sum of two float32 implementations' rounding (--compute-dtype float32 reproduces a plain
float32 torch run; its differences to the engine are ~1.5-3x larger).

The binary format is documented in src/tessel/model/golden_file.h. Regenerate with
tools/make_golden (uses Debian's python3-torch; no transformers library involved).
"""

import argparse
import math
import struct
import sys

import torch
import torch.nn.functional as F

MAGIC = b"TSLGOLD\0"
VERSION = 1
DTYPE_F32 = 1
DTYPE_I32 = 2

B, T = 2, 16
IGNORE = -1
ADAMW = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
TRAIN_STEPS = 5

CONFIGS = {
    "gpt2-tiny": dict(arch="gpt2", n_layer=6, n_embd=32, n_head=4, n_kv_head=4, ffn=128,
                      vocab=257, padded_vocab=384, max_seq=64),
    "llama-tiny": dict(arch="llama", n_layer=6, n_embd=32, n_head=4, n_kv_head=2, ffn=64,
                       vocab=257, padded_vocab=384, max_seq=64),
}
NORM_EPS = 1e-5
ROPE_THETA = 10000.0


# ----------------------------------------------------------------------------- parameters

def gpt2_param_shapes(c):
    C, F_, Vp = c["n_embd"], c["ffn"], c["padded_vocab"]
    shapes = {"transformer.wte.weight": [Vp, C], "transformer.wpe.weight": [c["max_seq"], C]}
    for i in range(c["n_layer"]):
        p = f"transformer.h.{i}."
        shapes.update({
            p + "ln_1.weight": [C], p + "ln_1.bias": [C],
            p + "attn.c_attn.weight": [3 * C, C], p + "attn.c_attn.bias": [3 * C],
            p + "attn.c_proj.weight": [C, C], p + "attn.c_proj.bias": [C],
            p + "ln_2.weight": [C], p + "ln_2.bias": [C],
            p + "mlp.c_fc.weight": [F_, C], p + "mlp.c_fc.bias": [F_],
            p + "mlp.c_proj.weight": [C, F_], p + "mlp.c_proj.bias": [C],
        })
    shapes.update({"transformer.ln_f.weight": [C], "transformer.ln_f.bias": [C]})
    return shapes


def llama_param_shapes(c):
    C, F_, Vp = c["n_embd"], c["ffn"], c["padded_vocab"]
    D = C // c["n_head"]
    KV = c["n_kv_head"] * D
    shapes = {"model.embed_tokens.weight": [Vp, C]}
    for i in range(c["n_layer"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": [C],
            p + "self_attn.q_proj.weight": [C, C],
            p + "self_attn.k_proj.weight": [KV, C],
            p + "self_attn.v_proj.weight": [KV, C],
            p + "self_attn.o_proj.weight": [C, C],
            p + "post_attention_layernorm.weight": [C],
            p + "mlp.gate_proj.weight": [F_, C],
            p + "mlp.up_proj.weight": [F_, C],
            p + "mlp.down_proj.weight": [C, F_],
        })
    shapes.update({"model.norm.weight": [C], "lm_head.weight": [Vp, C]})
    return shapes


def is_norm(name):
    return "ln_" in name or "layernorm" in name or name == "model.norm.weight"


def init_params(shapes, seed, dtype):
    """N(0, 0.02) matrices and embeddings; norm weights 1 + noise and biases small noise, so that
    a wrong scale or a dropped bias shows up in the comparison. Values are rounded to float32
    (what the file stores and the engine computes with) before any conversion to `dtype`."""
    g = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in shapes.items():
        if is_norm(name) and name.endswith(".weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            t = 0.02 * torch.randn(shape, generator=g)
        else:
            t = 0.02 * torch.randn(shape, generator=g)
        params[name] = t.float().to(dtype).requires_grad_(True)
    return params


# ----------------------------------------------------------------------------- models

def causal_attention(q, k, v, n_head, n_kv_head):
    """q [B,T,Hq,D], k/v [B,T,Hkv,D] -> [B,T,Hq*D]; query head h uses kv head h // (Hq/Hkv)."""
    Bb, Tt, Hq, D = q.shape
    group = n_head // n_kv_head
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B,H,T,D]
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
    mask = torch.ones(Tt, Tt, dtype=torch.bool).tril()
    att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    y = att @ v  # [B,H,T,D]
    return y.transpose(1, 2).reshape(Bb, Tt, Hq * D)


def gpt2_forward(P, c, tokens):
    C, H = c["n_embd"], c["n_head"]
    D = C // H
    Bb, Tt = tokens.shape
    x = P["transformer.wte.weight"][tokens] + P["transformer.wpe.weight"][:Tt]
    for i in range(c["n_layer"]):
        p = f"transformer.h.{i}."
        h = F.layer_norm(x, [C], P[p + "ln_1.weight"], P[p + "ln_1.bias"], NORM_EPS)
        qkv = F.linear(h, P[p + "attn.c_attn.weight"], P[p + "attn.c_attn.bias"])
        q, k, v = qkv.split(C, dim=-1)
        y = causal_attention(q.view(Bb, Tt, H, D), k.view(Bb, Tt, H, D), v.view(Bb, Tt, H, D), H, H)
        x = x + F.linear(y, P[p + "attn.c_proj.weight"], P[p + "attn.c_proj.bias"])
        h = F.layer_norm(x, [C], P[p + "ln_2.weight"], P[p + "ln_2.bias"], NORM_EPS)
        h = F.gelu(F.linear(h, P[p + "mlp.c_fc.weight"], P[p + "mlp.c_fc.bias"]), approximate="tanh")
        x = x + F.linear(h, P[p + "mlp.c_proj.weight"], P[p + "mlp.c_proj.bias"])
    x = F.layer_norm(x, [C], P["transformer.ln_f.weight"], P["transformer.ln_f.bias"], NORM_EPS)
    return x @ P["transformer.wte.weight"].t()  # tied: [B,T,Vp]


def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * w


def rope(x, theta):
    """Hugging Face LLaMA rotate_half convention on x [B,T,H,D], positions 0..T-1."""
    Tt, D = x.shape[1], x.shape[3]
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    freqs = torch.outer(torch.arange(Tt, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos = emb.cos().to(x.dtype)[None, :, None, :]
    sin = emb.sin().to(x.dtype)[None, :, None, :]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


def llama_forward(P, c, tokens):
    C, H, Hkv = c["n_embd"], c["n_head"], c["n_kv_head"]
    D = C // H
    Bb, Tt = tokens.shape
    x = P["model.embed_tokens.weight"][tokens]
    for i in range(c["n_layer"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, P[p + "input_layernorm.weight"])
        q = F.linear(h, P[p + "self_attn.q_proj.weight"]).view(Bb, Tt, H, D)
        k = F.linear(h, P[p + "self_attn.k_proj.weight"]).view(Bb, Tt, Hkv, D)
        v = F.linear(h, P[p + "self_attn.v_proj.weight"]).view(Bb, Tt, Hkv, D)
        q, k = rope(q, ROPE_THETA), rope(k, ROPE_THETA)
        y = causal_attention(q, k, v, H, Hkv)
        x = x + F.linear(y, P[p + "self_attn.o_proj.weight"])
        h = rms_norm(x, P[p + "post_attention_layernorm.weight"])
        gate = F.linear(h, P[p + "mlp.gate_proj.weight"])
        up = F.linear(h, P[p + "mlp.up_proj.weight"])
        x = x + F.linear(F.silu(gate) * up, P[p + "mlp.down_proj.weight"])
    x = rms_norm(x, P["model.norm.weight"])
    return F.linear(x, P["lm_head.weight"])  # untied: [B,T,Vp]


def loss_fn(logits, targets, vocab):
    """Mean cross-entropy over valid targets; padding columns are not classes."""
    real = logits[..., :vocab].reshape(-1, vocab)
    return F.cross_entropy(real, targets.reshape(-1).long(), ignore_index=IGNORE)


# ----------------------------------------------------------------------------- data

def make_batch(seed, vocab):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab, (B, T + 1), generator=g, dtype=torch.int64)
    # The vocabulary's edges must appear: row 0 and the last real row (256) of the embedding.
    seq[0, 5] = 0
    seq[1, 2] = vocab - 1
    tokens = seq[:, :T].clone()
    targets = seq[:, 1:].clone()
    targets[0, 3] = IGNORE
    targets[1, 0] = IGNORE
    targets[1, T - 1] = IGNORE
    return tokens.int(), targets.int()


# ----------------------------------------------------------------------------- file writing

class GoldenWriter:
    def __init__(self):
        self.records = []

    def add(self, name, tensor, dtype):
        t = tensor.detach().contiguous()
        if dtype == DTYPE_F32:
            t = t.to(torch.float32)
        else:
            t = t.to(torch.int32)
        dims = list(t.shape)
        payload = t.numpy().astype("<f4" if dtype == DTYPE_F32 else "<i4").tobytes()
        self.records.append((name, dtype, dims, payload))

    def f32(self, name, value):
        self.add(name, value if torch.is_tensor(value) else torch.tensor(float(value)), DTYPE_F32)

    def i32(self, name, value):
        self.add(name, value if torch.is_tensor(value) else torch.tensor(int(value)), DTYPE_I32)

    def write(self, path):
        names = [r[0] for r in self.records]
        assert len(names) == len(set(names)), "duplicate record names"
        out = bytearray(MAGIC)
        out += struct.pack("<II", VERSION, len(self.records))
        for name, dtype, dims, payload in self.records:
            encoded = name.encode("utf-8")
            out += struct.pack("<I", len(encoded)) + encoded
            out += struct.pack("<II", dtype, len(dims))
            out += struct.pack(f"<{len(dims)}q", *dims)
            out += struct.pack("<Q", len(payload)) + payload
        with open(path, "wb") as f:
            f.write(out)
        return len(out)


# ----------------------------------------------------------------------------- main

def run_model(w, name, seed, dtype):
    c = CONFIGS[name]
    if c["arch"] == "gpt2":
        shapes, forward = gpt2_param_shapes(c), gpt2_forward
    else:
        shapes, forward = llama_param_shapes(c), llama_forward
    P = init_params(shapes, seed, dtype)
    tokens, targets = make_batch(seed + 1, c["vocab"])
    tok64 = tokens.long()

    for key in ("n_layer", "n_embd", "n_head", "n_kv_head", "ffn", "vocab", "padded_vocab",
                "max_seq"):
        w.i32(f"{name}/config/{key}", c[key])
    for pname, t in P.items():
        w.f32(f"{name}/param/{pname}", t)
    w.i32(f"{name}/tokens", tokens)
    w.i32(f"{name}/targets", targets)

    # Weight decay on 2-D tensors (matrices and embeddings) only, like the engine's ModelSpec.
    decay = [t for t in P.values() if t.dim() >= 2]
    no_decay = [t for t in P.values() if t.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": ADAMW["weight_decay"]},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=ADAMW["lr"], betas=(ADAMW["beta1"], ADAMW["beta2"]), eps=ADAMW["eps"])

    train_losses = []
    for step in range(TRAIN_STEPS):
        opt.zero_grad(set_to_none=False)
        logits = forward(P, c, tok64)
        loss = loss_fn(logits, targets, c["vocab"])
        loss.backward()
        if step == 0:
            w.f32(f"{name}/logits", logits)
            w.f32(f"{name}/loss", loss)
            for pname, t in P.items():
                w.f32(f"{name}/grad/{pname}", t.grad)
        train_losses.append(loss.item())
        opt.step()
    with torch.no_grad():
        final = loss_fn(forward(P, c, tok64), targets, c["vocab"])
    w.f32(f"{name}/train_losses", torch.tensor(train_losses))
    w.f32(f"{name}/final_loss", final)
    for key, value in ADAMW.items():
        w.f32(f"{name}/adamw/{key}", value)
    nparam = sum(t.numel() for t in P.values())
    print(f"{name}: {len(P)} tensors, {nparam} params, loss {train_losses[0]:.6f}, "
          f"train {['%.6f' % l for l in train_losses]}, final {final.item():.6f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="path of golden.bin to write")
    ap.add_argument("--compute-dtype", choices=["float64", "float32"], default="float64",
                    help="precision of the reference computation (results are stored as float32)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # reproducible float summation order
    dtype = getattr(torch, args.compute_dtype)
    w = GoldenWriter()
    run_model(w, "gpt2-tiny", seed=1234, dtype=dtype)
    run_model(w, "llama-tiny", seed=5678, dtype=dtype)
    size = w.write(args.out)
    print(f"wrote {args.out}: {len(w.records)} records, {size} bytes")
    if size >= 2 * 1024 * 1024:
        sys.exit(f"golden file is {size} bytes; it must stay under 2 MB")


if __name__ == "__main__":
    main()
