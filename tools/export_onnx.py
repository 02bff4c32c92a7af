#!/usr/bin/python3
"""Exports small models from Debian's PyTorch (python3-torch) to ONNX for the graph planner
(issue 20): a GPT-2 and a LLaMA (tiny widths, their real structure), a Wide-ResNet-style CNN and
a mixture-of-experts layer. Run from the repository root:

    /usr/bin/python3 tools/export_onnx.py src/tessel/planner/testdata

Every model is exported in evaluation mode with its batch dimension symbolic ("batch": give it
with `tessel plan --onnx FILE --dim batch=N`). Weights come from a fixed seed; the planner reads
only their shapes, so the files stay small while `--dim batch` sets the work.

    gpt2_tiny.onnx    2 blocks, C 64, 4 heads, seq 32, vocabulary 256, untied head
    llama_tiny.onnx   2 blocks, C 64, 4 heads (2 kv heads), SwiGLU 128, RMSNorm, rope, seq 32
    wide_resnet.onnx  3x32x32 images: a 3x3 stem to 32 channels, two residual blocks of two 3x3
                      convolutions with batch norm (folded into them by the export) and ReLU (the
                      second downsampling to 64 by stride 2), global average pooling and a
                      10-way classifier
    moe.onnx          [batch, 64 tokens, C 32]: a layer norm, 8 experts (two-layer GELU MLPs of
                      128, stacked [E, C, F] weights) with expert-choice routing (each expert
                      takes its top 16 tokens of the sequence by gate score), combined back with a
                      one-hot matmul, and a residual add
"""
import math
import pathlib
import sys

import torch
from torch import nn
import torch.nn.functional as F

torch.manual_seed(0)


# Shapes in reshapes and masks are Python constants, not read from x.shape: the exported graph's
# shapes then stay static but for the batch, which the planner's --dim gives.


