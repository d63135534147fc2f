"""What the held-out acceptance measurement costs a training run, on CPU: the same run (tiny demo target,
online features, 2-layer drafter) with `--acceptance-every` N and with it off, alternated, wall time compared.

    PYTHONPATH=scripts python benchmarks/acceptance_overhead.py [--steps 60] [--every 50] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from dflash_pipeline.cli import main as cli


def write_tokens(path: Path, n: int, length: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, 1000, length).astype(np.int32).tolist() for _ in range(n)]
    pq.write_table(pa.table({"sample_id": [f"o{seed}-{i}" for i in range(n)], "input_ids": ids,
                             "loss_mask": [[0] * (length // 4) + [1] * (length - length // 4)] * n},
                            schema=pa.schema([("sample_id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                                              ("loss_mask", pa.list_(pa.int8()))])), path)


def train(work: Path, shards, steps: int, every: int, tag: str) -> float:
    out = work / f"run-{tag}"
    args = ["train", "--mode", "online", "--inputs", *map(str, shards), "--model", str(work / "target"),
            "--out", str(out), "--checkpoint-dir", str(work / f"ck-{tag}"), "--num-layers", "2", "--block-size", "16",
            "--num-anchors", "64", "--batch-size", "2", "--max-steps", str(steps), "--log-every", "10",
            "--checkpoint-every", "100000", "--holdout-fraction", "0.1", "--max-length", "256",
            "--acceptance-every", str(every)]
    t = time.perf_counter()
    assert cli(args) == 0
    wall = time.perf_counter() - t
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return wall, [r["heldout_tau"] for r in recs if "heldout_tau" in r]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=50, help="the default of train.acceptance_every")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        assert cli(["tiny-model", "--out", str(work / "target"), "--pretrain-steps", "0"]) == 0
        shards = [work / f"t{s}.parquet" for s in range(2)]
        for s, path in enumerate(shards):
            write_tokens(path, 160, 256, s)
        walls = {"off": [], "on": []}
        taus = []
        for r in range(args.repeats):
            for mode, every in (("off", 0), ("on", args.every)):
                wall, tau = train(work, shards, args.steps, every, f"{mode}{r}")
                walls[mode].append(wall)
                taus = tau or taus
    off, on = min(walls["off"]), min(walls["on"])
    print(f"{args.steps} steps, batch 2 x 256 tokens, 64 anchors, held-out acceptance every {args.every} steps "
          f"and at the end ({len(taus)} measurements of 32 samples x 32 anchors); best of {args.repeats}")
    print(f"{'acceptance':12s} {'wall s':>8s}")
    print(f"{'off':12s} {off:8.2f}")
    print(f"{'on':12s} {on:8.2f}")
    print(f"overhead: {on / off:.3f}x  (held-out tau measured: {', '.join(f'{t:.2f}' for t in taus)})")


if __name__ == "__main__":
    main()
