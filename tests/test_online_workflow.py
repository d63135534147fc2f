"""The workflow with online training (train.mode: online, the recipe at scale's mode): the real Snakefile on the
tiny demo config, local profile. No hidden states are extracted, and a change that reruns the plan reruns
exactly what it invalidates, in one invocation: every job after its dependencies."""

from __future__ import annotations

import json

import pytest
from rerun_scenarios import copy_run, ran
from workflow_runs import make_workdir, planned, snakemake

pytestmark = pytest.mark.slow

CONFIGS = ("tiny.yaml", "online.yaml")


@pytest.fixture(scope="module")
def online_run(tmp_path_factory, tiny_target):
    work = make_workdir(tmp_path_factory.mktemp("online") / "run", model=tiny_target)
    (work / "online.yaml").write_text("train:\n  mode: online\n")
    snakemake(work, "--cores", "2", configfiles=CONFIGS)
    return work


def test_online_training_runs_the_whole_workflow_without_hidden_states(online_run):
    assert not (online_run / "results/hidden").exists()
    summary = json.loads((online_run / "results/train/drafter/summary.json").read_text())
    assert summary["mode"] == "online" and summary["steps"] > 0, summary
    report = json.loads((online_run / "results/evaluate/report.json").read_text())
    assert report["passed"], report["reasons"]
    assert (online_run / "results/report/summary.html").exists()
    assert planned(snakemake(online_run, "-n", configfiles=CONFIGS)) == {}


def test_a_plan_rerun_with_the_same_plan_reruns_training_before_evaluation(online_run, tmp_path):
    """A new holdout fraction reruns the plan (its projection of evaluation reads it) and training (the held-out
    split), and in online mode the plan's numbers come out the same. Snakemake 9.27 then left the generation
    gate, which waits on the plan, pending for good: the evaluation ran on the old drafter before training, the
    report was never redrawn, and the next invocation trained (a fresh-clone run of config/smollm2-scale.yaml
    on CPU, reproduced here). The plan now stamps each plan.json it writes, so the gate always decides again."""
    work = copy_run(online_run, tmp_path / "run")
    (work / "holdout.yaml").write_text("evaluate:\n  holdout_fraction: 0.3\n")
    configs = (*CONFIGS, "holdout.yaml")
    proc = snakemake(work, "--cores", "2", configfiles=configs)
    assert ran(proc) == {"plan": 1, "generation_gate": 1, "train": 1, "export": 1, "evaluate": 1,
                         "evaluate_gate": 1, "run_report": 1, "all": 1}, ran(proc)
    out = proc.stdout + proc.stderr
    order = [out.index(f"rule {name}:") for name in ("train", "export", "evaluate")]
    assert order == sorted(order), order
    assert planned(snakemake(work, "-n", configfiles=configs)) == {}
