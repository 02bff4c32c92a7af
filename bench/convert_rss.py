#!/usr/bin/env python3
"""Peak memory of the checkpoint conversions on a model of real size.

Writes a llama2-7b-shaped tessel checkpoint from the deterministic initialiser (`tessel init`,
27 GB of f32), exports it to a sharded Hugging Face directory (`tessel convert --to hf`, bf16 by
default, 5 GB shards) and imports that back (`tessel convert --from hf`), and reports each
command's peak resident memory (the kernel's ru_maxrss of the child) against the size of one
shard plus one tensor: streaming keeps every step far below it. Needs about 41 GB of free disk
under --work (the source checkpoint is removed before the import writes its copy). The last line
is one JSON object.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time


def run(cmd):
    """Runs cmd; returns (seconds, peak RSS in MiB) of the child."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out}")
    print(out.strip().splitlines()[-1] if out.strip() else "")
    return seconds, usage.ru_maxrss / 1024.0


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tessel", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--shard-size", default="5GB")
    ap.add_argument("--keep", action="store_true", help="keep the files written")
    a = ap.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    ck, hf, back = (os.path.join(a.work, n) for n in ("ck", "hf", "back"))
    need = 45e9
    free = shutil.disk_usage(a.work).free
    if free < need:
        sys.exit(f"convert_rss: {free / 1e9:.0f} GB free under {a.work}; needs about {need / 1e9:.0f} GB")
    r = {"model": a.model, "dtype": a.dtype, "shard_size": a.shard_size}
    r["init_s"], r["init_peak_rss_mib"] = run([a.tessel, "init", "--model", a.model, ck])
    r["checkpoint_gb"] = round(dir_bytes(ck) / 1e9, 2)
    r["export_s"], r["export_peak_rss_mib"] = run(
        [a.tessel, "convert", "--to", "hf", "--dtype", a.dtype, "--shard-size", a.shard_size, ck, hf])
    shards = sorted(f for f in os.listdir(hf) if f.endswith(".safetensors"))
    r["shards"] = len(shards)
    r["largest_shard_mib"] = round(max(os.path.getsize(os.path.join(hf, f)) for f in shards) / 2**20)
    if not a.keep:
        shutil.rmtree(ck)
    r["import_s"], r["import_peak_rss_mib"] = run([a.tessel, "convert", "--from", "hf", hf, back])
    # The largest tensor (the embedding or head, [vocab, hidden]) in f32.
    cfg = json.load(open(os.path.join(hf, "config.json")))
    hidden = cfg.get("hidden_size", cfg.get("n_embd"))
    largest_tensor_mib = cfg["vocab_size"] * hidden * 4 / 2**20
    r["largest_tensor_f32_mib"] = round(largest_tensor_mib)
    bound = r["largest_shard_mib"] + largest_tensor_mib
    r["one_shard_plus_one_tensor_mib"] = round(bound)
    r["peak_over_bound"] = round(max(r["export_peak_rss_mib"], r["import_peak_rss_mib"]) / bound, 3)
    for k in list(r):
        if isinstance(r[k], float):
            r[k] = round(r[k], 1) if k != "peak_over_bound" else r[k]
    if not a.keep:
        shutil.rmtree(a.work, ignore_errors=True)
    print(json.dumps(r))


if __name__ == "__main__":
    main()
