"""What rules/common.smk reads from the package, tested without a workflow: the config's paths
(settings/config_paths.py), the target as the jobs see it (settings/target_source.py), the demo's own paths
(demo/paths.py), job groups and the local rule that links a group's files out (settings/job_groups.py), the
calibration sample's shards, the jobs' environment and the preflight's entry points."""

from __future__ import annotations

import json
import os
import re
import subprocess
from types import SimpleNamespace


from dflash_pipeline.demo.paths import (TARGET_DIR, demo_builds_target, demo_data_files, demo_target_files,
                                        is_demo_path)
from dflash_pipeline.planning import preflight
from dflash_pipeline.planning.calibration_sample import settings_of, shards_to_draw
from dflash_pipeline.settings.config_paths import ConfigPaths, source_name
from dflash_pipeline.settings.job_groups import JobGroups, link_out
from dflash_pipeline.settings.target_source import BUILT, TargetSource
from test_rule_params import config as shipped_config


def _config(inputs, model_path="resources/demo-target", **sections) -> dict:
    return {"inputs": inputs, "target": {"model_path": model_path}, "ingest": sections.get("ingest", {}),
            "evaluate": sections.get("evaluate", {})}


# ------------------------------------------------------------------ config paths


def test_source_name_strips_data_suffixes_and_odd_characters():
    assert source_name("data/sharegpt_part1.json") == "sharegpt_part1"
    assert source_name("s3://bucket/x/my file.jsonl.zst") == "my_file"
    assert source_name("a/b.json.gz") == "b"
    assert source_name("dir/") == "dir"
    assert source_name("!!!.json") == "_"
    assert source_name(".json") == "input"


def test_inputs_expand_globs_with_unique_stable_names(tmp_path):
    for rel in ("a/chat.json", "b/chat.json", "b/other.jsonl"):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text("[]")
    paths = ConfigPaths(_config([str(tmp_path / "*/chat.json"), str(tmp_path / "b/other.jsonl"),
                                 "s3://bucket/raw/*.json"]))
    assert paths.raw_inputs == {"chat": str(tmp_path / "a/chat.json"), "chat_2": str(tmp_path / "b/chat.json"),
                                "other": str(tmp_path / "b/other.jsonl"), "_": "s3://bucket/raw/*.json"}
    assert paths.problems == []


def test_path_mistakes_are_collected_not_raised(tmp_path):
    paths = ConfigPaths(_config([str(tmp_path / "none-*.json"), "pkg://no_such_package_here/x.json"],
                                model_path="pkg://no_such_package_here/model.gguf",
                                evaluate={"prompts_file": "pkg://no_such_package_here/q.jsonl"}))
    assert paths.raw_inputs == {}
    assert paths.problems[0] == f"config inputs: glob {str(tmp_path / 'none-*.json')!r} matches no file"
    assert [p.split(":")[0] for p in paths.problems] == ["config inputs", "config inputs", "config evaluate.prompts_file",
                                                         "config target.model_path"]
    assert paths.eval_prompts is None and not paths.target_resolved
    assert paths.target_source == "pkg://no_such_package_here/model.gguf"


def test_evaluation_prompts_are_excluded_from_training(tmp_path):
    q = tmp_path / "question.jsonl"
    paths = ConfigPaths(_config([], evaluate={"prompts_file": str(q)}, ingest={"exclude_prompts": ["b.jsonl", str(q)]}))
    assert paths.eval_prompts == str(q)
    assert paths.exclude_prompts == sorted({"b.jsonl", str(q)})
    assert ConfigPaths(_config([])).exclude_prompts == [] and ConfigPaths(_config([])).eval_prompts is None


# ------------------------------------------------------------------ the demo's paths and the target


