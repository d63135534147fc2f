"""`dflash-pipeline hidden-verify SHARD...`: check hidden-state shards (footer, index, every record's sections
and checksum), optionally deleting the damaged ones so that `snakemake` redoes exactly those.

Only a failed check is damage. A shard that cannot be read at all (a missing file, no permission, too many open
files, a dead S3 endpoint) is an error: the command stops with it, and nothing is deleted, however many shards
it had found damaged before.
"""

from __future__ import annotations

import os

from dflash_pipeline import storage
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.hidden_states.layout import ShardFormatError
from dflash_pipeline.hidden_states.reader import HiddenStateShardReader


def verify_shard(path: str) -> str | None:
    """None if the shard is complete and every record checks out, else the reason it is damaged.
    Raises PipelineError when the shard cannot be read (which says nothing about its content)."""
    try:
        with HiddenStateShardReader(path, verify=True) as reader:
            reader.verify_all()
    except ShardFormatError as exc:
        return str(exc)
    except OSError as exc:
        raise PipelineError(f"hidden-verify: cannot read {path}: {exc}; nothing was deleted") from exc
    return None


def _delete(path: str) -> None:
    for p in (path, os.path.splitext(path)[0] + ".stats.json"):
        if os.path.exists(p):
            os.remove(p)
    print(f"deleted  {path}")


def add_arguments(p) -> None:
    p.add_argument("paths", nargs="+", help="hidden-state shards (.dfhs), local or s3://")
    p.add_argument("--delete-damaged", action="store_true",
                   help="delete damaged local shards (and their .stats.json) so that `snakemake` redoes exactly "
                        "those; only after every shard was checked, and never when one could not be read")


def run(args) -> int:
    damaged = []
    for path in args.paths:
        why = verify_shard(path)
        if why is None:
            print(f"ok       {path}")
        else:
            damaged.append(path)
            print(f"DAMAGED  {path}: {why}")
    if args.delete_damaged:
        for path in damaged:
            if not storage.is_s3(path):
                _delete(path)
    print(f"{len(args.paths) - len(damaged)} ok, {len(damaged)} damaged")
    return 1 if damaged else 0
