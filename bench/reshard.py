#!/usr/bin/env python3
"""Box copies, one build against another (scripts/bench reshard; standard library only).

Runs bench_reshard of this build and, when --baseline names another build's bench_reshard, that
one too, interleaved: `--rounds` rounds, each running both binaries (the order alternating between
rounds), each binary timing every case `--reps` times and reporting the median and the minimum.
A case's time is the median of the rounds' medians, and its best the minimum of all repetitions
(on a shared machine the best is the steadier estimate of what the code costs; the median shows
what it costs under the load of the moment). Prints one line per case (baseline and new, median
and best, and new / baseline of both) and, last, one JSON object: {"cases": {name: {"baseline_ms",
"new_ms", "ratio", "baseline_best_ms", "new_best_ms", "best_ratio"}}, "geomean_ratio",
"geomean_best_ratio", "rounds", "reps"} (without a baseline only the new side's fields). Every
binary's raw output goes to --out.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys


def run(binary, reps, extra, log):
    proc = subprocess.run([binary, "--reps", str(reps)] + extra, check=True, text=True,
                          stdout=subprocess.PIPE)
    with open(log, "w") as f:
        f.write(proc.stdout)
    return json.loads(proc.stdout.strip().splitlines()[-1])["cases"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", required=True, help="bench_reshard of this build")
    ap.add_argument("--baseline", default="", help="bench_reshard of the build to compare with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", required=True, help="directory for the raw outputs")
    ap.add_argument("extra", nargs="*", help="more bench_reshard arguments (e.g. --only store)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    sides = {"new": a.new}
    if a.baseline:
        sides["baseline"] = a.baseline
    times = {side: {} for side in sides}
    for r in range(a.rounds):
        order = list(sides) if r % 2 else list(reversed(list(sides)))
        for side in order:
            print(f"round {r + 1}/{a.rounds}: {side} ({sides[side]})", file=sys.stderr, flush=True)
            cases = run(sides[side], a.reps, a.extra, os.path.join(a.out, f"{side}-{r + 1}.txt"))
            for name, t in cases.items():
                times[side].setdefault(name, []).append((t["median_ms"], t["min_ms"]))
    names = list(times["new"])
    result = {"cases": {}, "rounds": a.rounds, "reps": a.reps}
    ratios, best_ratios = [], []
    width = max(len(n) for n in names)

    def summary(side, name):
        runs = times[side][name]
        return statistics.median(m for m, _ in runs), min(b for _, b in runs)

    if a.baseline:
        print(f"{'case':<{width}} {'median ms: base':>15} {'new':>9} {'new/base':>8}"
              f" {'best ms: base':>13} {'new':>9} {'new/base':>8}")
    for name in names:
        new, new_best = summary("new", name)
        entry = {"new_ms": round(new, 3), "new_best_ms": round(new_best, 3)}
        if a.baseline and name in times["baseline"]:
            base, base_best = summary("baseline", name)
            ratio = new / base if base > 0 else float("nan")
            best_ratio = new_best / base_best if base_best > 0 else float("nan")
            ratios.append(ratio)
            best_ratios.append(best_ratio)
            entry.update(baseline_ms=round(base, 3), ratio=round(ratio, 3),
                         baseline_best_ms=round(base_best, 3), best_ratio=round(best_ratio, 3))
            print(f"{name:<{width}} {base:>15.3f} {new:>9.3f} {ratio:>8.3f}"
                  f" {base_best:>13.3f} {new_best:>9.3f} {best_ratio:>8.3f}")
        else:
            print(f"{name:<{width}} {new:>12.3f} (best {new_best:.3f})")
        result["cases"][name] = entry

    def geomean(xs):
        xs = [x for x in xs if x > 0 and math.isfinite(x)]
        return round(math.exp(sum(math.log(x) for x in xs) / len(xs)), 3) if xs else None

    if ratios:
        result["geomean_ratio"] = geomean(ratios)
        result["geomean_best_ratio"] = geomean(best_ratios)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
