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
from dflash_pipeline.hidden_states.group_stats import KIND as GROUP_STATS_KIND
from dflash_pipeline.hidden_states.layout import ShardFormatError
from dflash_pipeline.hidden_states.reader import HiddenStateShardReader, shard_files


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


def _group_stats(path: str) -> str | None:
    """The stats file of the extraction group whose directory holds `path` (the extract job's second output),
    or None for a shard outside one."""
    candidate = os.path.dirname(os.path.abspath(path)) + ".stats.json"
    try:
        return candidate if storage.read_json(candidate).get("kind") == GROUP_STATS_KIND else None
    except (OSError, ValueError, AttributeError):
        return None


def _delete(path: str) -> None:
    # a shard in a group directory: the group's stats go too, so that the group's job is missing an output and
    # `snakemake` redoes that group (the directory itself is the job's output, whole or not at all)
    for p in (path, os.path.splitext(path)[0] + ".stats.json", _group_stats(path)):
        if p and os.path.exists(p):
            os.remove(p)
    print(f"deleted  {path}")


def add_arguments(p) -> None:
    p.add_argument("paths", nargs="+",
                   help="hidden-state shards (.dfhs), local or s3://, or extraction group directories (their shards)")
    p.add_argument("--delete-damaged", action="store_true",
                   help="delete damaged local shards (and their .stats.json; in a group directory the group's "
                        "stats) so that `snakemake` redoes exactly those groups; only after every shard was checked, "
                        "and never when one could not be read")


def run(args) -> int:
    damaged = []
    paths = shard_files(args.paths)
    for path in paths:
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
    print(f"{len(paths) - len(damaged)} ok, {len(damaged)} damaged")
    return 1 if damaged else 0
