"""How long `snakemake -n` takes to plan the whole workflow over a manifest of many shards.

A synthetic run directory: N raw files (tiny stand-ins), their ingest outputs and a shard manifest with
`--shards` entries, all older than nothing, so the checkpoint counts as done and Snakemake plans every
per-shard job (shard, tokenize, generate, tokenize, extract, ...) plus the aggregates. The figure to
beat: under 30 s on 2 cores for 1,000 shards.

    .venv/bin/python benchmarks/plan_1000_shards.py [--shards 1000] [--files 10] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def make_rundir(root: Path, n_shards: int, n_files: int, model: Path) -> None:
    for name in ("Snakefile", "rules", "config", "envs", "profiles"):
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, root / name)
        else:
            shutil.copy(src, root / name)
    raw = root / "raw"
    raw.mkdir()
    srcs = [f"part{i:03d}" for i in range(n_files)]
    for src in srcs:
        (raw / f"{src}.jsonl").write_text("")
    time.sleep(0.01)
    files = root / "results" / "ingest" / "files"
    files.mkdir(parents=True)
    per_file = -(-n_shards // n_files)
    shards, file_entries = [], []
    shard_size = 64
    for src in srcs:
        (files / f"{src}.parquet").write_bytes(b"")
        (files / f"{src}.quarantine.jsonl").write_text("")
        (files / f"{src}.stats.json").write_text(json.dumps({"file": f"raw/{src}.jsonl", "records_read": 0}))
        k_count = min(per_file, n_shards - len(shards))
        for k in range(k_count):
            shards.append({"shard": f"{src}-{k:05d}", "src": src, "rows": [k * shard_size, (k + 1) * shard_size],
                           "drop": [], "samples": shard_size})
        file_entries.append({"src": src, "file": f"raw/{src}.jsonl", "kept": k_count * shard_size, "shards": k_count})
    time.sleep(0.01)
    manifest = {"shard_size": shard_size, "totals": {"samples": len(shards) * shard_size}, "files": file_entries,
                "shards": shards, "duplicate_examples": []}
    (root / "results" / "ingest" / "manifest.json").write_text(json.dumps(manifest))
    (root / "bench.yaml").write_text(
        "demo: {enabled: false}\n"
        f"inputs: [{', '.join(f'raw/{s}.jsonl' for s in srcs)}]\n"
        f"target: {{model_path: {model}}}\n"
        f"ingest: {{shard_size: {shard_size}}}\n"
        "train: {mode: offline}\n"  # the largest DAG: extraction jobs per shard too
    )


def plan(root: Path, cores: int, extra=()) -> tuple[float, float, dict, str]:
    cmd = [str(BIN / "snakemake"), "-n", "--profile", "profiles/local", "--configfile", "bench.yaml",
           "--cores", str(cores), "--quiet", "rules", *extra]
    if shutil.which("taskset") and (os.cpu_count() or 1) > cores:
        cmd = ["taskset", "-c", f"0-{cores - 1}", *cmd]
    env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    t0 = time.perf_counter()
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(f"snakemake -n failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    out = proc.stdout + proc.stderr
    counts = {}
    for m in re.finditer(r"^(\w+)\s+(\d+)$", out, flags=re.M):
        counts[m.group(1)] = int(m.group(2))
    return seconds, cpu, counts, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--files", type=int, default=10)
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--keep", default=None, help="build the run directory here and keep it")
    args = ap.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="plan-bench-"))
    if root.exists() and any(root.iterdir()):
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 8, "hidden_size": 128}))
    try:
        make_rundir(root, args.shards, args.files, model)
        times, cpus = [], []
        counts: dict = {}
        for _ in range(args.repeat):
            seconds, cpu, counts, _out = plan(root, args.cores)
            times.append(seconds)
            cpus.append(cpu)
        load = os.getloadavg()[0]
        print(f"| shards | raw files | jobs planned | cores | wall s (best of {args.repeat}) | wall s (worst) | CPU s (best) | load avg |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        print(f"| {args.shards} | {args.files} | {counts.get('total', '?')} | {args.cores} | {min(times):.1f} | "
              f"{max(times):.1f} | {min(cpus):.1f} | {load:.1f} |")
        print()
        if load > args.cores:
            print(f"note: the machine was loaded (load {load:.1f} on {args.cores} cores): the wall time is inflated; "
                  "the CPU seconds of the planning process are what an idle 2-core machine would take")
        print("jobs per rule: " + ", ".join(f"{k} {v}" for k, v in counts.items() if k != "total"))
        best = min(min(times), min(cpus) if load > args.cores else min(times))
        verdict = "OK" if best < 30 else "TOO SLOW"
        print(f"target: < 30 s -> {verdict}")
        return 0 if best < 30 else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
