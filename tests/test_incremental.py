"""Incremental runs of the real workflow (tiny demo config, local profile).

After one full run: nothing to do; touching one raw file redoes only that file's shards; removing one
shard's output redoes only that shard; a job killed mid-run leaves nothing a rerun mistakes for done; a
change to one stage's parameters reruns that stage and what depends on it, and a code change alone does not
(the rerun triggers of the profiles: mtime, params, input).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import readme_path

from conftest import BIN, run_cli
from workflow_runs import changed, make_workdir, planned, planned_outputs, snakemake, snapshot, workflow_env

pytestmark = pytest.mark.slow

SHARD_RE = re.compile(r"(?P<shard>[A-Za-z0-9_.]+-\d{5})")


@pytest.fixture(scope="module")
def done_run(tmp_path_factory, tiny_target):
    """A run directory where the whole workflow has run once: the README's path, walked command by command
    (`readme_path.walk`: copy the example config, dry runs on the local and SLURM profiles, the plan, the run,
    unlock and a dry run that finds nothing left), with the tiny test config as the user's edit."""
    workdir = make_workdir(tmp_path_factory.mktemp("incremental") / "run", model=tiny_target)
    t0 = time.monotonic()
    readme_path.walk(workdir)
    print(f"full run: {time.monotonic() - t0:.1f} s")
    return workdir


def _shards(workdir: Path) -> list[str]:
    return sorted(p.name.removesuffix(".parquet") for p in (workdir / "results/ingest/shards").glob("*.parquet"))


def _per_shard(paths) -> dict[str, set[str]]:
    by_shard: dict[str, set[str]] = {}
    for p in paths:
        m = SHARD_RE.search(Path(p).name)
        if m:
            by_shard.setdefault(m.group("shard"), set()).add(p)
    return by_shard


def test_nothing_to_do_after_a_full_run(done_run):
    assert planned(snakemake(done_run, "-n")) == {}
    assert len(_shards(done_run)) >= 2


def test_report_collects_every_stage(done_run):
    """`snakemake --report` after the run: one HTML file with the audit reports, generation statistics,
    extraction throughput and storage, training curves and tau."""
    snakemake(done_run, "--report", "report.html")
    page = (done_run / "report.html").read_text(errors="replace")
    for item in ("report.html", "generation.png", "extraction.png", "training.png", "tau.png", "acceptance.png",
                 "summary.html"):
        assert item in page, item
    summary = (done_run / "results/report/summary.html").read_text()
    for section in ("Generation", "Training", "Acceptance length", "Stage wall time"):
        assert section in summary
    # readable on its own (tests/test_report_summary.py has the details): figures embedded, no reprs in cells
    assert summary.count("src='data:image/png;base64,") == 4 and "{&quot;" not in summary and "<td>{" not in summary
    assert "not comparable" in summary  # the plan's GPU rates against this CPU run
    assert planned(snakemake(done_run, "-n")) == {}


def test_interrupted_run_redoes_only_the_missing_shard(done_run):
    """What an interrupted run leaves: one shard's outputs missing and the aggregate over all shards not
    written. The rerun makes that one shard and the aggregate, nothing else. (A missing intermediate
    whose consumers are all up to date is not rebuilt at all: Snakemake 9 only makes what is needed.)"""
    shard = _shards(done_run)[0]
    lost = [done_run / f"results/tokens/source/{shard}.audit.json", done_run / f"results/tokens/source/{shard}.parquet"]
    report = done_run / "results/audit/source/report.json"
    before = snapshot(done_run)
    for path in lost:
        path.unlink()
    assert planned(snakemake(done_run, "-n")) == {}  # consumers up to date: nothing needed
    report.unlink()
    plan = planned(snakemake(done_run, "-n", str(report.relative_to(done_run))))
    assert plan == {"tokenize": 1, "audit": 1}, plan
    snakemake(done_run, str(report.relative_to(done_run)), "--cores", "2")
    assert all(path.exists() for path in lost) and report.exists()
    by_shard = _per_shard(changed(before, snapshot(done_run)))
    assert set(by_shard) == {shard}, by_shard


def _tmp_files(directory: Path) -> list[Path]:
    return [p for p in directory.glob(".*") if ".tmp" in p.name]


