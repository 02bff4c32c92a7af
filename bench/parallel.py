#!/usr/bin/env python3
"""`scripts/bench parallel`: data-parallel efficiency, all-reduce bandwidth against raw Gloo, and
the measured pipeline bubble of 1F1B (see bench/README.md).

Runs `tessel train` on the small GPT config (gpt2, L=4, C=256, 4 heads, ffn 1024, byte-level
vocabulary 257, seq 64, global batch 16) in four layouts, reads each run's JSON-lines metrics and
takes the median step time over the timed steps (warm-up steps dropped):

  single-2t  (1,1,1), 1 process,  OMP_NUM_THREADS=2, micro-batch 16
  dp2-1t     (2,1,1), 2 workers,  OMP_NUM_THREADS=1 each, micro-batch 8 per replica
  single-1t  (1,1,1), 1 process,  OMP_NUM_THREADS=1, micro-batch 2 (8 accumulated micro-batches)
  pp2-1t     (1,1,2), 2 workers,  OMP_NUM_THREADS=1 each, 1f1b, micro-batch 2 (m = 8)

then runs bench_allreduce (64 MiB, 2 processes). Human-readable lines first, the last line is one
JSON object. Standard library only.
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
  n_layer: 4
  n_embd: 256
  n_head: 4
  ffn_hidden: 1024
  vocab_size: 257
  max_seq_len: 64
"""

GLOBAL_BATCH = 16
SEQ = 64


def config(data, metrics, steps, micro_batch, parallel=None):
    text = MODEL + f"""data:
  path: {data}
  seq_len: {SEQ}
  eval_fraction: 0.0
  seed: 1
training:
  steps: {steps}
  global_batch: {GLOBAL_BATCH}
  micro_batch: {micro_batch}
  seed: 1234
  grad_clip: 1.0
  eval_every: 0
  log_every: 1000
optimizer:
  lr: 1.0e-3
  min_lr: 1.0e-4
  warmup_steps: 2
  weight_decay: 0.1
output:
  metrics: {metrics}
"""
    if parallel:
        text += "parallel:\n" + "".join(f"  {k}: {v}\n" for k, v in parallel.items())
    return text


def load_line():
    la = " ".join(pathlib.Path("/proc/loadavg").read_text().split()[:3])
    line = f"load average {la}"
    try:
        for l in pathlib.Path("/proc/pressure/cpu").read_text().splitlines():
            if l.startswith("some"):
                line += ", cpu pressure " + l.split()[1]
    except OSError:
        pass
    return line


