#!/usr/bin/env python3
"""`scripts/bench cluster` and `scripts/demo cluster`: a job on a cluster of hosts built from Linux
network namespaces on this machine (see bench/README.md and docs/architecture.md, *Many hosts*).

The hosts: h0 runs etcd and the submitting `tessel train --cluster`; h1, h2 and later h3 run one
`tessel agent` each (1 slot). Every host has its own address on a bridge in a namespace of its own;
nothing is configured in this machine's own namespace. The scenario, each step driven by the job's
progress, not by the clock:
  join            h3's agent starts: the job grows from 2 to 3 workers at a step boundary
  host_loss       a host other than the coordinator's dies whole (its link cut first, so no reset
                  reaches the others, then every process in it SIGKILLed)
  cut_off         another such host's link is cut without killing anything: its lease expires,
                  the job recovers without it; then the link comes back, its agent kills the
                  workers it held (fenced) and joins again as a new host, and the job grows onto it
  coordinator_loss  the coordinator's host dies whole: the other agent takes over
Then the job is asked to stop (SIGINT to the submitter) and checked:
  per event   detection (the kill or cut to the coordinator's "is lost" line), the pause (the end
              of the last step before the event to the start of the first step after it, from the
              metrics' step times), the bytes moved within and between hosts and the minimum the
              placement allows between hosts (what new ranks need that no process on their host
              holds), and the steps lost;
  the same switch on one host: a reference `tessel train` on this host whose timeline replays
              the worker count of every step trains the same steps; its switch pauses are the
              one-host pauses, and its losses must equal the cluster's bit for bit (loss_matches);
  samples_exactly_once: the data-order log.
Human-readable lines first; the last line is one JSON object. Standard library only. Needs root
(network namespaces) and etcd (scripts/setup installs Debian's etcd-server).
"""
import argparse
import json
import os
import pathlib
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from plans import timeline_entry  # noqa: E402
from soak import JsonLines  # noqa: E402  (an append-only JSON-lines file read as it grows)

SEQ = 64
SMALL_MODEL = """model: {family: gpt2, n_layer: 4, n_embd: 128, n_head: 4, ffn_hidden: 512,
        vocab_size: 257, max_seq_len: 64}
"""
GPT2_MODEL = "model: {preset: gpt2-124m}\n"


def log(*a):
    print(*a, flush=True)


def ip(*args, check=True):
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


class Net:
    """Hosts as network namespaces joined by veth pairs to a bridge in a namespace of its own."""

    def __init__(self, hosts):
        self.prefix = f"tslb-{os.getpid()}"
        self.subnet = f"10.251.{os.getpid() % 250}"
        self.switch = f"{self.prefix}-sw"
        self.hosts = [f"{self.prefix}-h{i}" for i in range(hosts)]
        self.procs = []
        ip("netns", "add", self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.hosts):
            ip("netns", "add", ns)
            ip("-n", self.switch, "link", "add", f"h{i}", "type", "veth", "peer", "name", "eth0",
               "netns", ns)
            ip("-n", self.switch, "link", "set", f"h{i}", "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def address(self, host):
        return f"{self.subnet}.{host + 1}"

    def spawn(self, host, argv, log_path, env=None):
        out = open(log_path, "ab")
        p = subprocess.Popen(["ip", "netns", "exec", self.hosts[host], *argv], stdout=out,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env={**os.environ, **(env or {})}, start_new_session=True)
        self.procs.append(p)
        return p

    def pids(self, host):
        return [int(p) for p in ip("netns", "pids", self.hosts[host], check=False).split()]

    def link_down(self, host):
        # Detached from the bridge rather than set down: no carrier change, a plain partition.
        ip("-n", self.switch, "link", "set", f"h{host}", "nomaster")

    def link_up(self, host):
        ip("-n", self.switch, "link", "set", f"h{host}", "master", "br0")

    def kill_host(self, host):
        self.link_down(host)  # first: a machine that loses power sends no reset
        for _ in range(50):
            pids = self.pids(host)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)

    def close(self):
        for i in range(len(self.hosts)):
            try:
                self.kill_host(i)
            except Exception:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except Exception:
                pass
        for ns in self.hosts + [self.switch]:
            ip("netns", "del", ns, check=False)


