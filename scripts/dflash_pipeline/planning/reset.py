"""`dflash-pipeline reset STAGE`: make the next `snakemake` redo a stage from scratch.

`snakemake --forcerun generate` deletes the outputs and reruns the jobs, but the resume state that survives a
failed job on purpose (generation journals, training checkpoints, extraction partials: README "Resume") is not an
output, so a forced job resumes from it and redoes nothing. After a fix that must change the results, reset the
stage: its outputs and its resume state are deleted, and the next run redoes it and everything downstream.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from dflash_pipeline.errors import PipelineError

# per stage: what it writes under the results directory, resume state included (globs)
STAGE_PATHS = {
    "generate": ["completions"],                                  # outputs, groups, journals
    "extract": ["hidden"],                                        # shards, stats, partials and their journals
    "train": ["train"],                                           # the drafter and its checkpoints
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("stage", choices=sorted(STAGE_PATHS), help="the stage to redo on the next run")
    p.add_argument("--results", default="results", help="the run's results directory (config `results`)")
    p.add_argument("--yes", action="store_true", help="delete; without it, list what would be deleted")


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run(args) -> int:
    if str(args.results).startswith("s3://"):
        raise PipelineError(f"reset --results {args.results}: only a local results directory; on S3 delete the "
                            f"prefixes {', '.join(STAGE_PATHS[args.stage])} under it (e.g. `aws s3 rm --recursive`)")
    results = Path(args.results)
    if not results.is_dir():
        raise PipelineError(f"reset --results {results}: no such directory (run from the workflow's directory)")
    found = [p for rel in STAGE_PATHS[args.stage] for p in sorted(results.glob(rel))]
    if not found:
        print(f"reset {args.stage}: nothing under {results} to delete; the next run does the stage from scratch")
        return 0
    for path in found:
        print(f"{'deleting' if args.yes else 'would delete'} {path} ({_size(path) / 1e6:,.1f} MB)")
        if args.yes:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    if not args.yes:
        print(f"reset {args.stage}: nothing deleted; add --yes to delete the above")
    else:
        print(f"reset {args.stage}: done; the next `snakemake` redoes {args.stage} and every stage after it")
    return 0
