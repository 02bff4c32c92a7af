#!/usr/bin/env python3
"""`scripts/bench soak [minutes]`: a small GPT trained elastically on 2-4 local workers while a
seeded fault injector fires at random moments, then checked against an uninterrupted run (see
bench/README.md).

Faults (one at a time; the next fires once the job has recovered from the last, after a random
0.2-1.5 s):
  sigkill          SIGKILL of a random worker (elastic.replace_failed starts a new one)
  sigstop          SIGSTOP of a random worker: a frozen VM; it must be fenced by its heartbeat
  sigterm_worker   SIGTERM of a random worker: a preemption notice, a planned leave
  kill_in_save     SIGKILL of a random worker while a checkpoint is being staged (a step-N.tmp-*
                   directory exists)
  kill_in_switch   SIGKILL of a random worker 0-0.6 s after a scale request (recovered once the
                   job runs the requested count: the failure must not swallow the request), or a
                   second SIGKILL 0.05-0.3 s after a first (while the job recovers from it)
  disk_full        the checkpoint disk (a small tmpfs) filled to its last 64 KiB until a save has
                   failed, then freed
  corrupt          a byte flipped in the newest checkpoint's tensor data
  scale            `tessel ctl scale N`, N in 2..4 and not the current count
  restart          SIGTERM to `tessel train` (it saves at the step boundary and exits 143), then
                   the same command again (it resumes)
Worker faults that would leave no replica of the state (the last worker) are not fired: the
injector scales up first.

A fault is recovered when, within --hang-s (60 s), the job has trained 2 more steps, runs as many
worker processes as its plan has (a stopped worker fenced and gone), and, after disk_full, has
published a checkpoint again. Otherwise it is a hang: the job is killed and resumed so the soak
goes on, and the hang is counted.

At the end `tessel train` is stopped (SIGTERM) and checked:
  orphans           worker processes of the job alive after their launcher exited (checked after
                    every restart and at the end)
  leftover_files    staging directories in the checkpoint directory, `tessel-store-*` in the
                    job's TMPDIR, sockets in its control directory, new entries in /dev/shm
  checkpoints_lost  checkpoints that no fault damaged but that do not verify, plus resumes from
                    a checkpoint older than the newest intact one
  loss_matches      a reference run without faults, whose timeline replays the plans the soak
                    ran each step with (from the events and the restarts), gives bit-equal
                    losses at every step the soak logged
  samples_exactly_once  the data-order log: for every step, the lines of the last run and
                    generation that trained it cover its window of the sample order exactly
Human-readable lines first; the last line is one JSON object. Standard library only.
"""
import argparse
import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import time

from plans import timeline_entry, workers_of

SEQ = 64
GLOBAL_BATCH = 24
MAX_WORKERS = 4
STEPS = 1_000_000  # never reached: the soak stops the job (the schedule's length fixes the LR)
CHECKPOINT_EVERY = 10
SAVE_FAILED = "not saved: "  # what a worker logs when a checkpoint save failed
TMPFS_MB = 48  # keep 2 checkpoints of ~10 MB, one being staged, and the disk_full filler's margin

MODEL = """model:
  family: gpt2
  n_layer: 4
  n_embd: 128
  n_head: 4
  ffn_hidden: 512
  vocab_size: 257
  max_seq_len: 64
"""


def config_text(args, name, checkpoint, timeline=None, stop_at=0):
    text = MODEL + f"""data: {{path: {args.data}, seq_len: {SEQ}, eval_fraction: 0.0, seed: 1}}
training: {{steps: {STEPS}, stop_at: {stop_at}, global_batch: {GLOBAL_BATCH}, seed: 1234, log_every: 1, threads: 1}}
optimizer: {{lr: 1.0e-3, min_lr: 1.0e-4, warmup_steps: 10, weight_decay: 0.1}}
parallel: {{dp: 4, micro_batch: 6, timeout_s: 20}}
elastic: {{replace_failed: true, heartbeat_timeout_s: 2}}
output: {{metrics: {name}.metrics.jsonl, events: {name}.events.jsonl, data_order: {name}.order.jsonl}}
"""
    if checkpoint:
        text += (f"checkpoint: {{dir: ck, every: {CHECKPOINT_EVERY}, keep: 2, async: true, "
                 f"resume: true}}\n")
    if timeline:
        text += "timeline:\n" + "".join(timeline_entry(s, w) for s, w in timeline)
    return text


