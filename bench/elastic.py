#!/usr/bin/env python3
"""`scripts/bench elastic`: the pause of a live reconfiguration against the stop-checkpoint-restart
path, for GPT-2 124M with its Adam state, on this machine (see bench/README.md).

The same sequence of plans runs twice, each step of both runs identical:
  live     one `tessel train` whose timeline switches plans at steps S1, S2, ...: the workers
           move the state between them (reshard) and continue;
  restart  one `tessel train` per plan, each ending at the next switch step with a checkpoint
           (training.stop_at) and the next resuming from it under the next plan.
A reconfiguration's pause is the wall-clock time from the end of the last step before the switch
to the start of the first step after it (metrics lines carry "time", the end of the step, and
"step_s"). Live switches are prepared elastic.prepare_steps (2) ahead while training goes on;
the extra time of those steps against the same steps of the restart run is reported beside the
pauses ("prepare_extra_step_s"), not hidden, and a third run with nothing prepared
(elastic.prepare_steps: 0) gives the pauses and the end-to-end time without preparation. Human-readable lines first, the last line is one JSON object. Standard library only.
"""
import argparse
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

SEQ = 64
GLOBAL_BATCH = 4
# (at_step, plan) in order; the first entry is the starting plan. Workers: 2 -> 1 -> 2 -> 2.
PLANS = [
    (0, {"dp": 2, "micro_batch": 2}),
    (2, {"dp": 1, "micro_batch": 2}),
    (4, {"dp": 2, "micro_batch": 2}),
    (6, {"pp": 2, "micro_batch": 2}),
]
STEPS = 8


def flow(d):
    return "{" + ", ".join(f"{k}: {v}" for k, v in d.items()) + "}"


def config(args, name, parallel, timeline=None, stop_at=0, resume_dir=None, prepare_steps=None,
           control_store=None):
    text = f"""model: {{preset: {args.model}}}
data: {{path: {args.data}, seq_len: {SEQ}, eval_fraction: 0.0, seed: 1}}
training: {{steps: {STEPS}, stop_at: {stop_at}, global_batch: {GLOBAL_BATCH}, seed: 1234, log_every: 1}}
optimizer: {{lr: 1.0e-4, warmup_steps: 1}}
output: {{metrics: {args.work}/{name}.metrics.jsonl, events: {args.work}/{name}.events.jsonl}}
parallel: {flow(parallel)}
"""
    if resume_dir:
        text += f"checkpoint: {{dir: {resume_dir}}}\n"
    elastic = {}
    if prepare_steps is not None:
        elastic["prepare_steps"] = prepare_steps
    if control_store:
        elastic["control_store"] = control_store
    if elastic:
        text += f"elastic: {flow(elastic)}\n"
    if timeline:
        text += "timeline:\n" + "".join(f"  - {{at_step: {s}, parallel: {flow(p)}}}\n"
                                         for s, p in timeline)
    path = pathlib.Path(args.work) / f"{name}.yaml"
    path.write_text(text)
    return path


def workers(plan):
    return plan.get("dp", 1) * plan.get("tp", 1) * plan.get("pp", 1)


def train(args, name, cfg, nproc):
    log = pathlib.Path(args.work) / f"{name}.log"
    env = dict(os.environ)
    with open(log, "w") as out:
        rc = subprocess.run([args.tessel, "train", str(cfg), "--nproc", str(nproc)], env=env,
                            stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"bench elastic: {name} failed (exit {rc}); see {log}")


def records(path):
    return [json.loads(l) for l in pathlib.Path(path).read_text().splitlines() if l.strip()]


def step_times(path):
    return {r["step"]: r["step_s"] for r in records(path)}


