#!/usr/bin/env python3
"""`scripts/bench pipeline`: the measured pipeline bubble of 1F1B, ZB-H1 and ZB-V against their
theory, on real worker processes (see bench/README.md).

Trains a small untied GPT (gpt2 family, L=8, C=256 (--hidden), 4 heads, byte-level vocabulary, seq 64; untied
so that ZB-V, whose V puts the embedding and the head on rank 0, can run it) with pp=4 (pp=2 on a
machine with fewer than 4 cores, where 4 single-threaded workers would time-slice and every rank
would wait at least half the time whatever the schedule; --stages overrides) under each
schedule, m = 8 and m = 16 micro-batches of 2 samples, one thread per worker, and reads the
bubble each step measured: the share of the pipeline phase the ranks spent waiting for receives
and for their last sends (the metrics' pipeline_idle), median over the timed steps. Theory, with
equal stages and free links: 1F1B (p-1)/(m+p-1), ZB-H1 (p-1)/(3m+p-1), ZB-V's bound
(p-1)/(6m+p-1) (schedule/named.h). On a machine with fewer cores than workers the ranks
time-slice and every wait includes other ranks' compute: the measured bubbles are then upper
bounds, and the ratios between schedules are what to compare. Human-readable lines first, the
last line is one JSON object. Standard library only.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

MODEL = """model:
  family: gpt2
  n_layer: 8
  n_embd: {hidden}
  n_head: 4
  ffn_hidden: {ffn}
  vocab_size: 257
  max_seq_len: 64
  tie_embeddings: false
"""
SEQ = 64
LAYERS = 8


def theory(schedule, p, m):
    if schedule == "1f1b":
        return (p - 1) / (m + p - 1)
    if schedule == "zb-h1":
        return (p - 1) / (3 * m + p - 1) if m >= p else (2 * p - m - 1) / (2 * (m + p) - 1)
    return (p - 1) / (6 * m + p - 1)


def split(stages):
    """Equal layers per virtual stage, the (cheap: 257-id vocabulary) embedding and head units
    added to the end stages: every rank computes the same, whatever the placement."""
    k = LAYERS // stages
    return [k + 1] + [k] * (stages - 2) + [k + 1] if stages > 1 else [LAYERS + 2]


def run(args, work, schedule, m):
    P = args.stages
    tag = f"{schedule}-m{m}"
    metrics = work / f"{tag}.jsonl"
    metrics.unlink(missing_ok=True)
    v = 2 if schedule == "zb-v" else 1
    cfg = work / f"{tag}.yaml"
    cfg.write_text(MODEL.format(hidden=args.hidden, ffn=4 * args.hidden) + f"""data: {{path: {args.data}, seq_len: {SEQ}, eval_fraction: 0.0}}
training: {{steps: {args.steps}, global_batch: {2 * m}, micro_batch: 2, log_every: 1000,
           threads: 1}}
optimizer: {{lr: 1.0e-3, warmup_steps: 2}}
output: {{metrics: {metrics}}}
parallel: {{pp: {P}, virtual_stages: {v}, micro_batch: 2, schedule: {schedule},
           layers_per_stage: {split(P * v)}}}
""")
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    r = subprocess.run([args.tessel, "train", str(cfg), "--nproc", str(P)], env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{tag} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    recs = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
    timed = recs[args.warmup:]
    idle = statistics.median(r["pipeline_idle"] for r in timed)
    step = statistics.median(r["step_s"] for r in timed if "step_s" in r) if any(
        "step_s" in r for r in timed) else None
    return idle, step


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tessel", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256,
                    help="n_embd (ffn 4x): larger makes each pass longer against a message")
    ap.add_argument("--stages", type=int, default=4 if (os.cpu_count() or 1) >= 4 else 2)
    a = ap.parse_args()
    P = a.stages
    print(f"pipeline stages: {P} ({os.cpu_count()} cores)")
    work = pathlib.Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    out = {"stages": P}
    for m in (8, 16):
        for schedule in ("1f1b", "zb-h1", "zb-v"):
            idle, step = run(a, work, schedule, m)
            th = theory(schedule, P, m)
            print(f"p={P} m={m:<3} {schedule:<6} bubble measured {idle:.3f}  theory {th:.3f}"
                  + (f"  step {step * 1e3:.1f} ms" if step else ""))
            key = {"1f1b": "1f1b", "zb-h1": "zbh1", "zb-v": "zbv"}[schedule]
            suffix = "" if m == 8 else f"_m{m}"
            out[f"bubble_{key}{suffix}"] = round(idle, 4)
            out[f"bubble_{key}{suffix}_theory"] = round(th, 4)
            if step:
                out[f"step_ms_{key}{suffix}"] = round(step * 1e3, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
