#!/usr/bin/env python3
"""One GPT-2 training step in PyTorch, timed: the baseline `scripts/bench step` measures tessel by.

The model is the textbook GPT-2 (as in nanoGPT): learned positions, pre-LayerNorm, fused c_attn,
causal softmax attention, GELU (tanh), tied token embedding / LM head, biases everywhere. A step is
what a PyTorch user writes: zero_grad, forward, cross-entropy, backward, clip_grad_norm_(1.0),
AdamW(lr 3e-4, betas (0.9, 0.95), weight decay 0.1 on the 2-D parameters: matrices and embeddings).

The options default to the fastest settings measured on the benchmark machines (bench/README.md):
the real vocabulary (50257), AdamW foreach, zero_grad(set_to_none=True). Flags let anyone re-check
them. The environment (OMP_NUM_THREADS, OMP_WAIT_POLICY, jemalloc and MALLOC_CONF,
OPENBLAS_CORETYPE, ATEN_CPU_CAPABILITY) is set by scripts/bench before Python starts: libgomp,
jemalloc, OpenBLAS and ATen read it at load time.

The last line printed is one JSON object with the median and mean step time in milliseconds.
"""
import argparse
import json
import math
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C, n_head, max_seq):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(C)
        self.c_attn = nn.Linear(C, 3 * C)
        self.attn_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C)
        self.c_fc = nn.Linear(C, 4 * C)
        self.mlp_proj = nn.Linear(4 * C, C)
        # True above the diagonal: the later positions a query must not attend to.
        future = torch.ones(max_seq, max_seq, dtype=torch.bool).triu(diagonal=1)
        self.register_buffer("future", future.view(1, 1, max_seq, max_seq), persistent=False)

    def attention(self, x):
        B, T, C = x.shape
        H = self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, H, C // H).transpose(1, 2)
        k = k.view(B, T, H, C // H).transpose(1, 2)
        v = v.view(B, T, H, C // H).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // H))
        att = att.masked_fill(self.future[:, :, :T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.attn_proj(y)

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        x = x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))
        return x


class GPT2(nn.Module):
    def __init__(self, n_layer, C, n_head, vocab, max_seq):
        super().__init__()
        self.wte = nn.Embedding(vocab, C)
        self.wpe = nn.Embedding(max_seq, C)
        self.blocks = nn.ModuleList([Block(C, n_head, max_seq) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(C)
        self.lm_head = nn.Linear(C, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx, targets):
        B, T = idx.shape
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def parse_bool(s):
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-124m", help="label for the JSON output")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257,
                    help="real vocabulary (tokens and targets are drawn below it)")
    ap.add_argument("--pad-vocab", type=int, default=0,
                    help="round the embedding/head rows up to a multiple of this (0: no padding)")
    ap.add_argument("--max-seq", type=int, default=1024,
                    help="rows of the position embedding (GPT-2: 1024)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--foreach", type=parse_bool, default=True,
                    help="AdamW foreach implementation")
    ap.add_argument("--set-to-none", type=parse_bool, default=True,
                    help="zero_grad(set_to_none=...)")
    ap.add_argument("--clip", type=float, default=1.0,
                    help="clip_grad_norm_ max norm (<= 0: no clipping)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: the forward under torch.autocast('cpu', dtype=torch.bfloat16), "
                         "fp32 master weights and optimizer (what a PyTorch user writes)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rows = args.vocab
    if args.pad_vocab > 0:
        rows = (args.vocab + args.pad_vocab - 1) // args.pad_vocab * args.pad_vocab
    model = GPT2(args.layers, args.embd, args.heads, rows, args.max_seq)
    model.train()

    # Weight decay on matrices (and the embeddings), not on biases and LayerNorm parameters.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-4, betas=(0.9, 0.95), eps=1e-8, foreach=args.foreach)

    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)

    def step():
        opt.zero_grad(set_to_none=args.set_to_none)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = model(tokens, targets)
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        return loss.item()

    times = []
    cpu_times = []  # process CPU time (all threads): a cross-check when the machine is shared
    losses = []
    for i in range(args.warmup + args.steps):
        c0 = time.process_time()
        t0 = time.perf_counter()
        loss = step()
        dt = (time.perf_counter() - t0) * 1e3
        if i >= args.warmup:
            times.append(dt)
            cpu_times.append((time.process_time() - c0) * 1e3)
            losses.append(loss)

    n_params = sum(p.numel() for p in model.parameters())
    result = {
        "side": "torch",
        "model": args.model,
        "precision": args.precision,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "params": n_params,
        "vocab_rows": rows,
        "foreach": args.foreach,
        "set_to_none": args.set_to_none,
        "ms_median": statistics.median(times),
        "ms_mean": statistics.fmean(times),
        "ms_min": min(times),
        "cpu_ms_median": statistics.median(cpu_times),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "LD_PRELOAD",
                                           "MALLOC_CONF", "OPENBLAS_CORETYPE",
                                           "ATEN_CPU_CAPABILITY") if k in os.environ},
    }
    print(f"torch {args.model}: median {result['ms_median']:.1f} ms/step, "
          f"mean {result['ms_mean']:.1f}, min {result['ms_min']:.1f}, "
          f"cpu {result['cpu_ms_median']:.1f} (loss {losses[0]:.3f} -> {losses[-1]:.3f})",
          file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
