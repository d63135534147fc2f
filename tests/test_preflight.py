"""The preflight: a user's mistakes stop the run in seconds, before any job, one line each naming what and how to
fix it. The checks on their own (real model directories, the shipped profiles' files), then through the real
Snakefile: a dry run that fails at once, for each profile."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from conftest import REPO
from dflash_pipeline.generation.sglang_flags import version as sglang_version
from dflash_pipeline.planning import preflight
from dflash_pipeline.settings import SCHEMA_PATH
from workflow_runs import make_workdir, snakemake

GPU_CONFIG = {"generate": {"gpus": 8, "runtime_min": 720, "mem_mb": 64000}, "extract": {"gpus": 1, "runtime_min": 360,
              "mem_mb": 64000}, "train": {"gpus": 8, "runtime_min": 2880, "mem_mb": 128000},
              "evaluate": {"gpus": 1, "runtime_min": 120, "mem_mb": 64000}}


def _gpu_rules(config: dict) -> dict[str, dict]:
    """What Snakemake resolves for the GPU rules from the config (the rules' own resources)."""
    out = {}
    for rule, section in preflight.GPU_RULES.items():
        c = config[section]
        out[rule] = {"gpu": c["gpus"], "runtime": c["runtime_min"], "mem_mb": c["mem_mb"]}
    return out


def _profile(name: str) -> dict:
    return yaml.safe_load((REPO / "profiles" / name / "config.yaml").read_text())


@pytest.mark.parametrize("executor", ["local", "slurm", "kubernetes"])
def test_shipped_profiles_place_every_gpu_rule(executor):
    overrides = _profile(executor).get("set-resources") or {}
    rules = _gpu_rules(GPU_CONFIG)
    # every GPU rule on its rule's resources merged with the profile's, as Snakemake merges them
    merged = {r: {**res, **overrides.get(r, {})} for r, res in rules.items()}
    assert preflight.resource_problems(merged, overrides, GPU_CONFIG, executor) == []
    if executor == "slurm":
        for rule in preflight.GPU_RULES:
            assert merged[rule]["slurm_partition"] == "gpu", rule
            assert merged[rule].get("gpu_model") == (None if rule == "train" else "h100"), rule
    if executor == "kubernetes":
        assert all(merged[r]["gpu_manufacturer"] == "nvidia" for r in preflight.GPU_RULES)


def test_a_gpu_rule_without_placement_and_a_profile_overriding_the_config_are_named():
    overrides = {k: dict(v) for k, v in (_profile("slurm").get("set-resources") or {}).items()}
    del overrides["calibrate"]  # the profile of the issue: no calibrate entry
    overrides["generate"]["runtime"] = 1440  # ... and a runtime that silently won over generate.runtime_min 720
    rules = {r: {**res, **overrides.get(r, {})} for r, res in _gpu_rules(GPU_CONFIG).items()}
    problems = preflight.resource_problems(rules, overrides, GPU_CONFIG, "slurm", "profiles/slurm")
    assert len(problems) == 3, problems
    assert any("GPU rule calibrate has no slurm_partition" in p for p in problems), problems
    assert any("GPU rule calibrate has no gpu_model" in p for p in problems), problems
    assert any("generate: runtime=1440 overrides config generate.runtime_min=720" in p for p in problems), problems
    # the same with no GPUs (the demo on CPU): placement is not needed, the override still is an error
    cpu = {s: {**v, "gpus": 0} for s, v in GPU_CONFIG.items()}
    rules = {r: {**res, **overrides.get(r, {})} for r, res in _gpu_rules(cpu).items()}
    assert len(preflight.resource_problems(rules, overrides, cpu, "slurm")) == 1


def test_target_directory_checks(tmp_path, tiny_target):
    assert preflight.target_problems(str(tiny_target)) == []
    (missing,) = preflight.target_problems(str(tmp_path / "nope"))
    assert "no such directory" in missing and "target.model_path" in missing
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(tiny_target / "config.json", partial / "config.json")
    (line,) = preflight.target_problems(str(partial))
    assert "missing the weights (*.safetensors), the tokenizer (tokenizer.json" in line and "chat template" in line
    # the template may live in tokenizer_config.json instead of a file
    for name in ("model.safetensors", "tokenizer.json"):
        shutil.copy(tiny_target / name, partial / name)
    template = (tiny_target / "chat_template.jinja").read_text()
    (partial / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    assert preflight.target_problems(str(partial)) == []


def test_backend_inputs_and_misspelled_keys(tmp_path):
    sglang = {"enabled": True, "backend": "sglang", "sglang": {}}
    (line,) = preflight.backend_problems(sglang, sglang_version())  # sglang is not installed where tests run
    assert "sglang is not installed" in line and "pip install -e .[sglang]" in line
    assert preflight.backend_problems({**sglang, "sglang": {"launch_command": ["my-server"]}}, "0.5.23") == []
    assert preflight.backend_problems({**sglang, "backend": "hf"}, "0.5.23") == []
    here = tmp_path / "a.jsonl"
    here.write_text("")
    inputs = {"a": str(here), "b": "s3://bucket/b.jsonl", "demo": "data/demo/x.json"}
    assert preflight.input_problems(inputs, {"data/demo/x.json"}, None) == []
    (line,) = preflight.input_problems(inputs, {"data/demo/x.json"}, "s3 s3://bucket/run1")
    assert str(here) in line and "upload it" in line
    (line,) = preflight.input_problems({"c": str(tmp_path / "c.json")}, set(), None)
    assert "no such file" in line
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["trian"] = {}
    cfg["train"]["epocs"] = 2
    lines = preflight.schema_errors(cfg, SCHEMA_PATH)
    assert len(lines) == 2, lines
    assert "(top level)" in lines[0] and "'trian' was unexpected); did you mean 'trian' -> 'train'?" in lines[0], lines
    assert "(train)" in lines[1] and "'epocs' -> 'epochs'" in lines[1], lines


def test_executor_from_the_command_line_and_profile(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    assert preflight.executor_name(["-n", "--profile", "profiles/slurm"], {}) == "slurm"
    assert preflight.executor_name(["--profile=profiles/kubernetes"], {}) == "kubernetes"
    assert preflight.executor_name(["--profile", "profiles/slurm", "--executor", "local"], {}) == "local"
    assert preflight.executor_name([], {"SNAKEMAKE_PROFILE": "profiles/slurm"}) == "slurm"
    assert preflight.executor_name(["--cores", "2"], {}) == "local"


def _fails_at_once(proc) -> list[str]:
    """A dry run stopped by the preflight: its lines, and nothing ran or was planned."""
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "Job stats" not in out and "Traceback (most recent call last)" not in out, out[-3000:]
    return [line.strip() for line in out.splitlines() if line.strip().startswith("preflight: ")]


def test_snakemake_stops_before_any_job(tmp_path, tiny_target):
    """Through the real Snakefile: soft labels with the offline mode, a user's model directory without its
    tokenizer and a missing input, then sglang that is not installed (local profile); local inputs on Kubernetes;
    a SLURM profile without calibrate's placement."""
    work = make_workdir(tmp_path / "w")
    model = tmp_path / "model"
    shutil.copytree(tiny_target, model)
    (model / "tokenizer.json").unlink()
    user = {"demo": {"enabled": False}, "inputs": [str(tmp_path / "missing.jsonl")],
            "target": {"model_path": str(model)}, "generate": {"backend": "sglang", "gpus": 1},
            "train": {"labels": "distill"}}  # offline by default: soft labels need the target beside the drafter
    (work / "user.yaml").write_text(yaml.safe_dump(user))
    lines = _fails_at_once(snakemake(work, "-n", configfiles=("user.yaml",), check=False))
    train = [ln for ln in lines if "train.labels: distill" in ln]
    assert len(lines) == 3 and len(train) == 1 and "needs train.mode: online" in train[0], lines
    lines = [ln for ln in lines if ln not in train]
    assert f"{model}: missing the tokenizer (" in lines[0] and "chat template" not in lines[0], lines[0]
    assert "missing.jsonl: no such file" in lines[1]
    # fixed; sglang is checked when the DAG holds the first job that starts it (calibrate), before any job runs
    shutil.copy(tiny_target / "tokenizer.json", model / "tokenizer.json")
    (tmp_path / "missing.jsonl").write_text("")
    user["train"]["mode"] = "online"
    (work / "user.yaml").write_text(yaml.safe_dump(user))
    (line,) = _fails_at_once(snakemake(work, "-n", configfiles=("user.yaml",), check=False))
    assert "sglang is not installed" in line, line

    (tmp_path / "here.jsonl").write_text("")
    k8s = {"inputs": [str(tmp_path / "here.jsonl")], "generate": {"gpus": 1}}
    (work / "k8s.yaml").write_text(yaml.safe_dump(k8s))
    proc = snakemake(work, "-n", "--default-storage-prefix", "s3://bucket/run1", profile="profiles/kubernetes",
                     configfiles=("tiny.yaml", "k8s.yaml"), check=False)
    (line,) = _fails_at_once(proc)
    assert "here.jsonl is a local file" in line and "s3://bucket/run1" in line

    slurm = yaml.safe_load((work / "profiles/slurm/config.yaml").read_text())
    del slurm["set-resources"]["calibrate"]
    (work / "profiles/slurm/config.yaml").write_text(yaml.safe_dump(slurm))
    proc = snakemake(work, "-n", profile="profiles/slurm", configfiles=("tiny.yaml", "k8s.yaml"), check=False)
    assert _fails_at_once(proc) == [
        "preflight: executor slurm: GPU rule calibrate has no slurm_partition in set-resources: add `calibrate: "
        "{slurm_partition: ...}` there (as the shipped profile does for every GPU rule)",
        "preflight: executor slurm: GPU rule calibrate has no gpu_model in set-resources: add `calibrate: "
        "{gpu_model: ...}` there (as the shipped profile does for every GPU rule)"]
