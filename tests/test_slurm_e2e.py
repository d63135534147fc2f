"""The demo pipeline through profiles/slurm on a real single-node SLURM (slurmctld + slurmd + munge), GPU
rules scheduled through the GPU GRES (fake devices: the stages run on CPU).

`.ci/run` installs and starts the cluster (.ci/slurm.sh). Elsewhere this test starts it itself when it is
installed and it runs as root, and skips when it cannot; with CI=true it fails instead of skipping.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from conftest import REPO
from workflow_runs import make_workdir, planned, snakemake, workflow_env

pytestmark = pytest.mark.slow

SLURM_SH = REPO / ".ci" / "slurm.sh"


def _slurm_up() -> bool:
    return subprocess.run([str(SLURM_SH), "status"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def slurm_cluster():
    started_here = False
    reason = None
    if not _slurm_up():
        if not shutil.which("slurmctld") or not shutil.which("munged"):
            reason = "SLURM is not installed (run `.ci/slurm.sh install` as root, or `.ci/run`)"
        elif os.geteuid() != 0:
            reason = "SLURM is not running and starting it needs root (`sudo .ci/slurm.sh start`)"
        else:
            proc = subprocess.run([str(SLURM_SH), "start"], capture_output=True, text=True)
            if proc.returncode == 0 and _slurm_up():
                started_here = True
            else:
                reason = f"SLURM could not be started: {proc.stderr[-2000:]}"
    if reason:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI needs a SLURM cluster: {reason}")
        pytest.skip(reason)
    yield
    if started_here:
        subprocess.run([str(SLURM_SH), "stop"], capture_output=True)


def _slurm_jobs() -> dict[str, dict[str, str]]:
    """Every job slurmctld still knows (MinJobAge=300 keeps finished ones), as `scontrol show job` fields."""
    out = subprocess.run(["scontrol", "show", "job", "-o"], capture_output=True, text=True).stdout
    jobs = {}
    for line in out.splitlines():
        fields = dict(tok.partition("=")[::2] for tok in line.split() if "=" in tok)
        if "JobId" in fields:
            jobs[fields["JobId"]] = fields
    return jobs


def _jobs_by_rule(jobs: dict[str, dict[str, str]]) -> dict[str, list[dict[str, str]]]:
    """The jobs Snakemake submitted, by rule (the executor puts `rule_RULE_wildcards_...` in the job's comment)."""
    by_rule: dict[str, list[dict[str, str]]] = {}
    for job in jobs.values():
        comment = job.get("Comment", "")
        if comment.startswith("rule_"):
            by_rule.setdefault(comment.removeprefix("rule_").split("_wildcards")[0], []).append(job)
    return by_rule


@pytest.mark.timeout(1200)
def test_pipeline_through_slurm_profile(slurm_cluster, tmp_path, tiny_target):
    workdir = make_workdir(tmp_path / "run", model=tiny_target)
    shutil.copy(REPO / "tests/configs/slurm.yaml", workdir / "slurm.yaml")
    configs = ("tiny.yaml", "slurm.yaml")
    # The executor sees a job end at its status checks, 1, 12, 33, 64 s after the submission (it backs off by 10 s
    # while no job ended), and each job pays a Snakemake start-up inside it: a SLURM job costs 33-64 s here
    # whatever its stage. So the test submits fewer: the demo's raw file (what the demo_data rule writes: the
    # tiny target is already in place the same way) is made by the local profile first. The jobs that link a
    # group's shards out (shard_from_group, tokens_from_group, completions_from_group) are
    # local rules: they run here, beside Snakemake, and never queue.
    snakemake(workdir, "data/demo/sharegpt_part2.jsonl.gz", "--cores", "1", configfiles=configs)
    before = set(_slurm_jobs())
    t0 = time.monotonic()
    snakemake(
        workdir,
        "--slurm-no-account",                              # no accounting database on the test cluster
        "--slurm-status-command", "squeue",                # ... so jobs are tracked with squeue
        # the plugin checks after this many seconds, then 10 s later than the last time while no job ended:
        # from 1, a job of 12-33 s (most here: a Snakemake start-up plus the stage) was seen at 33 s; from 20, at 20
        "--slurm-init-seconds-before-status-checks", "1",  # the poll waits this long after each finished job
        "--max-status-checks-per-second", "1", "--latency-wait", "10", "--jobs", "6",
        profile="profiles/slurm", configfiles=configs, env=workflow_env(), timeout=1100,
    )
    elapsed = time.monotonic() - t0
    # the pipeline's outputs are there, and a rerun has nothing to do
    for rel in ("results/ingest/manifest.json", "results/audit/source/gate.ok", "results/audit/regenerated/gate.ok",
                "results/evaluate/report.json", "results/evaluate/gate.ok", "results/drafter/config.json"):
        assert (workdir / rel).exists(), rel
    assert planned(snakemake(workdir, "-n", profile="profiles/slurm", configfiles=configs)) == {}
    # every job went through SLURM; GPU rules to the gpu partition with a GPU of the profile's model
    jobs = _jobs_by_rule({k: v for k, v in _slurm_jobs().items() if k not in before})
    assert {"ingest", "manifest", "shard", "tokenize", "audit", "calibrate", "generate", "extract", "train",
            "evaluate"} <= set(jobs), sorted(jobs)
    assert "demo_data" not in jobs and "tiny_target" not in jobs  # made before (above)
    linked = {"shard_from_group", "tokens_from_group", "completions_from_group"}
    assert not linked & set(jobs), sorted(jobs)  # local rules: never submitted
    assert len(jobs["tokenize"]) == len(jobs["audit"]) == 2  # the source dataset and the regenerated one
    for rule in ("calibrate", "generate", "train", "evaluate", "extract"):
        for job in jobs[rule]:
            assert job["Partition"] == "gpu", (rule, job)
            # --gpus=h100:1 from the rule's gpu and the profile's gpu_model (train: no model, see the profile)
            assert job.get("TresPerJob") == ("gres:gpu:1" if rule == "train" else "gres:gpu:h100:1"), (rule, job)
            assert job["JobState"] == "COMPLETED", (rule, job)
    for rule in ("ingest", "manifest", "shard", "tokenize", "audit"):
        for job in jobs[rule]:
            assert job["Partition"] == "cpu" and "gpu" not in job.get("TresPerJob", ""), (rule, job)
            assert job["JobState"] == "COMPLETED", (rule, job)
    print(f"SLURM pipeline: {len({j['JobId'] for js in jobs.values() for j in js})} SLURM jobs in {elapsed:.1f} s")


def test_launcher_reads_the_allocation_from_scontrol(slurm_cluster, tmp_path):
    """Inside a SLURM job whose environment lost SLURM_* (as the executor's job steps do), launch-torchrun
    still finds the allocation's nodes and GPUs per node."""
    from conftest import BIN

    out = tmp_path / "launch.txt"
    script = (f'env -i PATH=/usr/bin:/bin SLURM_JOB_ID="$SLURM_JOB_ID" {BIN}/dflash-pipeline launch-torchrun '
              f'--dry-run -- {BIN}/dflash-pipeline train > {out} 2>&1')
    job_id = subprocess.run(["sbatch", "--parsable", "-p", "gpu", "--gres=gpu:2", "--mem", "500", "-o", "/dev/null",
                             "--wrap", script], capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    for _ in range(120):
        state = _slurm_jobs().get(job_id, {}).get("JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            break
        time.sleep(0.5)
    assert state == "COMPLETED", (state, out.read_text() if out.exists() else "")
    line = out.read_text().strip().splitlines()[-1]
    assert "--standalone" in line and "--nproc-per-node 2" in line and line.endswith("dflash-pipeline train"), line
