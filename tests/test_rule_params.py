"""Every rule's settings (dflash_pipeline/settings/rule_params.py), from the shipped configs: each stage accepts
what its rule passes, resources and runtime knobs stay out of the params, and outputs on S3 mirror the resume
state beside them."""

from __future__ import annotations

import argparse
import importlib
import json

import pytest
import yaml
from snakemake.utils import validate

from conftest import REPO
from dflash_pipeline import cli, settings
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.settings.rule_params import RESOURCE_KEYS, RuleParams


def config(*names: str, **sections) -> dict:
    cfg: dict = {}

    def merge(a, b):
        for k, v in b.items():
            a[k] = merge(a.get(k) or {}, v) if isinstance(v, dict) else v
        return a

    for name in names:
        merge(cfg, yaml.safe_load((REPO / "config" / name).read_text()))
    merge(cfg, sections)
    validate(cfg, str(settings.SCHEMA_PATH))  # fills in the schema's defaults, as the workflow does
    return cfg


def accepts(stage: str, settings_json: str, runtime: dict | None = None) -> None:
    spec = cli.STAGES[stage]
    parser = argparse.ArgumentParser()
    getattr(importlib.import_module(spec.module), spec.add_arguments)(parser)
    cli.apply_settings(parser, stage, settings_json, json.dumps(runtime) if runtime is not None else None)


@pytest.mark.parametrize("names", [("config.yaml",), ("config.yaml", "qwen3-8b.example.yaml"),
                                   ("config.yaml", "smollm2-real.yaml"),
                                   ("config.yaml", "smollm2-real.yaml", "smollm2-scale.yaml")])
def test_each_stage_accepts_what_its_rule_passes(names):
    params = RuleParams(config(*names, target={"trust_remote_code": True}), "results")
    accepts("generate", params.generate(), params.generate_runtime())
    accepts("calibrate", params.generate(), params.generate_runtime())
    accepts("extract", params.extract())
    for dataset in ("source", "regenerated"):
        accepts("tokenize", params.tokenize(dataset))
    accepts("train", params.train(), params.runtime("train"))
    accepts("evaluate", params.stage("evaluate", drop=("prompts_file",), **params.trust), params.runtime("evaluate"))
    for built in (params.generate(), params.extract(), params.train()):
        assert not RESOURCE_KEYS & set(json.loads(built)) and json.loads(built)["trust_remote_code"] is True
    assert "cpu_threads" not in json.loads(params.train())  # how it runs: the runtime settings carry it
    assert set(json.loads(params.rates())) == {"extract", "shards_per_job", "train", "tokens", "train_steps"}
    plan = json.loads(params.plan())
    assert set(plan) == {"generate", "tokenize", "extract", "drafter", "train", "cost", "evaluate"}
    assert "batch_size" not in plan["evaluate"]  # runtime-only: it reaches the plan through the environment


def test_outputs_on_s3_mirror_journals_and_checkpoints_beside_them():
    cfg = config("config.yaml")
    assert RuleParams(cfg, "results").generate_runtime()["journal_mirror"] == ""
    params = RuleParams(cfg, "results", "s3://bucket/run/")
    assert params.generate_runtime()["journal_mirror"] == "s3://bucket/run/results/completions/journal"
    assert json.loads(params.train())["checkpoint_mirror"] == "s3://bucket/run/results/train/checkpoints"
    cfg["train"]["checkpoint_mirror"] = "s3://elsewhere/ckpt"
    assert json.loads(RuleParams(cfg, "results", "s3://b/r").train())["checkpoint_mirror"] == "s3://elsewhere/ckpt"


def test_a_backend_without_what_it_needs_is_one_line():
    with pytest.raises(PipelineError, match="generate.servers lists no endpoint"):
        RuleParams(config("config.yaml", generate={"backend": "servers"}), "results").generate()
    with pytest.raises(PipelineError, match="generate.gpus is 0"):
        RuleParams(config("config.yaml", generate={"backend": "sglang", "gpus": 0}), "results").generate()


def test_turn_samples_reaches_only_the_regenerated_tokenize_and_only_when_set():
    """The default leaves every tokenize param as it was (no rerun after an upgrade); `every` changes the
    regenerated dataset's params only, and only with `generate.turns: all`."""
    default = RuleParams(config("config.yaml", generate={"turns": "all"}), "results")
    every = RuleParams(config("config.yaml", generate={"turns": "all"}, tokenize={"turn_samples": "every"}),
                       "results")
    first = RuleParams(config("config.yaml", generate={"turns": "first"}, tokenize={"turn_samples": "every"}),
                       "results")
    assert "turn_samples" not in json.loads(default.tokenize("regenerated"))
    assert default.tokenize("source") == every.tokenize("source") == default.tokenize("regenerated") == \
        first.tokenize("regenerated")  # one generated turn a conversation: the same samples either way
    assert json.loads(every.tokenize("regenerated"))["turn_samples"] == "every"
    accepts("tokenize", every.tokenize("regenerated"))


def test_max_turns_is_a_generate_param_only_when_it_cuts():
    """`generate.max_turns` reaches generate's (and calibrate's) settings with `turns: all` and a limit set; at its
    default, or with `turns: first`, the params stay as they were."""
    base = json.loads(RuleParams(config("config.yaml", generate={"turns": "all"}), "results").generate())
    first = json.loads(RuleParams(config("config.yaml", generate={"max_turns": 3}), "results").generate())
    capped = RuleParams(config("config.yaml", generate={"turns": "all", "max_turns": 3}), "results")
    assert "max_turns" not in base and "max_turns" not in first
    assert json.loads(capped.generate())["max_turns"] == 3
    accepts("generate", capped.generate(), capped.generate_runtime())


@pytest.mark.parametrize("key,value", [("layer_init", "target-last"), ("loss_normalization", "samples")])
def test_train_settings_added_later_are_params_only_when_set(key, value):
    """`train.layer_init`, `train.loss_normalization` (added after runs existed): at their default the train params
    stay as they were, so an upgrade retrains nothing (set to the default explicitly, too); set, they reach the
    train stage."""
    base = json.loads(RuleParams(config("config.yaml"), "results").train())
    explicit = RuleParams(config("config.yaml", train={key: settings.default(f"train.{key}")}), "results")
    other = RuleParams(config("config.yaml", train={key: value}), "results")
    assert key not in base and json.loads(explicit.train()) == base
    assert json.loads(other.train())[key] == value
    accepts("train", other.train())
    # the checkpoint fingerprint alike: a run from before the key existed resumes; one set away from it does not
    from types import SimpleNamespace

    from dflash_pipeline.drafter.train import recipe_settings
    defaults = settings.defaults("train")
    assert key not in recipe_settings(SimpleNamespace(**defaults))
    assert recipe_settings(SimpleNamespace(**{**defaults, key: value}))[key] == value
