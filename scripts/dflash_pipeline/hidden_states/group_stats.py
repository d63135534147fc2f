"""An extraction group's stats in one small file beside its directory (`hidden/groups/{group}.stats.json`): what
the plan and the run report read about extraction, so that neither touches the hidden states themselves. On S3
storage a job that declared the group directory as an input would download every hidden state of the group; the
report and the plan run on the head node, so they read this file instead."""

from __future__ import annotations

import os
from pathlib import Path

from dflash_pipeline import storage
from dflash_pipeline.errors import PipelineError

KIND = "dflash-extraction-group-stats"


def write_group_stats(path: str, shard_stats: dict[str, dict]) -> None:
    """{shard name: that shard's stats} for one group, written whole (a reader never sees half of it)."""
    storage.write_json(path, {"kind": KIND, "shards": shard_stats})


def shard_name(stats_path: str) -> str:
    return Path(stats_path).name.removesuffix(".stats.json").removesuffix(".dfhs")


def read_shard_stats(paths) -> list[tuple[str, dict]]:
    """(shard, stats) for every shard the files hold, in shard order: a group's file holds its shards; a single
    shard's own `.stats.json` (extract --stats) is read as itself."""
    rows: list[tuple[str, dict]] = []
    for path in paths:
        data = storage.read_json(path)
        if isinstance(data, dict) and data.get("kind") == KIND:
            shards = data.get("shards")
            if not isinstance(shards, dict):
                raise PipelineError(f"{path}: an extraction group's stats without a 'shards' object")
            rows += list(shards.items())
        elif isinstance(data, dict):
            rows.append((shard_name(str(path)), data))
        else:
            raise PipelineError(f"{path}: extraction stats must be a JSON object, not {type(data).__name__}")
    return sorted(rows, key=lambda row: row[0])


def adopt_groups(groups_dir: str) -> list[str]:
    """Write the stats file of each complete extraction group that has none: groups extracted before the file
    existed (2026-12-08). Without it their extract job lacks an output and would extract them again on the
    GPU; with it, dated as the directory, Snakemake finds the job done. Made from the shards' own stats in the
    directory, only where every shard has them; local directories only (a `.partial` one is a job's, left
    alone). Returns the files written."""
    written: list[str] = []
    if "://" in groups_dir or not os.path.isdir(groups_dir):
        return written
    for entry in sorted(os.scandir(groups_dir), key=lambda e: e.name):
        out = entry.path + ".stats.json"
        if not entry.is_dir() or entry.name.endswith(".partial") or os.path.exists(out):
            continue
        shards = sorted(name.removesuffix(".dfhs") for name in os.listdir(entry.path) if name.endswith(".dfhs"))
        files = [os.path.join(entry.path, f"{shard}.stats.json") for shard in shards]
        if not shards or not all(os.path.isfile(f) for f in files):
            continue
        write_group_stats(out, {shard: storage.read_json(f) for shard, f in zip(shards, files)})
        mtime = entry.stat().st_mtime
        os.utime(out, (mtime, mtime))
        written.append(out)
    return written