def run_train(args, name, threads, nproc, micro_batch, parallel=None):
    work = pathlib.Path(args.work)
    cfg_path = work / f"{name}.yaml"
    metrics = work / f"{name}.metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    steps = args.warmup + args.steps
    cfg_path.write_text(config(args.data, metrics, steps, micro_batch, parallel))
    cmd = [args.tessel, "train", str(cfg_path)]
    if nproc > 1:
        cmd += ["--nproc", str(nproc), "--log-dir", str(work / f"{name}.logs")]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    print(f"== {name}: {nproc} process(es) x OMP_NUM_THREADS={threads}, micro-batch {micro_batch}"
          f"{', ' + str(parallel) if parallel else ''}; {load_line()}", flush=True)
    with open(work / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"bench parallel: {name} failed (exit {rc}); see {work / (name + '.log')}")
    records = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
    records = [r for r in records if "step_s" in r]
    timed = [r["step_s"] for r in records[args.warmup:]]
    if len(timed) < 1:
        sys.exit(f"bench parallel: {name} wrote {len(records)} steps, expected {steps}")
    med = statistics.median(timed)
    tokens = GLOBAL_BATCH * SEQ
    print(f"   step times (s): " + " ".join(f"{t:.3f}" for t in timed))
    print(f"   median {med * 1e3:.1f} ms/step, {tokens / med:.0f} tokens/s; after: {load_line()}",
          flush=True)
    idle = [r["pipeline_idle"] for r in records[args.warmup:] if "pipeline_idle" in r]
    if idle:
        print(f"   pipeline idle share (executor): median {statistics.median(idle):.3f}")
    return {"median_step_s": med, "tokens_per_s": tokens / med, "steps_s": timed,
            "pipeline_idle": statistics.median(idle) if idle else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tessel", required=True)
    ap.add_argument("--bench-allreduce", required=True)
    ap.add_argument("--data", required=True, help="token file (tessel data prepare)")
    ap.add_argument("--work", required=True, help="directory for configs, metrics and logs")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--allreduce-reps", type=int, default=7)
    args = ap.parse_args()
    # tessel resolves a config's paths against the config's folder: hand it absolute ones.
    args.data, args.work = os.path.abspath(args.data), os.path.abspath(args.work)
    os.makedirs(args.work, exist_ok=True)
    print(f"cpu: {os.cpu_count()} cores; {load_line()}")
    print(f"small GPT: gpt2 L=4 C=256 4 heads ffn 1024 vocab 257, T={SEQ}, global batch "
          f"{GLOBAL_BATCH}; {args.warmup} warm-up + {args.steps} timed steps, median")

    p, m = 2, 8
    # dp pair first, then the pp pair, each back to back so a load change hits both sides alike.
    single2 = run_train(args, "single-2t", 2, 1, GLOBAL_BATCH)
    dp2 = run_train(args, "dp2-1t", 1, 2, GLOBAL_BATCH // 2, {"dp": 2, "tp": 1, "pp": 1})
    single1 = run_train(args, "single-1t", 1, 1, GLOBAL_BATCH // m)
    pp2 = run_train(args, "pp2-1t", 1, 2, GLOBAL_BATCH // m,
                    {"dp": 1, "tp": 1, "pp": 2, "schedule": "1f1b", "micro_batch": GLOBAL_BATCH // m})

    print(f"== all-reduce, 64 MiB, 2 processes; {load_line()}", flush=True)
    out = subprocess.run([args.bench_allreduce, "--mib", "64", "--reps", str(args.allreduce_reps)],
                         stdout=subprocess.PIPE, text=True)
    sys.stdout.write(out.stdout)
    if out.returncode != 0:
        sys.exit(f"bench parallel: bench_allreduce failed (exit {out.returncode})")
    ar = json.loads(out.stdout.strip().splitlines()[-1])

    dp_eff = dp2["tokens_per_s"] / single2["tokens_per_s"]
    t1, tpp = single1["median_step_s"], pp2["median_step_s"]
    # The bubble as measured: the share of the pipeline phase the stages spent idle (waiting for
    # a receive or their last sends), timed by the executor on every rank and averaged over them.
    # From step times alone, 1 - T1 / (p Tpp) also charges the stage imbalance of the split and
    # everything outside the pipeline phase (gradient norm, optimizer) to the bubble: printed too.
    bubble = pp2["pipeline_idle"]
    bubble_steps = 1 - t1 / (p * tpp)
    theory = (p - 1) / (m + p - 1)
    print()
    print(f"dp_efficiency     {dp_eff:.3f}  (target >= 0.9): (2,1,1) x 1 thread "
          f"{dp2['tokens_per_s']:.0f} tok/s / (1,1,1) x 2 threads {single2['tokens_per_s']:.0f} tok/s")
    print(f"allreduce_vs_gloo {ar['allreduce_vs_gloo']:.3f}  (target >= 0.9): tessel "
          f"{ar['tessel_busbw_gbps']:.2f} GB/s / {ar['gloo_algorithm']} {ar['gloo_busbw_gbps']:.2f} "
          f"GB/s bus bandwidth (medians)")
    rel = abs(bubble - theory) / theory
    print(f"bubble            measured {bubble:.3f} vs theory {theory:.3f} ((p-1)/(m+p-1), p={p}, "
          f"m={m}); off by {100 * rel:.0f}% (target within 20%)")
    print(f"                  (the executor's idle share of the pipeline phase); from step times "
          f"1 - T1 {t1 * 1e3:.1f} ms / ({p} x Tpp {tpp * 1e3:.1f} ms) = {bubble_steps:.3f}, which also "
          f"counts stage imbalance and the optimizer phase")
    print(f"now: {load_line()}")
    print(json.dumps({
        "dp_efficiency": round(dp_eff, 4),
        "allreduce_vs_gloo": round(ar["allreduce_vs_gloo"], 4),
        "bubble_measured": round(bubble, 4),
        "bubble_theory": round(theory, 4),
        "bubble_from_step_times": round(bubble_steps, 4),
        "single_2t_tokens_per_s": round(single2["tokens_per_s"], 1),
        "dp2_1t_tokens_per_s": round(dp2["tokens_per_s"], 1),
        "single_1t_step_s": round(t1, 5),
        "pp2_1f1b_step_s": round(tpp, 5),
        "tessel_busbw_gbps": ar["tessel_busbw_gbps"],
        "gloo_busbw_gbps": ar["gloo_busbw_gbps"],
        "gloo_algorithm": ar["gloo_algorithm"],
        "allreduce_bytes": ar["bytes"],
        "global_batch": GLOBAL_BATCH,
        "seq_len": SEQ,
        "p": p,
        "m": m,
        "loadavg": pathlib.Path("/proc/loadavg").read_text().split()[:3],
    }))


if __name__ == "__main__":
    main()
