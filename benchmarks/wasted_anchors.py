"""Blocks that train nothing: the fraction of sampled anchors whose block has no supervised label, under the
former anchor rule (loss_mask[p] = 1) and the current one (loss_mask[p] = loss_mask[p + 1] = 1).

A block anchored at p scores labels p + 1 .. p + bs - 1 where they are supervised; an anchor on a turn's last
supervised token (its next token is the template's newline or the next user turn) scores none. Anchors are
drawn uniformly among the candidates, at most `--num-anchors` per sequence, so the expected wasted blocks of
a sequence are min(N, candidates) x (wasted candidates / candidates). Read from token shards (Parquet,
`loss_mask` column), or with `--demo` from the demo data run through the real ingest and tokenize stages.

    PYTHONPATH=scripts python benchmarks/wasted_anchors.py results/tokens/<dataset>/*.parquet
    PYTHONPATH=scripts python benchmarks/wasted_anchors.py --demo
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from dflash_pipeline.drafter.batch import anchor_candidates


def wasted_blocks(loss_mask, num_anchors: int) -> dict:
    """Expected blocks and wasted blocks of one sequence under the former rule and the current one."""
    m = np.asarray(loss_mask) > 0
    former = np.flatnonzero(m[:-1])
    former_wasted = int((~m[1:][former]).sum()) if len(former) else 0
    blocks = min(num_anchors, len(former))
    current = anchor_candidates(m)
    current_wasted = int((~m[1:][current]).sum()) if len(current) else 0
    return {"former_blocks": blocks, "former_wasted": blocks * former_wasted / max(1, len(former)),
            "current_blocks": min(num_anchors, len(current)),
            "current_wasted": min(num_anchors, len(current)) * current_wasted / max(1, len(current))}


def shard_fractions(paths, num_anchors: int) -> dict:
    """Totals over token shards: sequences, blocks and the wasted fraction before/after."""
    tot = {"sequences": 0, "former_blocks": 0, "former_wasted": 0.0, "current_blocks": 0, "current_wasted": 0.0}
    for path in paths:
        for mask in pq.read_table(path, columns=["loss_mask"]).column("loss_mask").to_pylist():
            tot["sequences"] += 1
            for k, v in wasted_blocks(mask, num_anchors).items():
                tot[k] += v
    tot["former_fraction"] = tot["former_wasted"] / max(1, tot["former_blocks"])
    tot["current_fraction"] = tot["current_wasted"] / max(1, tot["current_blocks"])
    return tot


def demo_shards(work: Path) -> list[Path]:
    """The demo raw files through the real ingest and tokenize stages (tiny target's tokenizer and template)."""
    cli = [sys.executable, "-m", "dflash_pipeline.cli"]

    def run(*args):
        subprocess.run([*cli, *map(str, args)], check=True, capture_output=True)

    run("demo-data", "--out", work / "raw")
    run("tiny-model", "--out", work / "target", "--pretrain-steps", "0")
    shards = []
    for raw in sorted((work / "raw").iterdir()):
        rec, tok = work / f"{raw.name}.records.parquet", work / f"{raw.name}.tokens.parquet"
        run("ingest", "--input", raw, "--out", rec, "--stats", work / f"{raw.name}.stats.json",
            "--quarantine", work / f"{raw.name}.quarantine.jsonl")
        run("tokenize", "--input", rec, "--model", work / "target", "--out", tok, "--audit", work / f"{raw.name}.audit.json")
        shards.append(tok)
    return shards


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shards", nargs="*", help="token shards (Parquet with a loss_mask column)")
    p.add_argument("--demo", action="store_true", help="build the demo token shards and measure those")
    p.add_argument("--num-anchors", type=int, default=512)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = demo_shards(Path(tmp)) if args.demo else [Path(s) for s in args.shards]
        if not paths:
            p.error("give token shards or --demo")
        t = shard_fractions(paths, args.num_anchors)
    print(f"{t['sequences']} sequences, at most {args.num_anchors} anchors each")
    print(f"{'anchor rule':44s} {'blocks':>9s} {'wasted':>9s} {'fraction':>9s}")
    print(f"{'former: loss_mask[p]':44s} {t['former_blocks']:9d} {t['former_wasted']:9.1f} {t['former_fraction']:9.2%}")
    print(f"{'current: loss_mask[p] and loss_mask[p+1]':44s} {t['current_blocks']:9d} {t['current_wasted']:9.1f} "
          f"{t['current_fraction']:9.2%}")


if __name__ == "__main__":
    main()
