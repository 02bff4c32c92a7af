#!/usr/bin/env python3
"""`scripts/bench pipeline`: the measured pipeline bubble of 1F1B, ZB-H1 and ZB-V against their
theory, on real worker processes (see bench/README.md).

Trains a small untied GPT (gpt2 family, L=8, C=256 (--hidden), 4 heads, byte-level vocabulary, seq 64; untied
so that ZB-V, whose V puts the embedding and the head on rank 0, can run it) with pp=4
(--stages) under each schedule, m = 8 and m = 16 micro-batches of 2 samples, one thread per
worker. On a machine with fewer cores than stages the workers would take turns on the cores and
every rank would wait whatever the schedule; there every compute is dilated D times
(TESSEL_PIPELINE_DELAY dilate=D, D = ceil(4 stages / cores), --dilate overrides): a rank computes
a D-th of the time and sleeps the rest (D times the compute's CPU time, so a moment shared with
another rank is not stretched), so the ranks rarely share a core, and the run's order and
waits are those of a machine with a core per rank whose computes are D times slower (messages
are not dilated, so they weigh D times less than on such a machine). It reads the
bubble of each timed step from the run's trace (output.trace, runtime/step_trace.h): one minus the
ranks' compute time (every F, B, Bi, Bw, R slice, each with its dilation) over the number of ranks
times the step's pipeline makespan (earliest rank's pipeline start to latest rank's end), the
definition of the zero-bubble paper and of the theory below; median over the timed steps. (The
metrics' pipeline_idle -- waits inside each rank's own pipeline phase -- undercounts schedules
whose late stages finish early: 1F1B's drain on the last stages falls outside it.) Theory, with
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


def read_trace(path):
    """A run's trace: its slices, the ranks (tracks) and each rank's pipeline slices in order."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    ranks = sorted({e["tid"] for e in events})
    pipes = {r: sorted((e for e in events if e["tid"] == r and e["name"] == "pipeline"),
                       key=lambda e: e["ts"]) for r in ranks}
    return events, ranks, pipes


def step_window(ranks, pipes, k):
    """Step k's pipeline across ranks: the earliest rank's start to the latest rank's end."""
    return (min(pipes[r][k]["ts"] for r in ranks),
            max(pipes[r][k]["ts"] + pipes[r][k]["dur"] for r in ranks))


def trace_bubbles(trace, skip):
    """Per traced step (the first `skip` dropped): 1 - compute / (ranks x pipeline makespan)."""
    events, ranks, pipes = trace
    bubbles = []
    for k in range(skip, min(len(p) for p in pipes.values())):
        start, end = step_window(ranks, pipes, k)
        busy = sum(e["dur"] for e in events if e["cat"] in ("F", "B", "Bi", "Bw", "R")
                   and start <= e["ts"] <= end)
        bubbles.append(1 - busy / (len(ranks) * (end - start)))
    return bubbles


def replay_bubble(trace, k, v_shape):
    """The bubble step k's lists would have had with every compute at its kind's median duration
    over the run and free messages: the executed order (from the trace) replayed on each rank as
    soon as its inputs exist. Measured minus this is what the computes' variation cost."""
    events, ranks, pipes = trace
    p = len(ranks)
    start, end = step_window(ranks, pipes, k)
    kinds = ("F", "B", "Bi", "Bw")
    cost = {c: statistics.median(e["dur"] for e in events if e["cat"] == c)
            for c in kinds if any(e["cat"] == c for e in events)}
    lists = {r: [e for e in sorted(events, key=lambda e: e["ts"]) if e["tid"] == r
                 and e["cat"] in kinds and start <= e["ts"] <= end] for r in ranks}
    vs_of = (lambda r, c: r if c == 0 else 2 * p - 1 - r) if v_shape else (lambda r, c: c * p + r)
    last = (2 if v_shape else max(int(e["name"].split(".")[1]) for e in lists[0]) + 1) * p - 1
    done, t, at = {}, {r: 0.0 for r in ranks}, {r: 0 for r in ranks}
    progress = True
    while progress:
        progress = False
        for r in ranks:
            while at[r] < len(lists[r]):
                e = lists[r][at[r]]
                mb, c = (int(x) for x in e["name"][len(e["cat"]):].split("."))
                vs = vs_of(r, c)
                dep = {"F": ("F", vs - 1) if vs > 0 else None,
                       "Bw": ("Bi", vs)}.get(e["cat"], ("F", vs) if vs == last else (
                           "Bi" if "Bi" in cost else "B", vs + 1))
                if dep is not None and (dep[0], mb, dep[1]) not in done:
                    break
                begin = max(t[r], done[(dep[0], mb, dep[1])] if dep else 0.0)
                t[r] = done[(e["cat"], mb, vs)] = begin + cost[e["cat"]]
                at[r] += 1
                progress = True
    work = sum(cost[e["cat"]] for r in ranks for e in lists[r])
    return 1 - work / (p * max(t.values()))


