"""`dflash-pipeline reset STAGE`: forget a stage's resume state, so that `snakemake --forcerun STAGE` redoes it.

`--forcerun` deletes the forced jobs' outputs and reruns them (and everything after them), but the resume state
that survives a failed job on purpose (generation journals, training checkpoints, extraction partials: README
"Resume") is not an output, so a forced job resumed from it and redid nothing. After a fix that must change the
results: `dflash-pipeline reset STAGE --yes`, then `snakemake --forcerun STAGE ...`. Outputs are left to
Snakemake: deleting them here would not redo a shard whose consumers are up to date.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from dflash_pipeline.errors import PipelineError

# per stage: its resume state under the results directory (globs), and the setting that mirrors it to S3
STAGE_STATE = {
    "generate": (["completions/journal"], "generate.journal_mirror"),
    "extract": (["hidden/*.partial", "hidden/*.journal", "hidden/groups/*.partial"], None),
    "train": (["train/checkpoints"], "train.checkpoint_mirror"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("stage", choices=sorted(STAGE_STATE), help="the stage whose resume state to delete")
    p.add_argument("--results", default="results", help="the run's results directory (config `results`)")
    p.add_argument("--yes", action="store_true", help="delete; without it, list what would be deleted")


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _delete(path: Path) -> None:
    """Delete a resume-state file or directory. A directory reached through a symbolic link (checkpoints on a
    larger disk) keeps its link and loses its contents: the next run writes there again."""
    if path.is_symlink() and path.is_dir():
        print(f"  ({path} links to {path.resolve()}: its contents are deleted, the link is kept)")
        for child in path.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        return
    shutil.rmtree(path) if path.is_dir() else path.unlink()


def run(args) -> int:
    globs, mirror = STAGE_STATE[args.stage]
    if str(args.results).startswith("s3://"):
        raise PipelineError(f"reset --results {args.results}: only a local results directory; on S3 delete "
                            f"{', '.join(globs)} under it (e.g. `aws s3 rm --recursive`)")
    results = Path(args.results)
    if not results.is_dir():
        raise PipelineError(f"reset --results {results}: no such directory (run from the workflow's directory)")
    found = [p for pattern in globs for p in sorted(results.glob(pattern))]
    for path in found:
        print(f"{'deleting' if args.yes else 'would delete'} {path} ({_size(path) / 1e6:,.1f} MB)")
        if args.yes:
            _delete(path)
    if mirror:
        print(f"(with {mirror} set, or results on S3, delete its {args.stage} prefix there too: a job resumes "
              "from it)")
    if not found:
        print(f"reset {args.stage}: no resume state under {results}")
    elif not args.yes:
        print(f"reset {args.stage}: nothing deleted; add --yes to delete the above")
    print(f"then redo it: snakemake --forcerun {args.stage} --profile ... --configfile ...")
    return 0