def test_demo_paths_are_the_demos_own_relative_paths_only():
    assert is_demo_path("data/demo/x.json", "data/demo") and is_demo_path("data/demo", "data/demo")
    assert not is_demo_path("/abs/data/demo/x.json", "data/demo")
    assert not is_demo_path("data/demo2/x.json", "data/demo")
    assert demo_data_files({"a": "data/demo/a.json", "b": "mine/b.json"}) == ["data/demo/a.json"]
    assert demo_target_files()[0] == os.path.join(TARGET_DIR, "config.json")  # jobs take the first's directory
    on = {"demo": {"enabled": True}, "target": {"model_path": TARGET_DIR}}
    assert demo_builds_target(on)
    assert not demo_builds_target({**on, "demo": {"enabled": False}})
    assert not demo_builds_target({**on, "target": {"model_path": "/models/qwen"}})


def test_target_source_built_imported_or_tracked(tmp_path):
    built = TargetSource(TARGET_DIR, True, built=True)
    assert built.files(["d/config.json"], ["i/config.json"]) == ["d/config.json"]
    assert built.model_dir(["/store/d/config.json"]) == "/store/d" and built.identity() == BUILT
    assert built.preflight_path() is None

    gguf = TargetSource(str(tmp_path / "model.Q8_0.gguf"), True, built=False)
    assert gguf.is_gguf and gguf.files(["d/config.json"], ["i/config.json"]) == ["i/config.json"]
    assert gguf.model_dir(["results/target/config.json"]) == "results/target" and gguf.identity() == BUILT

    user = tmp_path / "model"
    user.mkdir()
    (user / "config.json").write_text("{}")
    mine = TargetSource(str(user), True, built=False)
    assert mine.tracked and mine.files(["d"], ["i"]) == [] and mine.model_dir([]) == str(user)
    before, tokenizer = mine.identity(), mine.identity(weights=False)
    assert before != BUILT
    (user / "model.safetensors").write_bytes(b"x")  # new weights: the generating jobs rerun, tokenize does not
    assert mine.identity() != before and mine.identity(weights=False) == tokenizer
    (user / "config.json").write_text('{"a": 1}')
    assert mine.identity(weights=False) != tokenizer
    assert mine.preflight_path() == str(user)
    unresolved = TargetSource("pkg://nothing/m", False, built=False)
    assert not unresolved.tracked and unresolved.preflight_path() is None and unresolved.identity() == BUILT


# ------------------------------------------------------------------ job groups


def test_job_groups_take_consecutive_shards_of_one_file():
    groups = JobGroups("j", 2)
    shards = ["a-00000", "a-00001", "a-00002", "b-x-00000", "b-x-00001"]
    assert [groups.of(s) for s in shards] == ["a-j00000", "a-j00000", "a-j00001", "b-x-j00000", "b-x-j00000"]
    assert groups.members("a-j00000", shards) == ["a-00000", "a-00001"]
    assert groups.members("b-x-j00000", shards) == ["b-x-00000", "b-x-00001"]
    one = JobGroups("g", 1)  # a group of one
    assert [one.of(s) for s in shards[:3]] == ["a-g00000", "a-g00001", "a-g00002"]
    assert one.members("a-g00002", shards) == ["a-00002"]
    assert re.fullmatch(groups.pattern, "b-x-j00000") and not re.fullmatch(groups.pattern, "b-x-g00000")
    # a manifest that changes within an invocation (a shard added): the members follow it, not the last index
    assert groups.members("a-j00001", shards + ["a-00003"]) == ["a-00002", "a-00003"]
    assert groups.members("a-j00001", shards) == ["a-00002"] and groups.members("c-j00000", shards) == []
    got = groups.members("a-j00000", shards)
    got.append("mutated")  # a caller's list is its own
    assert groups.members("a-j00000", shards) == ["a-00000", "a-00001"]
    assert not re.fullmatch(groups.pattern, "a-00000")