# ---------------------------------------------------------------------------------------------
# Processes


def proc_stat(pid):
    """(state, ppid) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    rest = s[s.rindex(")") + 2:].split()
    return rest[0], int(rest[1])


def marked_processes(marker):
    """Every live process whose environment carries the soak's marker (the launcher and all the
    workers it ever started inherit it)."""
    out = []
    needle = f"TESSEL_SOAK_MARK={marker}".encode()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        st = proc_stat(int(d))
        if needle in env.split(b"\0") and st is not None and st[0] != "Z":
            out.append(int(d))
    return out


class JsonLines:
    """Reads an append-only JSON-lines file as it grows; remembers each line's byte offset."""

    def __init__(self, path):
        self.path = path
        self.offset = 0
        self.lines = []  # (offset, record)
        self.partial = b""
        self.fragments = 0  # unfinished lines of killed writers

    def poll(self):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        start = self.offset - len(self.partial)
        data = self.partial + data
        self.offset += len(data) - len(self.partial)
        new = []
        pos = 0
        while True:
            nl = data.find(b"\n", pos)
            if nl < 0:
                break
            line = data[pos:nl].strip()
            if line:
                rec = (start + pos, self.parse(line))
                if rec[1] is not None:
                    self.lines.append(rec)
                    new.append(rec[1])
            pos = nl + 1
        self.partial = data[pos:]
        return new

    def size(self):
        return self.offset

    def parse(self, line):
        """One record; a line that a killed worker left unfinished has the next record glued
        to it: that record is kept, the fragment dropped."""
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            self.fragments += 1
            at = line.rfind(b'{"')
            try:
                return json.loads(line[at:]) if at > 0 else None
            except json.JSONDecodeError:
                return None


