"""Projection vs measured full run, with the real stages: calibrate a sample, project, generate everything.

Builds a random Qwen3-shaped target (`dflash-pipeline tiny-model`, the project's tokenizer), writes SHARDS
ingested shards of demo conversations, tokenizes them, draws the calibration sample, calibrates (`generate`'s
backend and flags), projects the whole corpus with `plan`, then runs `generate` on every shard in one job and
prints the projected against the measured wall time (start-up included on both sides). Default sizes fit a GPU
(hf backend, bf16); `--small` runs in a minute on a CPU.

    PYTHONPATH=scripts python benchmarks/calibration_projection.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline.data.conversations import SAMPLE_SCHEMA, sample_id
from dflash_pipeline.demo.data import make_conversation


def cli(*args) -> str:
    proc = subprocess.run([sys.executable, "-m", "dflash_pipeline.cli", *map(str, args)], capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(f"{args[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def write_shards(root: Path, shards: int, per_shard: int) -> list[Path]:
    rng, paths = random.Random(0), []
    for k in range(shards):
        rows, seen = [], set()
        while len(rows) < per_shard:
            messages = [{"role": r, "content": t, "reasoning_content": None} for r, t in make_conversation(rng, 0.3)]
            sid = sample_id(messages)
            if sid not in seen:
                seen.add(sid)
                rows.append({"sample_id": sid, "source": "bench", "source_id": None, "messages": messages})
        path = root / "shards" / f"bench-{k:05d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA), path)
        paths.append(path)
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="CPU sizes")
    a = p.parse_args()
    size = (["--hidden-size", "128", "--num-layers", "8", "--intermediate-size", "384", "--num-heads", "4"] if a.small
            else ["--hidden-size", "2048", "--num-layers", "24", "--intermediate-size", "6144", "--num-heads", "16",
                  "--num-kv-heads", "8"])
    shards, per_shard, samples, new_tokens, batch = (4, 64, 32, 24, 16) if a.small else (8, 192, 256, 256, 64)
    root = Path(tempfile.mkdtemp(prefix="calib-bench-"))
    model = root / "model"
    cli("tiny-model", "--out", model, *size)
    paths = write_shards(root, shards, per_shard)
    tokens = [root / "tokens" / p.name for p in paths]
    for shard, tok in zip(paths, tokens):
        cli("tokenize", "--input", shard, "--model", model, "--out", tok, "--audit", tok.with_suffix(".audit.json"),
            "--max-length", 4096)
    cli("calibrate-sample", "--tokens", *tokens, "--shards", *paths, "--samples", samples, "--warmup", batch // 4,
        "--out", root / "sample.parquet")
    backend = ["--backend", "hf", "--model", model, "--device", a.device, "--batch-size", batch,
               "--dtype", "bfloat16" if a.device.startswith("cuda") else "float32", "--max-new-tokens", new_tokens,
               "--temperature", "0.8", "--progress-interval", "30"] + ([] if a.device.startswith("cuda") else
                                                                       ["--threads", "1"])  # shared CPUs
    out = cli("calibrate", "--input", root / "sample.parquet", "--out", root / "cal.json", "--gpus-per-job", 1,
              *backend)
    print("\n".join(line for line in out.splitlines() if line.startswith(("CALIBRATION", "  "))))
    cfg = {"generate": {"enabled": True, "max_new_tokens": new_tokens, "shards_per_job": shards, "gpus": 1},
           "tokenize": {"max_length": 4096}, "extract": {"codec": "zstd"}, "drafter": {"num_layers": 2}}
    cli("plan", "--tokens", *tokens, "--model", model, "--config", json.dumps(cfg), "--calibration", root / "cal.json",
        "--json", root / "plan.json")
    projected = json.loads((root / "plan.json").read_text())["generation"]
    outs = [root / "out" / p.name for p in paths]
    t0 = time.monotonic()
    cli("generate", "--input", *paths, "--out", *outs, *backend)
    process_s = time.monotonic() - t0
    summaries = [json.loads(o.with_suffix(".summary.json").read_text()) for o in outs]
    actual = max(s["this_run"]["wall_s"] for s in summaries)
    cal = json.loads((root / "cal.json").read_text())
    rows = [("samples (calibrated / corpus)", f"{samples} / {shards * per_shard}"),
            ("calibrated output tok/s", f"{cal['throughput']['output_tok_s']:,.0f}"
                                        + (" (steady state)" if cal["throughput"]["steady_state"] else " (lower bound)")),
            ("measured start-up s (calibration)", f"{cal['startup_s']:.1f}"),
            ("projected output tokens", f"{projected['expected_output_tokens']:,.0f}"),
            ("actual output tokens", f"{sum(s['completion_tokens'] for s in summaries):,}"),
            ("projected wall s", f"{projected['wall_hours'] * 3600:.1f}"),
            ("actual wall s (stage, start-up included)", f"{actual:.1f} (process {process_s:.1f})"),
            ("projected / actual", f"{projected['wall_hours'] * 3600 / actual:.3f}")]
    print("| measure | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()