def pauses(recs, switch_steps):
    by_step = {r["step"]: r for r in recs}
    out = []
    for s in switch_steps:
        before, after = by_step[s], by_step[s + 1]
        out.append(after["time"] - after["step_s"] - before["time"])
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    """A throwaway etcd (Debian's etcd-server) for the run on etcd; None when it is not installed."""

    def __init__(self, work):
        self.proc = None
        binary = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
        if not binary:
            return
        client, peer = free_port(), free_port()
        self.endpoint = f"http://127.0.0.1:{client}"
        data = pathlib.Path(work) / "etcd-data"
        subprocess.run(["rm", "-rf", str(data)], check=True)
        self.proc = subprocess.Popen(
            [binary, "--data-dir", str(data), "--listen-client-urls", self.endpoint,
             "--advertise-client-urls", self.endpoint,
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                with urllib.request.urlopen(self.endpoint + "/health", timeout=1) as r:
                    if b"true" in r.read():
                        return
            except OSError:
                time.sleep(0.05)
        self.close()
        sys.exit("bench elastic: etcd did not become healthy")

    def close(self):
        if self.proc:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tessel", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--model", default="gpt2-124m", help="preset (gpt2-tiny for a smoke test)")
    args = ap.parse_args()
    args.data, args.work = os.path.abspath(args.data), os.path.abspath(args.work)
    os.makedirs(args.work, exist_ok=True)
    for f in pathlib.Path(args.work).glob("*.jsonl"):
        f.unlink()
    switch_steps = [s for s, _ in PLANS[1:]]
    print(f"{args.model} (+ Adam state), seq {SEQ}, global batch {GLOBAL_BATCH}, {STEPS} steps; "
          f"plans: " + " -> ".join(f"{p} (at step {s})" for s, p in PLANS), flush=True)

    # Live: one run with a timeline.
    live_cfg = config(args, "live", PLANS[0][1], timeline=PLANS[1:])
    train(args, "live", live_cfg, max(workers(p) for _, p in PLANS))
    live = pauses(records(pathlib.Path(args.work) / "live.metrics.jsonl"), switch_steps)
    events = records(pathlib.Path(args.work) / "live.events.jsonl")
    # The same, with nothing prepared ahead (everything built during the pauses): what the
    # preparation buys and costs.
    bare_cfg = config(args, "bare", PLANS[0][1], timeline=PLANS[1:], prepare_steps=0)
    train(args, "bare", bare_cfg, max(workers(p) for _, p in PLANS))
    bare = pauses(records(pathlib.Path(args.work) / "bare.metrics.jsonl"), switch_steps)
    # The live run again with the control store on etcd instead of the embedded one.
    etcd = Etcd(args.work)
    etcd_events = None
    if etcd.proc:
        try:
            etcd_cfg = config(args, "etcd", PLANS[0][1], timeline=PLANS[1:],
                              control_store=etcd.endpoint)
            train(args, "etcd", etcd_cfg, max(workers(p) for _, p in PLANS))
        finally:
            etcd.close()
        etcd_live = pauses(records(pathlib.Path(args.work) / "etcd.metrics.jsonl"), switch_steps)
        etcd_events = records(pathlib.Path(args.work) / "etcd.events.jsonl")

    # Restart: one run per plan, each stopping at the next switch with a checkpoint.
    ck = pathlib.Path(args.work) / "restart-ck"
    subprocess.run(["rm", "-rf", str(ck)], check=True)
    for i, (start, plan) in enumerate(PLANS):
        stop = PLANS[i + 1][0] if i + 1 < len(PLANS) else STEPS
        cfg = config(args, "restart", plan, stop_at=stop, resume_dir=ck)
        train(args, f"restart-{i}", cfg, workers(plan))
    restart = pauses(records(pathlib.Path(args.work) / "restart.metrics.jsonl"), switch_steps)

    # A live switch is prepared ahead (elastic.prepare_steps): its new processes start and every
    # process builds its new buffers while the steps before it run. What that costs is those
    # steps' time beyond the same steps of the restart run (same plans, nothing prepared).
    live_steps = step_times(pathlib.Path(args.work) / "live.metrics.jsonl")
    restart_steps = step_times(pathlib.Path(args.work) / "restart.metrics.jsonl")
    extra = []
    for i, s in enumerate(switch_steps):
        a = events[i].get("announced_at_step", s)
        extra.append(sum(live_steps[k] - restart_steps[k] for k in range(a + 1, s + 1)))

    print(f"{'switch':<28} {'live pause s':>12} {'restart pause s':>16} {'speedup':>8} "
          f"{'unprepared s':>13}  live breakdown")
    for i, s in enumerate(switch_steps):
        e = events[i]
        prep = (f"; announced after step {e['announced_at_step']}, waited "
                f"{e.get('prepare_wait_s', 0):.3f} for the build, steps "
                f"{e['announced_at_step'] + 1}..{s} took {extra[i]:+.3f} s against restart"
                if "announced_at_step" in e else "")
        print(f"{str(PLANS[i][1]) + '->' + str(PLANS[i + 1][1]):<28} {live[i]:>12.3f} "
              f"{restart[i]:>16.3f} {restart[i] / live[i]:>8.1f} {bare[i]:>13.3f}  "
              f"total {e['total_pause_s']:.3f} "
              f"(control {e['control_s']:.4f}, plan {e['planning_s']:.3f}, connect {e['connect_s']:.3f}, rebuild "
              f"{e['rebuild_s']:.3f}, transfer {e['transfer_s']:.3f}; "
              f"{e['bytes_moved'] / 1e6:.0f} MB moved{prep})")
    # The control plane's share of each pause: from the step boundary (or the decision, when it
    # came later) to the last process's go, embedded store against etcd.
    for i, s in enumerate(switch_steps):
        line = f"control plane at switch {i + 1}: embedded {events[i]['control_s']:.4f} s"
        if etcd_events:
            line += (f", etcd {etcd_events[i]['control_s']:.4f} s (pause on etcd "
                     f"{etcd_live[i]:.3f} s, connect {etcd_events[i]['connect_s']:.3f} s)")
        print(line)
    # End to end, for the whole picture: from the start of step 1 to the end of the last step.
    span = {}
    for name in ("live", "bare", "restart"):
        recs = {r["step"]: r for r in records(pathlib.Path(args.work) / f"{name}.metrics.jsonl")}
        span[name] = recs[STEPS]["time"] - (recs[1]["time"] - recs[1]["step_s"])
    print(f"steps 1..{STEPS} end to end: live {span['live']:.2f} s, live unprepared "
          f"{span['bare']:.2f} s, restart {span['restart']:.2f} s")
    pl, pr = sum(live) / len(live), sum(restart) / len(restart)
    print(json.dumps({"pause_live_s": round(pl, 4), "pause_restart_s": round(pr, 4),
                      "speedup": round(pr / pl, 2), "live_pauses_s": [round(x, 4) for x in live],
                      "restart_pauses_s": [round(x, 4) for x in restart],
                      "prepare_extra_step_s": [round(x, 4) for x in extra],
                      "unprepared_pauses_s": [round(x, 4) for x in bare],
                      "run_live_s": round(span["live"], 3),
                      "run_unprepared_s": round(span["bare"], 3),
                      "run_restart_s": round(span["restart"], 3),
                      "control_embedded_s": [round(e["control_s"], 5) for e in events],
                      "control_etcd_s": [round(e["control_s"], 5) for e in etcd_events or []],
                      "pauses_etcd_s": [round(x, 4) for x in (etcd_live if etcd_events else [])],
                      "switches": [f"{PLANS[i][1]}->{PLANS[i + 1][1]}" for i in range(len(switch_steps))]}))


if __name__ == "__main__":
    main()