class Job:
    """One soaked `tessel train`, restarted (resumed) as the faults require."""

    def __init__(self, args, work, env):
        self.args, self.work, self.env = args, work, env
        self.proc = None
        self.runs = []  # per launcher start: offsets of the logs, the log path, how it ended
        self.metrics = JsonLines(work / "soak.metrics.jsonl")
        self.events = JsonLines(work / "soak.events.jsonl")
        self.order = JsonLines(work / "soak.order.jsonl")
        self.last_step = 0
        self.last_step_time = time.monotonic()
        self.workers = MAX_WORKERS  # the plan's, from the newest metrics line

    def start(self):
        self.poll()
        log = self.work / f"train-{len(self.runs):03d}.log"
        self.runs.append({"metrics": self.metrics.size(), "events": self.events.size(),
                          "order": self.order.size(), "log": log, "started": time.monotonic()})
        out = open(log, "w")
        self.proc = subprocess.Popen([self.args.tessel, "train", "soak.yaml"], cwd=self.work,
                                     env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        out.close()
        self.last_step_time = time.monotonic()

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def poll(self):
        for m in self.metrics.poll():
            self.last_step_time = time.monotonic()
            self.last_step = m["step"]
            self.workers = m.get("workers", self.workers)
        self.events.poll()
        self.order.poll()

    def worker_pids(self, running_only=True):
        if not self.alive():
            return []
        pids = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                st = proc_stat(int(d))
                if st and st[1] == self.proc.pid and st[0] != "Z":
                    if not running_only or st[0] != "T":
                        pids.append(int(d))
        return pids

    def stop(self, sig=signal.SIGTERM, timeout=90):
        """Signals the launcher, waits for it; returns its exit code (None: it had to be
        killed)."""
        if not self.alive():
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            rc = None
        self.runs[-1]["rc"] = rc
        self.poll()
        return rc

    def kill_everything(self):
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        for pid in marked_processes(self.args.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def resumed_step(self, run):
        """The step the run resumed from (0 for a fresh start), from its log."""
        try:
            text = run["log"].read_text(errors="replace")
        except OSError:
            return None
        m = re.search(r"resumed from \S+ at step (\d+)", text)
        if m:
            return int(m.group(1))
        return 0 if "training " in text else None


# ---------------------------------------------------------------------------------------------
# The injector


class Soak:
    KINDS = [("sigkill", 3), ("sigstop", 2), ("sigterm_worker", 2), ("kill_in_save", 2),
             ("kill_in_switch", 2), ("disk_full", 1), ("corrupt", 1), ("scale", 2),
             ("restart", 1)]

    def __init__(self, args, work, job, rng):
        self.args, self.work, self.job, self.rng = args, work, job, rng
        self.ck = work / "ck"
        self.faults = []
        self.corrupted = set()  # checkpoint names the injector damaged
        self.orphans = 0
        self.hangs = 0
        self.checkpoints_lost = 0
        self.notes = []

    def log(self, text):
        print(f"[{time.monotonic() - self.args.t0:7.1f} s] {text}", flush=True)

    # -- helpers -----------------------------------------------------------------------------

    def checkpoints(self):
        """Published checkpoints (with a manifest), oldest first."""
        try:
            names = sorted(n for n in os.listdir(self.ck) if re.fullmatch(r"step-\d+", n))
        except FileNotFoundError:
            return []
        return [n for n in names if (self.ck / n / "manifest.json").exists()]

    def staging(self):
        try:
            return [n for n in os.listdir(self.ck) if ".tmp-" in n]
        except FileNotFoundError:
            return []

    def ctl(self, *words):
        r = subprocess.run([self.args.tessel, "ctl", *words], cwd=self.work, env=self.job.env,
                           capture_output=True, text=True, timeout=60)
        return r.returncode, (r.stdout + r.stderr).strip()

    def victim(self):
        pids = self.job.worker_pids()
        return self.rng.choice(pids) if pids else None

    def kill(self, pid, sig=signal.SIGKILL):
        if pid is None:
            return False
        try:
            os.kill(pid, sig)
            return True
        except ProcessLookupError:
            return False

    def wait_for(self, cond, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.job.poll()
            if cond():
                return True
            time.sleep(0.02)
        return False

    def check_orphans(self, when):
        time.sleep(0.5)
        left = marked_processes(self.args.marker)
        if self.job.alive():
            left = [p for p in left if p != self.job.proc.pid and
                    (proc_stat(p) or ("", 0))[1] != self.job.proc.pid]
        if left:
            self.orphans += len(left)
            self.log(f"ORPHANS {when}: {left}")
            for p in left:
                self.kill(p)

    # -- faults ------------------------------------------------------------------------------

    def choose(self):
        kinds = [k for k, w in self.KINDS for _ in range(w)]
        if not self.args.tmpfs:
            kinds = [k for k in kinds if k != "disk_full"]
        kind = self.rng.choice(kinds)
        n = len(self.job.worker_pids())
        # Never fire at the last replica; a leave or a second kill needs a third worker.
        if kind in ("sigkill", "sigstop", "kill_in_save") and n < 2:
            kind = "scale"
        if kind in ("sigterm_worker", "kill_in_switch") and n < 3:
            kind = "scale"
        return kind

    def fire(self, kind):
        """Injects one fault; returns (detail, extra condition for recovery or None)."""
        job = self.job
        if kind in ("sigkill", "sigstop", "sigterm_worker"):
            pid = self.victim()
            sig = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP,
                   "sigterm_worker": signal.SIGTERM}[kind]
            if pid is None or not self.kill(pid, sig):
                return f"{sig.name}: no worker to signal", None

            def gone():
                st = proc_stat(pid)
                return st is None or st[0] == "Z"
            return f"{sig.name} worker {pid}", gone
        if kind == "kill_in_save":
            if not self.wait_for(lambda: self.staging(), 20):
                pid = self.victim()
                self.kill(pid)
                return f"SIGKILL worker {pid} (no save seen in 20 s)", None
            pid = self.victim()
            self.kill(pid)
            return f"SIGKILL worker {pid} while {self.staging() or 'a save'} was staged", None
        if kind == "kill_in_switch":
            if self.rng.random() < 0.5:
                n = self.rng.choice([w for w in range(2, MAX_WORKERS + 1) if w != job.workers])
                rc, out = self.ctl("scale", str(n))
                time.sleep(self.rng.uniform(0, 0.6))
                pid = self.victim()
                self.kill(pid)
                # The failure must not swallow the request: the job ends up on n workers.
                return (f"scale {n} (rc {rc}) then SIGKILL worker {pid}",
                        lambda: rc == 0 and job.workers == n)
            first = self.victim()
            self.kill(first)
            time.sleep(self.rng.uniform(0.05, 0.3))
            second = self.victim()
            self.kill(second)
            return f"SIGKILL worker {first} then worker {second}", None
        if kind == "disk_full":
            return self.fill_disk()
        if kind == "corrupt":
            names = [n for n in self.checkpoints() if n not in self.corrupted]
            if not names:
                return "no checkpoint to corrupt yet", None
            name = names[-1]
            try:
                target = self.rng.choice(sorted((self.ck / name).glob("*.safetensors")))
                size = target.stat().st_size
                with open(target, "r+b") as f:
                    at = size - 1 - self.rng.randrange(min(size - 16, 1 << 20))
                    f.seek(at)
                    b = f.read(1)
                    f.seek(at)
                    f.write(bytes([b[0] ^ 0x5A]))
            except (OSError, IndexError):
                return f"{name} was pruned before it could be corrupted", None
            self.corrupted.add(name)
            return f"flipped byte {at} of {name}/{target.name}", None
        if kind == "scale":
            n = self.rng.choice([w for w in range(2, MAX_WORKERS + 1) if w != job.workers])
            rc, out = self.ctl("scale", str(n))
            if rc != 0:
                return f"scale {n} refused: {out}", (lambda: False)
            return f"scale {n}", (lambda: job.workers == n)
        if kind == "restart":
            before = job.last_step
            t = time.monotonic()
            rc = job.stop(signal.SIGTERM)
            stopped_s = time.monotonic() - t
            self.check_orphans("after the launcher's exit")
            stale = self.staging()
            job.start()
            detail = f"SIGTERM launcher at step {before}: rc {rc} after {stopped_s:.1f} s"
            if stale:
                detail += f", staging left {stale}"
            job.runs[-1]["stop_rc"] = rc
            ok = rc == 128 + signal.SIGTERM
            return detail, (lambda: ok)
        raise ValueError(kind)

    def fill_disk(self):
        fill = self.work / "ck" / "filler"
        st = os.statvfs(self.ck)
        free = st.f_bavail * st.f_frsize
        newest = self.checkpoints()[-1:] or [None]
        failures = self.count_in_logs(SAVE_FAILED)
        fd = os.open(fill, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = max(0, free - 64 * 1024)
            chunk = b"\0" * (1 << 20)
            while left > 0:
                left -= os.write(fd, chunk[:min(left, len(chunk))])
        except OSError:
            pass  # full already: a save is being staged
        finally:
            os.close(fd)
        failed = self.wait_for(lambda: self.count_in_logs(SAVE_FAILED) > failures, 30)
        fill.unlink()
        detail = (f"filled the checkpoint disk ({free >> 20} MiB free) "
                  f"{'until a save failed' if failed else 'for 30 s, no save failed'}")
        # Recovered once a checkpoint newer than the one before the fill is published.
        return detail, (lambda: (self.checkpoints()[-1:] or [None]) != newest)

    def count_in_logs(self, text):
        n = 0
        for run in self.job.runs:
            try:
                n += run["log"].read_text(errors="replace").count(text)
            except OSError:
                pass
        return n

    # -- the loop ----------------------------------------------------------------------------

    def recovered(self, since_step, extra, since_time):
        job = self.job
        if not job.alive():
            return False
        if job.last_step < since_step + 2 or job.last_step_time < since_time:
            return False
        if extra is not None and not extra():
            return False
        return len(job.worker_pids(running_only=False)) == job.workers

    def run(self, deadline):
        job = self.job
        job.start()
        if not self.wait_for(lambda: job.last_step >= 3, 120):
            raise SystemExit("soak: the job did not start training within 120 s; see "
                             f"{job.runs[-1]['log']}")
        while time.monotonic() < deadline:
            time.sleep(self.rng.uniform(0.2, 1.5))
            job.poll()
            kind = self.choose()
            step0, t0 = job.last_step, time.monotonic()
            events0 = len(job.events.lines)
            detail, extra = self.fire(kind)
            ok = self.wait_for(lambda: self.recovered(step0, extra, t0), self.args.hang_s)
            took = time.monotonic() - t0
            new_events = [e for _, e in job.events.lines[events0:]]
            lost = sum(e.get("steps_lost", 0) for e in new_events)
            if kind == "restart":
                resumed = job.resumed_step(job.runs[-1])
                if resumed is not None:
                    lost += max(0, step0 - resumed)
                newest = [n for n in self.checkpoints() if n not in self.corrupted]
                if resumed is not None and newest and resumed < int(newest[-1][5:]) and \
                        int(newest[-1][5:]) <= step0:
                    self.checkpoints_lost += 1
                    self.log(f"resumed from step {resumed} though {newest[-1]} was intact")
            fault = {"kind": kind, "detail": detail, "step": step0, "recovered": ok,
                     "recovery_s": round(took, 3), "steps_lost": lost}
            self.faults.append(fault)
            self.log(f"#{len(self.faults)} {kind}: {detail} at step {step0} -> "
                     f"{'recovered' if ok else 'NOT RECOVERED'} in {took:.2f} s, "
                     f"{lost} step(s) lost, {job.workers} workers")
            if not ok:
                self.hangs += 1
                self.log(f"hang: no recovery within {self.args.hang_s} s; killing the job and "
                         f"resuming it (see {job.runs[-1]['log']})")
                before = job.last_step
                job.kill_everything()
                self.check_orphans("after a hang")
                restarted = time.monotonic()
                job.start()
                if not self.wait_for(lambda: job.last_step_time > restarted, 120):
                    self.log("the resumed job does not train; ending the soak")
                    break
                # What the kill lost counts against the fault that hung.
                resumed = job.resumed_step(job.runs[-1]) or 0
                fault["steps_lost"] += max(0, before - resumed)


# ---------------------------------------------------------------------------------------------
# The checks at the end


def plan_history(job):
    """[(at_step, plan)] change points of the plans the final history ran with: a change point
    (a, p) means steps after a ran with p -- a described plan from an event, or a worker count
    (a resume starts on the config's plan, the planner's for MAX_WORKERS); an event or a resume
    at step s replaces everything after s."""
    points = [(0, MAX_WORKERS)]

    def at(step, workers):
        while points and points[-1][0] >= step:
            points.pop()
        points.append((step, workers))

    run_starts = [r["events"] for r in job.runs]
    events = job.events.lines
    for i, run in enumerate(job.runs):
        resumed = job.resumed_step(run)
        if resumed is None:
            raise SystemExit(f"soak: cannot tell where run {i} resumed ({run['log']})")
        at(resumed, MAX_WORKERS)
        end = run_starts[i + 1] if i + 1 < len(run_starts) else float("inf")
        for off, e in events:
            if run["events"] <= off < end:
                at(e["step"], e["new_plan"])
    timeline = []
    for s, w in points:
        if (timeline[-1][1] if timeline else MAX_WORKERS) != w:
            timeline.append((s, w))
    return timeline


def last_records(lines, runs, key):
    """For every step, the records of the newest (run, generation) -- or the newest record --
    in file order."""
    starts = [r[key] for r in runs]
    out = {}
    for off, rec in lines:
        run = max(i for i, s in enumerate(starts) if s <= off)
        out.setdefault(rec["step"], []).append((run, rec))
    return out


def check_data_order(job, final_step):
    by_step = last_records(job.order.lines, job.runs, "order")
    bad = []
    for step in range(1, final_step + 1):
        recs = by_step.get(step)
        if not recs:
            bad.append(f"step {step}: no lines")
            continue
        newest = max((run, r["generation"]) for run, r in recs)
        ranges = sorted((r["first"], r["first"] + r["count"]) for run, r in recs
                        if (run, r["generation"]) == newest)
        at = (step - 1) * GLOBAL_BATCH
        for lo, hi in ranges:
            if lo != at:
                bad.append(f"step {step}: samples from {lo}, expected {at}")
            at = hi
        if at != step * GLOBAL_BATCH:
            bad.append(f"step {step}: ends at sample {at}, expected {step * GLOBAL_BATCH}")
    extra = [s for s in by_step if s > final_step]
    if extra:
        bad.append(f"lines for steps past the final one: {extra[:5]}")
    return bad


def leftovers(work, shm_before):
    out = []
    ck = work / "ck"
    if ck.exists():
        out += [f"ck/{n}" for n in os.listdir(ck) if ".tmp-" in n or n == "filler"]
    out += [f"tmp/{n}" for n in os.listdir(work / "tmp")]
    ctl = work / "ctl"
    if ctl.exists():
        for root, _, files in os.walk(ctl):
            out += [os.path.join(root, f) for f in files]
    out += [f"/dev/shm/{n}" for n in set(os.listdir("/dev/shm")) - shm_before]
    return out


def verify(args, work, name):
    r = subprocess.run([args.tessel, "store", "verify", str(work / "ck" / name)],
                       capture_output=True, text=True, timeout=300)
    return r.returncode == 0, (r.stdout + r.stderr).strip()


def run_reference(args, work, env, timeline, final_step):
    (work / "reference.yaml").write_text(
        config_text(args, "reference", checkpoint=False, timeline=timeline, stop_at=final_step))
    for p in ("reference.metrics.jsonl", "reference.events.jsonl", "reference.order.jsonl"):
        (work / p).unlink(missing_ok=True)
    nproc = max([MAX_WORKERS] + [workers_of(w) for _, w in timeline])
    with open(work / "reference.log", "w") as out:
        rc = subprocess.run([args.tessel, "train", "reference.yaml", "--nproc", str(nproc)],
                            cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"soak: the reference run failed (rc {rc}); see {work}/reference.log")
    ref = {}
    for line in (work / "reference.metrics.jsonl").read_text().splitlines():
        if line.strip():
            m = json.loads(line)
            ref[m["step"]] = m
    return ref


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tessel", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hang-s", type=float, default=60)
    ap.add_argument("--tmpfs", action="store_true",
                    help="mount a small tmpfs on the checkpoint directory (needs a private "
                         "mount namespace: scripts/bench runs this under unshare -m)")
    args = ap.parse_args()
    args.t0 = time.monotonic()
    args.tessel = str(pathlib.Path(args.tessel).resolve())
    args.data = str(pathlib.Path(args.data).resolve())
    args.marker = f"{os.getpid()}-{random.randrange(1 << 30)}"
    work = pathlib.Path(args.work).resolve()
    if work.exists():
        shutil.rmtree(work)
    (work / "ck").mkdir(parents=True)
    (work / "tmp").mkdir()
    if args.tmpfs:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m", "tmpfs",
                        str(work / "ck")], check=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(work / "tmp"),
               TESSEL_CTL_DIR=str(work / "ctl"), TESSEL_SOAK_MARK=args.marker)
    (work / "soak.yaml").write_text(config_text(args, "soak", checkpoint=True))
    shm_before = set(os.listdir("/dev/shm"))
    rng = random.Random(args.seed)

    print(f"soak: {args.minutes:g} min, seed {args.seed}, gpt2 4x128 on 2-{MAX_WORKERS} workers, "
          f"checkpoints every {CHECKPOINT_EVERY} steps on "
          f"{f'a {TMPFS_MB} MiB tmpfs' if args.tmpfs else 'the work disk (no disk_full faults)'}"
          f"; work dir {work}", flush=True)
    job = Job(args, work, env)
    soak = Soak(args, work, job, rng)
    try:
        soak.run(args.t0 + args.minutes * 60)
        rc = job.stop(signal.SIGTERM)
        soak.log(f"stopped the job: rc {rc}")
        soak.check_orphans("at the end")
    finally:
        job.kill_everything()
    job.poll()

    final_step = job.last_step
    names = soak.checkpoints()
    newest = names[-1] if names else None
    if newest is None or int(newest[5:]) != final_step:
        soak.log(f"the final checkpoint is {newest}, not step {final_step}")
        soak.checkpoints_lost += 1
    for name in names:
        ok, out = verify(args, work, name)
        if not ok and name not in soak.corrupted:
            soak.checkpoints_lost += 1
            soak.log(f"checkpoint {name} does not verify and no fault touched it: {out}")
        if not ok and name == newest:
            soak.checkpoints_lost += 1
            soak.log(f"the newest checkpoint {name} does not verify: {out}")
    left = leftovers(work, shm_before)
    for item in left:
        soak.log(f"left over: {item}")

    order_bad = check_data_order(job, final_step)
    for b in order_bad[:10]:
        soak.log(f"data order: {b}")

    timeline = plan_history(job)
    soak.log(f"reference run: {final_step} steps, {len(timeline)} plan changes")
    t = time.monotonic()
    ref = run_reference(args, work, env, timeline, final_step)
    soak.log(f"reference run took {time.monotonic() - t:.0f} s")
    soaked = {}
    for _, m in job.metrics.lines:
        soaked[m["step"]] = m  # the newest record of each step
    mismatches = []
    for step in range(1, final_step + 1):
        if step not in soaked:
            continue
        a, b = soaked[step], ref.get(step)
        if b is None or a["loss"] != b["loss"] or a["workers"] != b["workers"]:
            mismatches.append((step, a["loss"], a["workers"], b and b["loss"], b and b["workers"]))
    for m in mismatches[:10]:
        soak.log(f"step {m[0]}: soak loss {m[1]!r} on {m[2]} workers, reference {m[3]!r} on "
                 f"{m[4]}")
    unlogged = final_step - sum(1 for s in soaked if s <= final_step)

    faults = soak.faults
    by_kind = {}
    for f in faults:
        by_kind[f["kind"]] = by_kind.get(f["kind"], 0) + 1
    recovered = sum(1 for f in faults if f["recovered"])
    lost = [f["steps_lost"] for f in faults]
    result = {
        "faults": len(faults),
        "by_kind": by_kind,
        "recovered": recovered,
        "hangs": soak.hangs,
        "steps_lost_max": max(lost, default=0),
        "steps_lost_total": sum(lost),
        "checkpoints_lost": soak.checkpoints_lost,
        "orphans": soak.orphans,
        "leftover_files": len(left),
        "loss_matches": not mismatches and len(ref) == final_step,
        "samples_exactly_once": not order_bad,
        "steps": final_step,
        "unlogged_steps": unlogged,
        "restarts": len(job.runs) - 1,
        "recovery_s_median": sorted(f["recovery_s"] for f in faults)[len(faults) // 2]
        if faults else 0,
        "recovery_s_max": max((f["recovery_s"] for f in faults), default=0),
        "minutes": args.minutes,
        "seed": args.seed,
    }
    (work / "faults.json").write_text(json.dumps(faults, indent=1))
    print(f"{len(faults)} faults ({recovered} recovered, {soak.hangs} hangs), {final_step} steps, "
          f"{sum(lost)} steps lost in all, {len(job.runs) - 1} restarts; losses "
          f"{'equal' if result['loss_matches'] else 'DIFFERENT'} to the reference at "
          f"{final_step - unlogged} logged steps; faults in {work}/faults.json")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