def test_link_out_links_and_touches_each_file(tmp_path):
    group = tmp_path / "groups" / "a-j00000"
    group.mkdir(parents=True)
    for name in ("a-00000.parquet", "a-00000.audit.json"):
        (group / name).write_text(name)
        os.utime(group / name, (1_000_000, 1_000_000))
    stamp = group / ".snakemake_timestamp"
    stamp.write_text("")
    command = link_out((f"{group}/a-00000.parquet", f"{tmp_path}/a-00000.parquet"),
                       (f"{group}/a-00000.audit.json", f"{tmp_path}/a-00000.audit.json"))
    assert command.endswith(" > {log:q} 2>&1")
    subprocess.run(command.replace("{log:q}", str(tmp_path / "link.log")), shell=True, check=True)
    for name in ("a-00000.parquet", "a-00000.audit.json"):
        out = tmp_path / name
        assert out.read_text() == name
        assert out.stat().st_ino == (group / name).stat().st_ino  # a link: no copy
        # newer than the group's timestamp: Snakemake must not take the linked file for out of date
        assert out.stat().st_mtime >= stamp.stat().st_mtime
    failing = link_out((f"{group}/missing.parquet", f"{tmp_path}/missing.parquet"))
    proc = subprocess.run(failing.replace("{log:q}", str(tmp_path / "fail.log")), shell=True)
    assert proc.returncode != 0 and not (tmp_path / "missing.parquet").exists()


# ------------------------------------------------------------------ calibration sample, environment, preflight


def test_calibration_sample_keeps_its_shards_while_they_hold():
    settings = {"samples": 8, "warmup_requests": 2, "seed": 1}
    drawn = {"shards": ["a-00000"], "settings": settings, "full": True}
    assert shards_to_draw(drawn, settings, ["a-00000", "b-00000"]) == ["a-00000"]  # added data: the same sample
    assert shards_to_draw(drawn, {**settings, "seed": 2}, ["a-00000", "b-00000"]) == ["a-00000", "b-00000"]
    assert shards_to_draw({**drawn, "full": False}, settings, ["a-00000", "b-00000"]) == ["a-00000", "b-00000"]
    assert shards_to_draw(drawn, settings, ["b-00000"]) == ["b-00000"]  # its shard is gone
    assert shards_to_draw(None, settings, ["b-00000"]) == ["b-00000"]
    assert settings_of({"calibrate": {**settings, "other": 1}}) == settings


def test_job_environment_carries_the_runtime_settings():
    from dflash_pipeline.settings.rule_params import RuleParams

    cfg = shipped_config("config.yaml", generate={"max_retries": 7, "max_wall_hours": 3.5},
                         train={"cpu_threads": 3})
    params = RuleParams(cfg, "results")
    env = params.job_environment()
    assert json.loads(env["DFLASH_GENERATE_RUNTIME"])["max_retries"] == 7
    assert json.loads(env["DFLASH_TRAIN_RUNTIME"]) == {"cpu_threads": 3}
    assert env["DFLASH_RATES_TRAIN_SETTINGS"] == params.train()
    assert set(env) == {"DFLASH_GENERATE_RUNTIME", "DFLASH_TRAIN_RUNTIME", "DFLASH_EVALUATE_RUNTIME",
                        "DFLASH_RATES_TRAIN_SETTINGS"}
    assert params.generation_limits() == "--max-wall-hours 3.5"


def test_preflight_entry_points():
    remote = SimpleNamespace(remote_exec=True, subprocess_exec=False)
    assert preflight.before_first_job(remote, {}, path_problems=["config inputs: x"]) == []  # checked at submission
    sglang = {"enabled": True, "backend": "sglang"}
    assert preflight.generation_backend_problems(sglang, ["--executor", "kubernetes"], {}, "0.5.23") == []
    assert preflight.generation_backend_problems(sglang, [], {}, "0.5.23") == \
        preflight.backend_problems(sglang, "0.5.23")
    assert preflight.stop_message(["a", "b"]) == "preflight: a\npreflight: b"


def test_shipped_config_paths_resolve():
    """The default config's inputs are the demo's: they name no mistake, and the demo builds them."""
    paths = ConfigPaths(shipped_config("config.yaml"))
    assert paths.problems == [] and demo_data_files(paths.raw_inputs) == list(paths.raw_inputs.values())