def write_config(args, work, schedule, m, tag, extra=""):
    P = args.stages
    metrics = work / f"{tag}.jsonl"
    metrics.unlink(missing_ok=True)
    trace = work / f"{tag}.trace.json"
    trace.unlink(missing_ok=True)
    v = 2 if schedule in ("zb-v", "adaptive-v") else 1
    if schedule == "adaptive-v":
        # The adaptive dispatcher on zb-v's V placement.
        schedule, extra = "adaptive", extra + " v_shape: true,"
    cfg = work / f"{tag}.yaml"
    cfg.write_text(MODEL.format(hidden=args.hidden, ffn=4 * args.hidden) + f"""data: {{path: {args.data}, seq_len: {SEQ}, eval_fraction: 0.0}}
training: {{steps: {args.steps}, global_batch: {2 * m}, micro_batch: 2, log_every: 1000,
           threads: 1}}
optimizer: {{lr: 1.0e-3, warmup_steps: 2}}
output: {{metrics: {metrics}, trace: {trace}, trace_steps: {args.steps - 1}}}
parallel: {{pp: {P}, virtual_stages: {v}, micro_batch: 2, schedule: {schedule},{extra}
           layers_per_stage: {split(P * v)}}}
""")
    return cfg, metrics


def run(args, work, schedule, m, delay=None, tag=None, extra=""):
    """Trains under `schedule`; `delay` is a TESSEL_PIPELINE_DELAY spec, `extra` more parallel
    keys. Returns the median pipeline idle share and step time over the timed steps."""
    P = args.stages
    tag = tag or f"{schedule}-m{m}"
    cfg, metrics = write_config(args, work, schedule, m, tag, extra)
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    spec = ",".join(x for x in ((f"dilate={args.dilate}" if args.dilate > 1 else ""), delay or "")
                    if x)
    if spec:
        env["TESSEL_PIPELINE_DELAY"] = spec
    r = subprocess.run([args.tessel, "train", str(cfg), "--nproc", str(P)], env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{tag} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    recs = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
    timed = recs[args.warmup:]
    # The trace starts at the second step: drop the warmup's other steps.
    trace = read_trace(work / f"{tag}.trace.json")
    bubbles = trace_bubbles(trace, args.warmup - 1)
    idle = statistics.median(bubbles)
    # The replay of the step whose measured bubble is the median.
    k = args.warmup - 1 + sorted(range(len(bubbles)), key=lambda i: bubbles[i])[len(bubbles) // 2]
    args.last_replay = replay_bubble(trace, k, "v_shape" in extra or schedule in ("zb-v",
                                                                                   "adaptive-v"))
    step = statistics.median(r["step_s"] for r in timed if "step_s" in r) if any(
        "step_s" in r for r in timed) else None
    return idle, step


def simulate(args, work, cfg, profile, schedule, sim_args):
    """The simulator's step time of `cfg` under `schedule` on this machine's profile."""
    r = subprocess.run([args.tessel, "simulate", "--config", str(cfg), "--profile", str(profile),
                        "--schedule", schedule, "--json"] + sim_args,
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"simulate {schedule} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)["step_s"]


def dispatcher_rows(args, work, out):
    """The adaptive dispatcher against 1F1B with one stage slowed: by a fixed 1.5x, and by a
    random +- 50% per compute (TESSEL_PIPELINE_DELAY), each beside the simulator's prediction
    for the same delays on this machine's profile (`tessel profile`)."""
    P, m, D = args.stages, 8, args.dilate
    cfg, _ = write_config(args, work, "adaptive", m, "profile-cfg")
    profile = work / "profile.json"
    cores = os.cpu_count() or 1
    # Undilated, the profile measures the workers the cores hold; a dilated run computes as if
    # each rank had a core, so its simulation shares no cores (cores = stages).
    r = subprocess.run([args.tessel, "profile", "--config", str(cfg), "--workers",
                        str(min(P, cores) if D > 1 else P),
                        "--threads", "1", "--micro-batches", "2", "--out", str(profile)],
                       env=dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE"),
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"profile failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    if D > 1:
        doc = json.loads(profile.read_text())
        doc["cores"] = P
        profile = work / "profile-dilated.json"
        profile.write_text(json.dumps(doc))
    slow = P - 1

    def slowed(stage_factors):
        """--slow-stage flags: every stage dilated D times, some further slowed."""
        flags = []
        for s in range(P):
            f = D * stage_factors.get(s, 1.0)
            if f != 1:
                flags += ["--slow-stage", f"{s}:{f:g}"]
        return flags

    args.sim_profile, args.sim_dilated = profile, slowed({})
    jitter_mean = 1 if D >= 2 else 2
    cases = [
        ("none", None, slowed({})),
        ("slow_first", "stage=0,slowdown=1.5", slowed({0: 1.5})),
        ("slow_stage", f"stage={slow},slowdown=1.5", slowed({slow: 1.5})),
        # +-50% per compute around the stage's own speed where dilation leaves room for the
        # fast half (D (1 - 0.5) >= 1), else around twice its time.
        ("jitter", f"stage={slow},slowdown={jitter_mean:g},jitter=0.5,seed=7",
         slowed({slow: jitter_mean}) + ["--stage-jitter", f"{slow}:0.5", "--seed", "7"]),
    ]
    ratios, errors = {}, []
    for name, delay, sim_args in cases:
        # Rounds alternate the two schedules (and their order), so that a change in the
        # machine's load hits both alike; the median over rounds is kept.
        measured_steps = {"1f1b": [], "adaptive": []}
        for k in range(args.rounds):
            order = ("1f1b", "adaptive") if k % 2 == 0 else ("adaptive", "1f1b")
            for schedule in order:
                _, step = run(args, work, schedule, m, delay, f"{schedule}-{name}")
                measured_steps[schedule].append(step)
        steps = {}
        for schedule in ("1f1b", "adaptive"):
            cfg_s = work / f"{schedule}-{name}.yaml"
            pred = simulate(args, work, cfg_s, profile, schedule, sim_args)
            steps[schedule] = (statistics.median(measured_steps[schedule]), pred)
        measured = steps["1f1b"][0] / steps["adaptive"][0]
        predicted = steps["1f1b"][1] / steps["adaptive"][1]
        err = abs(predicted - measured) / measured
        ratios[name] = measured
        errors.append(err)
        print(f"dispatcher vs 1f1b, {name:<10} step 1f1b {steps['1f1b'][0] * 1e3:7.1f} ms "
              f"adaptive {steps['adaptive'][0] * 1e3:7.1f} ms  speedup {measured:.3f}  "
              f"(simulated {steps['1f1b'][1] * 1e3:.1f} / {steps['adaptive'][1] * 1e3:.1f} ms: "
              f"{predicted:.3f}, error {err:.1%})")
        out[f"dispatch_vs_1f1b_{name}"] = round(measured, 3)
        out[f"dispatch_vs_1f1b_{name}_predicted"] = round(predicted, 3)
    out["dispatch_pred_error"] = round(max(errors), 3)


def jit_rows(args, work, out):
    """Just-in-time recomputation (1F1B, one micro-batch's activations per chunk) against keeping
    them: step time measured and simulated, and the planned peak activation memory."""
    m = 8
    variants = {"keep": "", "jit": " jit_recompute: true,"}
    steps = {k: [] for k in variants}
    for k in range(args.rounds):
        for name in (("keep", "jit") if k % 2 == 0 else ("jit", "keep")):
            _, step = run(args, work, "1f1b", m, None, f"1f1b-{name}", variants[name])
            steps[name].append(step)
    profile = getattr(args, "sim_profile", work / "profile.json")
    sim = {}
    for name in variants:
        r = subprocess.run([args.tessel, "simulate", "--config", str(work / f"1f1b-{name}.yaml"),
                            "--profile", str(profile), "--json"]
                           + getattr(args, "sim_dilated", []), capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"simulate {name} failed:\n{r.stderr[-2000:]}")
        d = json.loads(r.stdout)
        sim[name] = (d["step_s"], max(st["peak_activation_bytes"] for st in d["stages"]))
    keep, jit = statistics.median(steps["keep"]), statistics.median(steps["jit"])
    print(f"jit recompute (1f1b, m={m}): step keep {keep * 1e3:.1f} ms, jit {jit * 1e3:.1f} ms "
          f"({jit / keep:.3f}x; simulated {sim['jit'][0] / sim['keep'][0]:.3f}x); planned peak "
          f"activations {sim['keep'][1] / 2**20:.1f} -> {sim['jit'][1] / 2**20:.1f} MiB")
    out["jit_recompute_step_ratio"] = round(jit / keep, 3)
    out["jit_recompute_step_ratio_predicted"] = round(sim["jit"][0] / sim["keep"][0], 3)
    out["jit_recompute_mem_saving"] = round(1 - sim["jit"][1] / sim["keep"][1], 3)


def bench_json(args, binary, extra):
    """The last line of a bench binary's output, as JSON."""
    path = pathlib.Path(args.tessel).parent / "bench" / binary
    if not path.exists():
        path = pathlib.Path(args.tessel).parent / binary
    r = subprocess.run([str(path)] + extra, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{binary} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    lines = r.stdout.strip().splitlines()
    for line in lines[:-1]:
        print(line)
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tessel", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256,
                    help="n_embd (ffn 4x): larger makes each pass longer against a message")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--dilate", type=int, default=0,
                    help="stretch every compute D times (default: 1 with a core per stage, else "
                         "ceil(4 stages / cores))")
    ap.add_argument("--rounds", type=int, default=5,
                    help="dispatcher rows: runs of each schedule per case, alternated")
    ap.add_argument("--only", choices=["bubbles", "dispatcher", "transport", "recompute"],
                    help="run one part only")
    a = ap.parse_args()
    a.data = str(pathlib.Path(a.data).resolve())
    P = a.stages
    cores = os.cpu_count() or 1
    if a.dilate <= 0:
        a.dilate = 1 if cores >= P else -(-4 * P // cores)
    print(f"pipeline stages: {P} ({cores} cores), computes dilated {a.dilate}x")
    work = pathlib.Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = {"stages": P, "dilate": a.dilate}
    parts = [a.only] if a.only else ["bubbles", "dispatcher", "transport", "recompute"]
    for m in ((8, 16) if "bubbles" in parts else ()):
        for schedule in ("1f1b", "zb-h1", "zb-v", "adaptive-v"):
            idle, step = run(a, work, schedule, m)
            th = theory("zb-v" if schedule == "adaptive-v" else schedule, P, m)
            print(f"p={P} m={m:<3} {schedule:<10} bubble measured {idle:.3f}  theory {th:.3f}  "
                  f"median-time replay {a.last_replay:.3f}"
                  + (f"  step {step * 1e3:.1f} ms" if step else ""))
            key = {"1f1b": "1f1b", "zb-h1": "zbh1", "zb-v": "zbv", "adaptive-v": "adaptive_v"}[
                schedule]
            suffix = "" if m == 8 else f"_m{m}"
            out[f"bubble_{key}{suffix}"] = round(idle, 4)
            out[f"bubble_{key}{suffix}_theory"] = round(th, 4)
            out[f"bubble_{key}{suffix}_median_replay"] = round(a.last_replay, 4)
            if step:
                out[f"step_ms_{key}{suffix}"] = round(step * 1e3, 2)
    if "dispatcher" in parts:
        dispatcher_rows(a, work, out)
    if "transport" in parts:
        # Shared memory against TCP loopback, 4 KiB to 64 MiB, and a 64 MiB all-reduce over 4
        # processes (bench/bench_shm_transport.cpp).
        t = bench_json(a, "bench_shm_transport", ["--rounds", "5"])
        out.update({k: t[k] for k in t if k.startswith("shm_")})
    if "recompute" in parts:
        if hasattr(a, "sim_profile") or (a.dilate == 1 and (work / "profile.json").exists()):
            jit_rows(a, work, out)
        # Activation memory with and without recomputation against the planner's memory model
        # (bench/bench_recompute_memory.cpp).
        r = bench_json(a, "bench_recompute_memory", [])
        out.update({k: r[k] for k in r if k.startswith("recompute_")})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