def stamp_of(line):
    """The Unix time of an spdlog line "[YYYY-mm-dd HH:MM:SS.mmm] ..." (local time)."""
    m = re.match(r"(?:\[process \d+\] )?\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\.(\d{3})\]", line)
    if not m:
        return None
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000


class Scenario:
    def __init__(self, args):
        self.args = args
        self.work = pathlib.Path(args.work)
        self.net = None
        self.metrics = JsonLines(self.work / "metrics.jsonl")
        self.events = JsonLines(self.work / "events.jsonl")
        self.agents = {}
        self.timeline = []  # (what, unix time) of the scenario's actions
        # The cluster's secret: every agent and the submitter hold it (only its owner may read it).
        self.work.mkdir(parents=True, exist_ok=True)
        self.token = self.work / "cluster.token"
        self.token.write_text(secrets.token_hex(32) + "\n")
        self.token.chmod(0o600)

    def agent_log(self, host):
        return self.work / f"agent-h{host}.log"

    def start_agent(self, host):
        self.agents[host] = self.net.spawn(host, [
            self.args.tessel, "agent", "--store", self.etcd, "--iface", "eth0", "--slots", "1",
            "--name", f"h{host}", "--work-dir", str(self.work / f"work-h{host}"), "--lease-ttl",
            str(self.args.lease_ttl), "--token-file", str(self.token),
            # Each host's own disk for checkpoints (the namespaces share this machine's).
            "--checkpoint-dir", str(self.work / f"ck-h{host}")], self.agent_log(host),
            {"OMP_NUM_THREADS": "1"})

    def lines(self, host, pattern):
        path = self.agent_log(host)
        if not path.exists():
            return []
        return [l for l in path.read_text(errors="replace").splitlines() if re.search(pattern, l)]

    def coordinator(self):
        newest, host = -1, None
        for h in self.agents:
            for l in self.lines(h, r"coordinates job"):
                t = stamp_of(l)
                if t is not None and t > newest:
                    newest, host = t, h
        return host

    def wait(self, what, done, limit=600):
        deadline = time.time() + limit
        while time.time() < deadline:
            self.metrics.poll()
            self.events.poll()
            if done():
                return
            if self.train.poll() is not None:
                raise SystemExit(f"cluster: the job ended while waiting for {what} "
                                 f"(exit {self.train.returncode}); see {self.work}/train.out")
            time.sleep(0.02)
        raise SystemExit(f"cluster: waited {limit} s for {what}; see {self.work}")

    def steps(self):
        return len(self.metrics.lines)

    def wait_steps(self, n, what):
        start = self.steps()
        self.wait(f"{n} steps {what}", lambda: self.steps() >= start + n)

    def wait_event(self, kind, what):
        start = len(self.events.lines)
        self.wait(what, lambda: any(e["event"] == kind for _, e in self.events.lines[start:]))
        return [e for _, e in self.events.lines[start:] if e["event"] == kind][0]

    def detection(self, since):
        """The first "host ... is lost" line of any agent after `since`, less `since`."""
        times = [stamp_of(l) for h in self.agents for l in self.lines(h, r"is lost with")]
        times = [t for t in times if t is not None and t >= since - 0.5]
        return round(min(times) - since, 3) if times else None

    def config(self, name, control, timeline=None, stop_at=0):
        model = SMALL_MODEL if self.args.demo else GPT2_MODEL
        text = model + f"""data: {{path: {self.work}/data.tok, seq_len: {SEQ}, eval_fraction: 0.0, seed: 1}}
training: {{steps: 100000, stop_at: {stop_at}, global_batch: {self.args.batch}, seed: 1234, log_every: 1, threads: 1, huge_pages: {str(self.args.huge_pages).lower()}}}
optimizer: {{lr: 1.0e-4, warmup_steps: 2}}
parallel: {{dp: 2, micro_batch: {self.args.batch // 6}, timeout_s: 60}}
elastic: {{heartbeat_timeout_s: 2{control}}}
output: {{metrics: {self.work}/{name}metrics.jsonl, events: {self.work}/{name}events.jsonl, data_order: {self.work}/{name}order.jsonl}}
"""
        if timeline:
            text += "timeline:\n" + "".join(timeline_entry(s, p) for s, p in timeline)
        path = self.work / f"{name or 'cluster.'}yaml"
        path.write_text(text)
        return path

    def run(self):
        a = self.args
        texts = sorted(str(p) for p in pathlib.Path("/usr/share/common-licenses").iterdir()
                       if p.is_file())
        subprocess.run([a.tessel, "data", "prepare", "--force", "--input", *texts, "--output",
                        str(self.work / "data.tok")], check=True, capture_output=True)
        cfg = self.config("", "")
        self.net = Net(4)
        try:
            return self.scenario(cfg)
        finally:
            self.net.close()

    def scenario(self, cfg):
        a, net = self.args, self.net
        self.etcd = f"http://{net.address(0)}:2379"
        addr = net.address(0)
        # etcd at a higher priority: on a real cluster it runs on machines of its own, while here
        # it shares the two cores with every host's workers (a starved etcd expires leases).
        net.spawn(0, ["nice", "-n", "-10", "etcd", "--data-dir", str(self.work / "etcd"), "--listen-client-urls",
                      self.etcd, "--advertise-client-urls", self.etcd, "--listen-peer-urls",
                      f"http://{addr}:2380", "--initial-advertise-peer-urls", f"http://{addr}:2380",
                      "--initial-cluster", f"default=http://{addr}:2380",
                      # etcd raises every lease's TTL to 1.5 election timeouts, rounded up to whole
                      # seconds: 2 s with its default 1 s timeout, 1 s with this one.
                      "--election-timeout", "500", "--heartbeat-interval", "100"],
                     self.work / "etcd.log")
        time.sleep(1.5)
        for h in (1, 2):
            self.start_agent(h)
        time.sleep(1.0)
        self.train = net.spawn(0, [a.tessel, "train", str(cfg), "--cluster", self.etcd,
                                   "--token-file", str(self.token)],
                               self.work / "train.out")
        results = []

        def event(name, new_workers, t0, e, detect=None):
            r = {"event": name, "step": e["step"], "workers": new_workers,
                 "detect_s": detect, "pause_s": None, "bytes_within_hosts":
                 e.get("bytes_moved", 0) - e.get("bytes_cross_host", 0),
                 "bytes_between_hosts": e.get("bytes_cross_host", 0),
                 "bytes_between_hosts_min": e.get("bytes_cross_host_min"),
                 "steps_lost": e.get("steps_lost", 0), "cause": e.get("cause", ""),
                 "restored_from": e.get("restored_from", ""), "t0": t0}
            results.append(r)
            log(f"[cluster] {name}: step {e['step']}, {new_workers} workers"
                + (f", detected in {detect} s" if detect is not None else "")
                + f", {e.get('steps_lost', 0)} steps lost, {r['bytes_between_hosts'] / 1e6:.1f} MB "
                f"between hosts: {e.get('cause', '')[:120]}")

        self.wait_steps(a.steps_between, "on two hosts")
        t0 = time.time()
        self.start_agent(3)
        e = self.wait_event("reconfigure", "the switch onto a third host")
        event("join", e["new_workers"], t0, e)

        self.wait_steps(a.steps_between, "on three hosts")
        coord = self.coordinator()
        victim = 1 if coord != 1 else 2
        t0 = time.time()
        net.kill_host(victim)
        e = self.wait_event("recover", "the recovery from a killed host")
        event("host_loss", e["new_workers"], t0, e, self.detection(t0))

        self.wait_steps(a.steps_between, "after the host's loss")
        cut = [h for h in (1, 2, 3) if h not in (coord, victim)][0]
        joins = len(self.lines(cut, r"joined cluster"))
        t0 = time.time()
        net.link_down(cut)
        e = self.wait_event("recover", "the recovery from a cut-off host")
        event("cut_off", e["new_workers"], t0, e, self.detection(t0))
        net.link_up(cut)
        t0 = time.time()
        e = self.wait_event("reconfigure", "the job to grow onto the host that came back")
        self.wait("the host to join again", lambda: len(self.lines(cut, r"joined cluster")) > joins)
        event("rejoin", e["new_workers"], t0, e)

        self.wait_steps(a.steps_between, "on the hosts left")
        coord = self.coordinator()
        t0 = time.time()
        net.kill_host(coord)
        e = self.wait_event("recover", "the recovery from the coordinator's loss")
        event("coordinator_loss", e["new_workers"], t0, e, self.detection(t0))

        self.wait_steps(a.steps_between, "after the coordinator's loss")
        self.train.send_signal(signal.SIGINT)
        try:
            self.train.wait(timeout=300)
        except subprocess.TimeoutExpired:
            raise SystemExit("cluster: the job did not stop within 300 s of SIGINT")
        self.metrics.poll()
        self.events.poll()
        return results

    def pauses(self, metrics):
        """Per step s: the pause before it (its start minus the end of step s-1)."""
        by = {m["step"]: m for _, m in metrics}
        return {s: m["time"] - m["step_s"] - by[s - 1]["time"] for s, m in by.items()
                if s - 1 in by}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tessel", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--demo", action="store_true", help="a small model and a timeline for people")
    p.add_argument("--steps-between", type=int, default=4)
    p.add_argument("--batch", type=int, default=12)
    # training.huge_pages for both runs. Off by default: on a VM whose host backs guest memory
    # lazily (this one), first touching fresh huge pages costs seconds per GiB (bench/README.md,
    # elastic), which the README's advice for such machines avoids.
    p.add_argument("--huge-pages", action="store_true")
    # A host silent this long is lost (`tessel agent --lease-ttl`; its default is 2 s). etcd
    # checks leases every 0.5 s, so detection takes the ttl plus up to that.
    p.add_argument("--lease-ttl", type=float, default=1.0)
    args = p.parse_args()
    args.tessel = str(pathlib.Path(args.tessel).resolve())
    if os.geteuid() != 0:
        raise SystemExit("cluster: building hosts as network namespaces needs root")
    for tool in ("ip", "etcd"):
        if shutil.which(tool) is None:
            raise SystemExit(f"cluster: `{tool}` is not on PATH (run scripts/setup)")
    work = pathlib.Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    s = Scenario(args)
    results = s.run()
    log(f"[cluster] the job stopped (exit {s.train.returncode})")

    # The final history: the metrics' last record of each step, and the worker count each step
    # ran with (from the events: a switch at step s means steps after s ran on its new count).
    final = {}
    for _, m in s.metrics.lines:
        final[m["step"]] = m
    last = max(final)
    plans, plan = [], None
    changes = sorted((e["step"], e["old_plan"], e["new_plan"]) for _, e in s.events.lines)
    for step, old, new in changes:
        plan = plan or old
        if new != plan:
            plans.append((step, new))
            plan = new
    ref_cfg = s.config("reference.", ",\n  control_store: embedded", plans, stop_at=last)
    t = time.time()
    with open(work / "reference.log", "w") as out:
        rc = subprocess.run([args.tessel, "train", str(ref_cfg), "--nproc", "3"], cwd=work,
                            stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
    log(f"[cluster] reference run on one host: exit {rc}, {time.time() - t:.0f} s")
    ref = {}
    for line in (work / "reference.metrics.jsonl").read_text().splitlines():
        if line.strip():
            m = json.loads(line)
            ref[m["step"]] = m
    mismatched = [st for st, m in final.items() if st in ref and ref[st]["loss"] != m["loss"]]
    missing = [st for st in range(1, last + 1) if st not in final]
    loss_matches = rc == 0 and not mismatched and all(st in ref for st in final)

    # Data order: the newest generation's lines of every step cover its window exactly.
    by_step = {}
    for line in (work / "order.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            by_step.setdefault(r["step"], []).append(r)
    bad_order = []
    for st in range(1, last + 1):
        recs = by_step.get(st, [])
        if not recs:
            bad_order.append(st)
            continue
        g = max(r["generation"] for r in recs)
        at = (st - 1) * args.batch
        for lo, hi in sorted((r["first"], r["first"] + r["count"]) for r in recs
                             if r["generation"] == g):
            if lo != at:
                bad_order.append(st)
            at = hi
        if at != st * args.batch:
            bad_order.append(st)

    # Pauses: the cluster's around each event against the reference's at the same step.
    cl_pause = s.pauses(s.metrics.lines)
    ref_pause = s.pauses([(0, m) for m in ref.values()])
    for r in results:
        st = r["step"] + 1
        # After the detection: what the same switch costs once the job knows (the detection is
        # the lease's, reported on its own).
        r["pause_total_s"] = round(cl_pause.get(st, float("nan")), 3)
        r["pause_s"] = round(r["pause_total_s"] - (r["detect_s"] or 0), 3)
        r["one_host_pause_s"] = round(ref_pause.get(st, float("nan")), 3)
    log("")
    log("  pause: from the end of the last step before the event to the start of the first one"
        " after it, less the detection; 1-host: the same switch in a run on one host")
    log(f"  {'event':<17} {'step':>5} {'workers':>7} {'detect s':>8} {'pause s':>8} "
        f"{'1-host s':>8} {'MB within':>9} {'MB between':>10} {'min MB':>7} {'lost':>4}")
    for r in results:
        mn = r["bytes_between_hosts_min"]
        log(f"  {r['event']:<17} {r['step']:>5} {r['workers']:>7} "
            f"{r['detect_s'] if r['detect_s'] is not None else '-':>8} {r['pause_s']:>8} "
            f"{r['one_host_pause_s']:>8} {r['bytes_within_hosts'] / 1e6:>9.1f} "
            f"{r['bytes_between_hosts'] / 1e6:>10.1f} "
            f"{(mn / 1e6 if mn is not None else float('nan')):>7.1f} {r['steps_lost']:>4}")
    by = {r["event"]: r for r in results}
    over = [r["bytes_between_hosts"] / r["bytes_between_hosts_min"] for r in results
            if r["bytes_between_hosts_min"]]
    summary = {
        "hosts_max": 3,
        "events": len(results),
        "host_loss_detect_s": max(r["detect_s"] for r in results if r["detect_s"] is not None),
        "pause_join_s": by["join"]["pause_s"],
        "pause_host_loss_s": by["host_loss"]["pause_s"],
        "pause_coordinator_loss_s": by["coordinator_loss"]["pause_s"],
        "pause_over_one_host_max": round(max(r["pause_s"] / r["one_host_pause_s"]
                                             for r in results), 2),
        "steps_lost_max": max(r["steps_lost"] for r in results),
        "loss_matches": loss_matches,
        "samples_exactly_once": not bad_order and not missing,
        "bytes_between_hosts_over_min": round(max(over), 3) if over else None,
        "steps": last,
    }
    if mismatched:
        log(f"[cluster] losses differ from the reference at steps {mismatched[:10]}")
    if bad_order or missing:
        log(f"[cluster] data order wrong at steps {bad_order[:10]}, missing {missing[:10]}")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
