"""An extraction group's stats file (hidden_states/group_stats.py): what the plan and the report read instead of
the hidden states, and the groups of an earlier version kept instead of extracted again."""

from __future__ import annotations

import json
import os

import pytest

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.hidden_states.group_stats import adopt_groups, read_shard_stats, write_group_stats


def _group(root, name, shards, stats=True):
    d = root / name
    d.mkdir(parents=True)
    for i, shard in enumerate(shards):
        (d / f"{shard}.dfhs").write_bytes(b"x")
        if stats:
            (d / f"{shard}.stats.json").write_text(json.dumps({"samples": i + 1, "tokens": 10 * (i + 1)}))
    return d


def test_group_files_and_single_shard_files_read_as_one_row_per_shard(tmp_path):
    write_group_stats(str(tmp_path / "b-x00000.stats.json"), {"b-00001": {"tokens": 2}, "b-00000": {"tokens": 1}})
    (tmp_path / "a-00000.stats.json").write_text(json.dumps({"tokens": 5}))
    rows = read_shard_stats([tmp_path / "b-x00000.stats.json", tmp_path / "a-00000.stats.json"])
    assert rows == [("a-00000", {"tokens": 5}), ("b-00000", {"tokens": 1}), ("b-00001", {"tokens": 2})]
    (tmp_path / "bad.stats.json").write_text("[1, 2]")
    with pytest.raises(PipelineError, match="bad.stats.json: extraction stats must be a JSON object"):
        read_shard_stats([tmp_path / "bad.stats.json"])


def test_complete_groups_of_an_earlier_version_get_their_stats_dated_as_the_directory(tmp_path):
    groups = tmp_path / "hidden" / "groups"
    old = _group(groups, "src-x00000", ["src-00000", "src-00001"])
    os.utime(old, (1_000_000, 1_000_000))
    _group(groups, "src-x00001.partial", ["src-00002"])          # a job's, still being written
    _group(groups, "src-x00002", ["src-00004"], stats=False)     # not every shard has its stats: left alone
    new = _group(groups, "src-x00003", ["src-00006"])
    write_group_stats(str(new) + ".stats.json", {"src-00006": {"samples": 9}})  # this version's: kept as it is

    assert adopt_groups(str(groups)) == [str(old) + ".stats.json"]
    rows = dict(read_shard_stats([str(old) + ".stats.json"]))
    assert rows == {"src-00000": {"samples": 1, "tokens": 10}, "src-00001": {"samples": 2, "tokens": 20}}
    assert os.stat(str(old) + ".stats.json").st_mtime == 1_000_000  # not newer than the job's other output
    assert not (groups / "src-x00001.partial.stats.json").exists() and not (groups / "src-x00002.stats.json").exists()
    assert dict(read_shard_stats([str(new) + ".stats.json"])) == {"src-00006": {"samples": 9}}
    assert adopt_groups(str(groups)) == []  # once
    assert adopt_groups(str(tmp_path / "none")) == [] and adopt_groups("s3://bucket/results/hidden/groups") == []