def test_killed_job_leaves_nothing_a_rerun_trusts(done_run):
    """Kill Snakemake and its job (SIGKILL, no cleanup) while the job is writing, then rerun."""
    shard = _shards(done_run)[-1]
    target = done_run / f"results/tokens/source/{shard}.parquet"
    audit = target.with_suffix(".audit.json")
    target.unlink()
    audit.unlink()
    report = "results/audit/source/report.json"
    (done_run / report).unlink(missing_ok=True)  # the aggregate of an interrupted run
    proc = subprocess.Popen(
        [str(BIN / "snakemake"), report, "--profile", "profiles/local",
         "--configfile", "tiny.yaml", "--cores", "1"],
        cwd=done_run, env=workflow_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    # the job is running once its log exists; kill the moment a temporary output shows up (mid-write),
    # or after a few seconds of running if the write is too quick to catch
    log = done_run / f"results/logs/tokenize/source/{shard}.log"
    log.unlink(missing_ok=True)
    deadline = time.monotonic() + 120
    started = None
    caught_mid_write = False
    while time.monotonic() < deadline and proc.poll() is None:
        if started is None and log.exists():
            started = time.monotonic()
        if started is not None:
            if _tmp_files(target.parent):
                caught_mid_write = True
                break
            if time.monotonic() - started > 3.0:
                break
        time.sleep(0.002)
    assert proc.poll() is None, "the job finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    # nothing that looks like the finished output
    assert not target.exists() and not audit.exists(), f"killed job left its outputs (mid-write: {caught_mid_write})"
    # the rerun plans exactly that job again and completes it; leftovers of the killed writer are ignored
    plan = planned(snakemake(done_run, "-n", report))
    assert plan == {"tokenize": 1, "audit": 1}, plan
    snakemake(done_run, "--unlock")  # a killed Snakemake leaves its directory lock (README: after a crash)
    snakemake(done_run, report, "--cores", "2")
    assert target.exists() and audit.exists()
    import pyarrow.parquet as pq

    assert pq.read_table(target).num_rows > 0
    assert planned(snakemake(done_run, "-n", report)) == {}


def test_param_change_reruns_that_stage_and_descendants_only(done_run):
    (done_run / "longer.yaml").write_text("tokenize:\n  max_length: 2048\n")
    plan = planned(snakemake(done_run, "-n", configfiles=("tiny.yaml", "longer.yaml")))
    n = len(_shards(done_run))
    # tokenize (every shard of the datasets that exist) and what reads its files; nothing upstream
    assert plan.get("tokenize", 0) >= n, plan
    for upstream in ("demo_data", "tiny_target", "ingest", "manifest", "shard"):
        assert upstream not in plan, plan
    assert "audit" in plan
    # with mtime alone the parameter change goes unnoticed: why the profiles add `params`
    assert planned(snakemake(done_run, "-n", "--rerun-triggers", "mtime",
                             configfiles=("tiny.yaml", "longer.yaml"))) == {}


def test_resource_change_reruns_nothing(done_run):
    """More GPUs, nodes or memory for a stage is a scheduling change: no finished job is redone (GPU sizes are
    resources, not params). Only the cheap plan, whose projection depends on them, and the generation gate that reads
    it are redone."""
    (done_run / "bigger.yaml").write_text(
        "train:\n  gpus: 2\n  nodes: 1\nevaluate:\n  gpus: 1\nextract:\n  gpus: 1\ngenerate:\n  mem_mb: 64000\n")
    plan = planned(snakemake(done_run, "-n", configfiles=("tiny.yaml", "bigger.yaml")))
    # only the cheap projection and what reads it (the generation gate, the report); no recalibration, no GPU job
    assert set(plan) <= {"plan", "generation_gate", "run_report", "all"}, plan
    # while an output-changing setting of the same sections does rerun its stage. Snakemake 9 (upstream issue
    # snakemake#4166) re-evaluates jobs behind ancient() inputs of a rerunning aggregate (here the plan) only on the
    # next invocation: the cheap aggregates first, then training (README: rerun triggers)
    configs = ("tiny.yaml", "longer_train.yaml")
    (done_run / "longer_train.yaml").write_text("train:\n  gpus: 2\n  epochs: 2\n")
    snakemake(done_run, "results/plan.txt", "results/calibration/gate.ok", "--cores", "2", configfiles=configs)
    plan = planned(snakemake(done_run, "-n", configfiles=configs))
    assert plan.get("train") == 1 and plan.get("export") == 1, plan
    assert not {"extract", "generate", "calibrate", "tokenize"} & set(plan), plan


def test_code_change_alone_does_not_rerun(done_run):
    """Editing a rule's command (a refactor, a comment) does not redo finished shards with the profile's
    triggers; Snakemake's default triggers (which include `code`) would."""
    rule_file = done_run / "rules/tokenize.smk"
    target = "results/audit/source/report.json"
    original = rule_file.read_text()
    try:
        rule_file.write_text(original.replace("--settings {params.settings:q}", "--settings  {params.settings:q}", 1))
        assert original != rule_file.read_text()
        assert planned(snakemake(done_run, "-n", target)) == {}
        with_code = planned(snakemake(done_run, "-n", target, "--rerun-triggers", "mtime", "params", "input", "code"))
        assert with_code.get("tokenize", 0) >= len(_shards(done_run))
    finally:
        rule_file.write_text(original)


def test_changing_one_raw_file_redoes_only_its_chain(done_run):
    # last in this module: it leaves the stages after the source gate out of date
    src = "sharegpt_part1_cleaned_split"
    raw = done_run / f"data/demo/{src}.json"
    audit = "results/audit/source/report.json"  # the chain up to the audit over all shards
    before = snapshot(done_run)
    # touched, same bytes: Snakemake compares the checksum it recorded (files up to
    # --max-checksum-file-size, 1 MB by default) and redoes nothing; a big file is judged by its time
    os.utime(raw)
    assert planned(snakemake(done_run, "-n", audit)) == {}
    big = planned(snakemake(done_run, "-n", audit, "--max-checksum-file-size", "0"))
    assert big.get("ingest") == 1 and big.get("manifest") == 1, big
    assert "demo_data" not in big and "tiny_target" not in big
    # new content: that file is ingested again and only its shards are redone
    records = json.loads(raw.read_text())
    revised = 0
    for record in records:  # every well-formed record: the file's kept samples all change
        turns = record.get("conversations") if isinstance(record, dict) else None
        if isinstance(turns, list) and turns and isinstance(turns[-1], dict) and isinstance(turns[-1].get("value"), str):
            turns[-1]["value"] += " (revised)"
            revised += 1
    assert revised > 10
    raw.write_text(json.dumps(records))
    plan = planned(snakemake(done_run, "-n", audit))
    assert plan.get("ingest") == 1 and plan.get("manifest") == 1, plan
    # the per-shard chain up to the audit over all shards (past the gate, see the next test)
    snakemake(done_run, audit, "--cores", "2")
    touched = changed(before, snapshot(done_run))
    by_shard = _per_shard(touched)
    assert by_shard, touched
    # every per-shard file that was rewritten belongs to that file's shards ...
    assert all(shard.startswith(src + "-") for shard in by_shard), sorted(by_shard)
    # ... all of that file's shards were redone, and no other raw file was ingested again
    assert set(by_shard) == {s for s in _shards(done_run) if s.startswith(src + "-")}
    assert not any("ingest/files/" in p and src not in p for p in touched)
    assert planned(snakemake(done_run, "-n", audit)) == {}


def test_regating_does_not_redo_other_shards_generation(done_run):
    """After one raw file changed (the test above), the source audit and gate are redone; generation takes the
    gate as an ancient() input, so only the changed shard is generated again (GPU hours, at scale)."""
    src = "sharegpt_part1_cleaned_split"
    # the re-gating aggregates run first (snakemake#4166: jobs behind their ancient() outputs wait for the next
    # invocation), then the plan holds the changed shard's generation only
    snakemake(done_run, "results/audit/source/gate.ok", "results/calibration/gate.ok", "--cores", "2")
    proc = snakemake(done_run, "-n")
    plan = planned(proc)
    changed_shards = [s for s in _shards(done_run) if s.startswith(src + "-")]
    assert len(changed_shards) < len(_shards(done_run))
    assert "generate_group" not in plan and plan.get("generate") == len(changed_shards), plan
    generated = {p for p in planned_outputs(proc) if "/completions/" in p and p.endswith(".parquet")}
    assert generated == {f"results/completions/{s}.parquet" for s in changed_shards}, generated


def test_reset_redoes_what_forcerun_resumes(done_run):
    """`--forcerun generate` deletes a job's outputs, not its resume state: the generation journal answers every
    sample again and nothing is generated. `dflash-pipeline reset STAGE --yes` (README: "Resume, rerun, redo")
    deletes that state, and the same forced run then really generates; training checkpoints go with `reset train`."""
    shard = next(s for s in _shards(done_run) if s.startswith("sharegpt_part2"))  # a shard no test above changed
    target = f"results/completions/{shard}.parquet"
    log = done_run / f"results/logs/generate/{shard}.log"
    forced = (target, "--forcerun", "generate", "--cores", "2")
    snakemake(done_run, *forced)
    assert re.search(r"(\d+) of \1 samples already done \(journal\); 0 to generate", log.read_text()), log.read_text()

    listed = run_cli("reset", "generate", cwd=done_run).stdout  # without --yes: lists, deletes nothing
    assert "would delete results/completions/journal" in listed and (done_run / "results/completions/journal").exists()
    assert "snakemake --forcerun generate" in listed
    run_cli("reset", "generate", "--yes", cwd=done_run)
    assert not (done_run / "results/completions/journal").exists() and (done_run / target).exists()
    snakemake(done_run, *forced)
    text = log.read_text()
    assert "already done (journal)" not in text and re.search(r": done: [1-9]\d* ok", text), text

    (done_run / "results/train/checkpoints").mkdir(parents=True, exist_ok=True)
    run_cli("reset", "train", "--yes", cwd=done_run)
    assert not (done_run / "results/train/checkpoints").exists() and (done_run / "results/train/drafter").exists()
