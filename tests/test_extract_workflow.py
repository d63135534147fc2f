"""The real Snakefile: the plan is printed, then one group's hidden states are extracted by one job."""

from __future__ import annotations

import json

import pytest

from dflash_pipeline.hidden_states.group_stats import read_shard_stats
from dflash_pipeline.hidden_states.reader import HiddenStateShardReader, shard_files
from dflash_pipeline.settings.job_groups import JobGroups
from workflow_runs import make_workdir, planned, snakemake

pytestmark = pytest.mark.slow

# no regeneration (fast), and the demo's placeholder answers let through the gate
EXTRA = """generate:
  enabled: false
ingest:
  shard_size: 16          # two shards per raw file: one extraction job of two shards
extract:
  shards_per_job: 2
audit:
  max_trivial_fraction: 1.0
  max_placeholder_fraction: 1.0
"""


def _snakemake(workdir, *targets):
    return snakemake(workdir, *targets, configfiles=("tiny.yaml", "extra.yaml"))


def test_plan_then_extract_one_shard(tiny_target, tmp_path):
    wd = make_workdir(tmp_path / "wf", model=tiny_target)
    (wd / "extra.yaml").write_text(EXTRA)

    proc = _snakemake(wd, "results/plan.txt")
    assert "PLAN (before any GPU work)" in proc.stdout + proc.stderr  # shown on the terminal
    plan = json.loads((wd / "results" / "plan.json").read_text())
    shard = json.loads((wd / "results" / "ingest" / "manifest.json").read_text())["shards"][0]["shard"]

    shards = [s["shard"] for s in json.loads((wd / "results" / "ingest" / "manifest.json").read_text())["shards"]
              if s["src"] == json.loads((wd / "results" / "ingest" / "manifest.json").read_text())["shards"][0]["src"]]
    assert len(shards) == 2 and shard in shards
    group = f"results/hidden/groups/{JobGroups('x', 2).of(shard)}"
    dry = planned(_snakemake(wd, "-n", group, f"{group}.stats.json"))
    # one job (one target load) for the group; the gate of the training data first
    assert dry == {"audit": 1, "gate": 1, "extract": 1}, dry
    _snakemake(wd, group)
    group_dir = wd / group
    assert sorted(p.name for p in group_dir.glob("*.dfhs")) == [f"{s}.dfhs" for s in shards]
    assert json.loads((group_dir / f"{shards[1]}.stats.json").read_text())["job"]["shards"] == 2
    # every shard's stats beside the directory (what the plan and the report read, never the states)
    rows = dict(read_shard_stats([wd / f"{group}.stats.json"]))
    assert list(rows) == shards and rows[shards[1]] == json.loads((group_dir / f"{shards[1]}.stats.json").read_text())
    assert planned(_snakemake(wd, "-n", group)) == {}
    # the trainer's input is the directory: its shards in shard order
    assert shard_files([group_dir]) == [str(group_dir / f"{s}.dfhs") for s in shards]
    r = HiddenStateShardReader(group_dir / f"{shard}.dfhs")
    assert r.metadata["target_layer_ids"] == plan["target_layer_ids"]
    assert r.metadata["hidden_size"] == 128 and len(r) > 0
    first = r.read(0)
    assert first["hidden"].shape == (len(first["input_ids"]), len(plan["target_layer_ids"]), 128)
    assert first["loss_mask"].sum() > 0
    stats = rows[shard]
    assert stats["samples"] == len(r) and stats["compression_vs_bf16"] < 0.8
    assert not list((wd / "results" / "hidden").glob("*.partial")) and not list(group_dir.parent.glob("*.partial"))
    assert not list((wd / "results" / "hidden").glob("*.dfhs"))  # nothing linked or copied out of the group
