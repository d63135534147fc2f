"""`dflash-pipeline evaluate-gate`: pass or fail the run on the evaluation report that `evaluate` wrote.

Reads JSON only: a module of its own so that the gate job does not import torch (seconds of start-up per run)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash_pipeline import storage
from dflash_pipeline.errors import PipelineError


def add_evaluate_gate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report", required=True)
    p.add_argument("--out", required=True, help="marker file written when the gate passes")


def run_evaluate_gate(args) -> int:
    report = json.loads(Path(args.report).read_text())
    tr, un = report["trained"]["tau"], report["untrained"]["tau"]
    if not report["passed"]:
        raise PipelineError("evaluation gate failed: " + "; ".join(report["reasons"]))
    with storage.atomic_open(args.out, "w") as fh:
        fh.write(f"tau trained {tr:.3f} vs untrained {un:.3f}; lossless\n")
    print(f"evaluation gate passed: tau trained {tr:.3f} vs untrained {un:.3f}")
    return 0