class GptBlock(nn.Module):
    def __init__(self, c, heads, seq):
        super().__init__()
        self.heads, self.seq = heads, seq
        self.ln_1 = nn.LayerNorm(c)
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)
        self.ln_2 = nn.LayerNorm(c)
        self.c_fc = nn.Linear(c, 4 * c)
        self.mlp_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        t, c = self.seq, self.c_proj.out_features
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=-1)
        q, k, v = (z.reshape(-1, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.heads))
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
        x = x + self.c_proj(att.transpose(1, 2).reshape(-1, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class Gpt2(nn.Module):
    def __init__(self, vocab=256, seq=32, c=64, heads=4, layers=2):
        super().__init__()
        self.wte = nn.Embedding(vocab, c)
        self.wpe = nn.Embedding(seq, c)
        self.blocks = nn.ModuleList(GptBlock(c, heads, seq) for _ in range(layers))
        self.ln_f = nn.LayerNorm(c)
        self.head = nn.Linear(c, vocab, bias=False)
        # A constant, not arange(ids.shape[1]): the exported graph's shapes stay static.
        self.register_buffer("positions", torch.arange(seq))

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(self.positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class RmsNorm(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


def rope(x, cos, sin, half):
    # half a Python int: a Split with constant sizes, whose shapes ONNX inference knows.
    first, second = torch.split(x, [half, half], dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class LlamaBlock(nn.Module):
    def __init__(self, c, heads, kv_heads, ffn, seq):
        super().__init__()
        self.heads, self.kv_heads, self.d, self.seq = heads, kv_heads, c // heads, seq
        self.input_norm = RmsNorm(c)
        self.q_proj = nn.Linear(c, c, bias=False)
        self.k_proj = nn.Linear(c, kv_heads * self.d, bias=False)
        self.v_proj = nn.Linear(c, kv_heads * self.d, bias=False)
        self.o_proj = nn.Linear(c, c, bias=False)
        self.post_norm = RmsNorm(c)
        self.gate_proj = nn.Linear(c, ffn, bias=False)
        self.up_proj = nn.Linear(c, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, c, bias=False)

    def forward(self, x, cos, sin):
        t, c = self.seq, self.heads * self.d
        h = self.input_norm(x)
        q = self.q_proj(h).reshape(-1, t, self.heads, self.d).transpose(1, 2)
        k = self.k_proj(h).reshape(-1, t, self.kv_heads, self.d).transpose(1, 2)
        v = self.v_proj(h).reshape(-1, t, self.kv_heads, self.d).transpose(1, 2)
        q, k = rope(q, cos, sin, self.d // 2), rope(k, cos, sin, self.d // 2)
        rep = self.heads // self.kv_heads
        # Each kv head repeated for its query heads by a broadcast product (repeat_interleave and
        # expand export shapes that ONNX inference cannot follow).
        ones = torch.ones(1, 1, rep, 1, 1)
        k, v = ((z.unsqueeze(2) * ones).reshape(-1, self.heads, t, self.d) for z in (k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.d))
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
        x = x + self.o_proj(att.transpose(1, 2).reshape(-1, t, c))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, vocab=256, seq=32, c=64, heads=4, kv_heads=2, ffn=128, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, c)
        self.blocks = nn.ModuleList(
            LlamaBlock(c, heads, kv_heads, ffn, seq) for _ in range(layers))
        self.norm = RmsNorm(c)
        self.head = nn.Linear(c, vocab, bias=False)
        d = c // heads
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        angles = torch.outer(torch.arange(seq).float(), inv)
        self.register_buffer("cos", torch.cat((angles, angles), -1).cos())
        self.register_buffer("sin", torch.cat((angles, angles), -1).sin())

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.head(self.norm(x))


class ResidualBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = nn.Conv2d(cin, cout, 1, stride, bias=False) if stride != 1 or cin != cout else None

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (self.skip(x) if self.skip is not None else x))


class WideResNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, 1, 1, bias=False)
        self.block1 = ResidualBlock(32, 32, 1)
        self.block2 = ResidualBlock(32, 64, 2)
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        x = self.block2(self.block1(F.relu(self.stem(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class ExpertChoiceMoe(nn.Module):
    """Expert-choice routing (Zhou et al., 2022): each expert takes its `capacity` best tokens."""

    def __init__(self, c=32, experts=8, ffn=128, capacity=16, tokens=64):
        super().__init__()
        self.capacity, self.tokens = capacity, tokens
        self.register_buffer("positions", torch.arange(tokens))
        self.norm = nn.LayerNorm(c)
        self.gate = nn.Linear(c, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, c, ffn) * c ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, ffn, c) * ffn ** -0.5)

    def forward(self, x):
        t, c = self.tokens, self.norm.normalized_shape[0]
        h = self.norm(x)
        scores = self.gate(h).softmax(dim=-1).transpose(1, 2)   # [b, E, t]
        weight, index = scores.topk(self.capacity, dim=-1)       # [b, E, cap]
        # One-hot by comparison (ONNX's OneHot has no static shape).
        dispatch = (index.unsqueeze(-1) == self.positions).to(h.dtype)  # [b, E, cap, t]
        tokens = dispatch @ h.unsqueeze(1)                       # [b, E, cap, c]
        y = F.gelu(tokens @ self.w1) @ self.w2                   # [b, E, cap, c]
        y = y * weight.unsqueeze(-1)
        experts = self.w1.shape[0]
        combined = (dispatch.reshape(-1, experts * self.capacity, t).transpose(1, 2)
                    @ y.reshape(-1, experts * self.capacity, c))
        return x + combined


def export(model, example, path, input_name):
    model.eval()
    torch.onnx.export(model, example, str(path), input_names=[input_name], output_names=["out"],
                      dynamic_axes={input_name: {0: "batch"}, "out": {0: "batch"}},
                      opset_version=17, do_constant_folding=True)
    print(f"wrote {path} ({path.stat().st_size} bytes)")


def main():
    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    ids = torch.zeros(2, 32, dtype=torch.long)
    export(Gpt2(), ids, out / "gpt2_tiny.onnx", "ids")
    export(Llama(), ids, out / "llama_tiny.onnx", "ids")
    export(WideResNet(), torch.zeros(2, 3, 32, 32), out / "wide_resnet.onnx", "images")
    export(ExpertChoiceMoe(), torch.zeros(2, 64, 32), out / "moe.onnx", "x")


if __name__ == "__main__":
    main()
