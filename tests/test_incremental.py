"""Incremental runs of the real workflow (tiny demo config, local profile).

After one full run: nothing to do; touching one raw file redoes only that file's shards; removing one
shard's output redoes only that shard; a job killed mid-run leaves nothing a rerun mistakes for done; a
change to one stage's parameters reruns that stage and what depends on it, and a code change alone does not
(the rerun triggers of the profiles: mtime, params, input).
"""

from __future__ import annotations

from collections import Counter
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import readme_path

from conftest import BIN, run_cli
from rerun_scenarios import (TABLE, add_raw_file, change_one_record, change_operational, change_resources,
                             change_turn_samples_first, copy_run, ran, readme_table)
from workflow_runs import changed, make_workdir, planned, snakemake, snapshot, workflow_env

from dflash_pipeline.planning.calibration_sample import sample_identity

pytestmark = pytest.mark.slow

SHARD_RE = re.compile(r"(?P<shard>[A-Za-z0-9_.]+-\d{5})")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_target):
    """A run directory where the whole workflow has run once, and an untouched copy of it: the README's path,
    walked command by command (`readme_path.walk`: copy the example config, dry runs on the local and SLURM
    profiles, the plan, the run, unlock and a dry run that finds nothing left), with the tiny test config as the
    user's edit."""
    workdir = make_workdir(tmp_path_factory.mktemp("incremental") / "run", model=tiny_target)
    t0 = time.monotonic()
    readme_path.walk(workdir)
    print(f"full run: {time.monotonic() - t0:.1f} s")
    return workdir, copy_run(workdir, tmp_path_factory.mktemp("pristine") / "run")


@pytest.fixture(scope="module")
def done_run(runs):
    """The finished run; tests may change it in place (and leave it with nothing to do)."""
    return runs[0]


@pytest.fixture(scope="module")
def pristine(runs):
    """The finished run as it was; the table's tests copy it, one copy per change."""
    return runs[1]


def _shards(workdir: Path) -> list[str]:
    return sorted(p.name.removesuffix(".parquet") for p in (workdir / "results/ingest/shards").glob("*.parquet"))


def _group(shard: str, letter: str) -> str:
    """The job group of a shard (one shard per group in the tiny config): rules/common.smk's names."""
    src, k = shard.rsplit("-", 1)
    return f"{src}-{letter}{int(k):05d}"


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
    heads = re.findall(r"<h2>(.*?)</h2>", summary)
    assert heads[0] == "Result: acceptance length (tau)", heads  # the result leads, then cost, then data
    for section in ("Cost: stage wall time (Snakemake benchmarks)", "Data: generation", "Data: training"):
        assert section in heads, (section, heads)
    # readable on its own (tests/test_report_summary.py has the details): figures embedded, no reprs in cells
    figures = re.findall(r"<img alt='(.*?)' src='data:image/png;base64,", summary)
    assert figures == ["tau", "acceptance per block position", "Generation", "Extraction", "Training"], figures
    assert "{&quot;" not in summary and "<td>{" not in summary
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
    # the shard's group directory is whole: its files are linked out again, nothing is tokenized
    assert plan == {"tokens_from_group": 1, "audit": 1}, plan
    snakemake(done_run, str(report.relative_to(done_run)), "--cores", "2")
    assert all(path.exists() for path in lost) and report.exists()
    by_shard = _per_shard(changed(before, snapshot(done_run)))
    assert set(by_shard) == {shard}, by_shard


def _tmp_files(directory: Path) -> list[Path]:
    return [p for p in directory.glob(".*") if ".tmp" in p.name]


def test_killed_job_leaves_nothing_a_rerun_trusts(done_run):
    """Kill Snakemake and its job (SIGKILL, no cleanup) while the job is writing, then rerun. The tokenize job
    writes its group under .partial and renames it at the end."""
    shard = _shards(done_run)[-1]
    target = done_run / f"results/tokens/source/{shard}.parquet"
    audit = target.with_suffix(".audit.json")
    target.unlink()
    audit.unlink()
    group = done_run / f"results/tokens/source/groups/{_group(shard, 'j')}"
    shutil.rmtree(group)
    partial = group.with_name(group.name + ".partial")
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
    log = done_run / f"results/logs/tokenize/source/{group.name}.log"
    log.unlink(missing_ok=True)
    deadline = time.monotonic() + 120
    started = None
    caught_mid_write = False
    while time.monotonic() < deadline and proc.poll() is None:
        if started is None and log.exists():
            started = time.monotonic()
        if started is not None:
            if partial.is_dir() and _tmp_files(partial):
                caught_mid_write = True
                break
            if time.monotonic() - started > 3.0:
                break
        time.sleep(0.002)
    assert proc.poll() is None, "the job finished before it could be killed"
    # freeze the whole group first: what is on disk now is what the kill leaves. Under load the writer's atomic
    # rename can land between seeing its temporary file and the signal (the test failed that way under load)
    os.killpg(proc.pid, signal.SIGSTOP)
    renamed_first = group.exists()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    plan = planned(snakemake(done_run, "-n", report))
    if not renamed_first:
        # killed mid-run: nothing that looks like the finished output
        assert not group.exists() and not target.exists() and not audit.exists(), \
            f"killed job left its outputs (mid-write: {caught_mid_write})"
        # the rerun plans exactly that job again and completes it; leftovers of the killed writer are ignored
        assert plan == {"tokenize": 1, "tokens_from_group": 1, "audit": 1}, plan
    else:
        # the rename beat the freeze: the file is whole (written aside, renamed), and the job is redone unless
        # Snakemake had already recorded it as finished
        import pyarrow.parquet as pq

        assert pq.read_table(group / target.name).num_rows > 0
        done = [{"tokenize": 1, "tokens_from_group": 1, "audit": 1}, {"tokens_from_group": 1, "audit": 1}]
        if target.exists():  # under load the run got through tokens_from_group before the freeze
            done.append({"audit": 1})
        if (done_run / report).exists():  # ... or even through the audit
            done.append({})
        assert plan in done, plan
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


def test_touched_raw_file_with_the_same_bytes_redoes_nothing(done_run):
    raw = done_run / "data/demo/sharegpt_part1_cleaned_split.json"
    audit = "results/audit/source/report.json"
    # Snakemake compares the checksum it recorded (files up to --max-checksum-file-size, 1 MB by default) and
    # redoes nothing; a big file is judged by its time
    os.utime(raw)
    assert planned(snakemake(done_run, "-n", audit)) == {}
    big = planned(snakemake(done_run, "-n", audit, "--max-checksum-file-size", "0"))
    assert big.get("ingest") == 1 and big.get("manifest") == 1, big
    assert "demo_data" not in big and "tiny_target" not in big


# ------------------------------------------------------------------ the README table, row by row
# Each change is made to a copy of the finished run; ONE `snakemake` must do exactly the jobs below, and a dry
# run after it must find nothing to do (no change needs a second invocation).

AGGREGATES = {"audit": 2, "gate": 2, "plan": 1, "generation_gate": 1}
TRAIN_ONWARDS = {"train": 1, "export": 1, "evaluate": 1, "evaluate_gate": 1, "run_report": 1, "all": 1}


def _expected(change, shards: int) -> dict[str, int]:
    """Jobs per rule the change must run, with `shards` shards in the finished run (tiny config: 2)."""
    # one extraction job per group of extract.shards_per_job shards of a raw file; the tiny config's raw files
    # hold one shard each, so a group is a shard here; and so for shard, tokenize and generate (one job per group,
    # then a local job per shard that links its files out; training reads the extraction groups themselves)
    one_shard = {"shard": 1, "shard_from_group": 1, "tokenize": 2, "tokens_from_group": 2, "generate": 1,
                 "completions_from_group": 1, "extract": 1}
    return {
        "add_raw_file": {"ingest": 1, "manifest": 1, **one_shard, **AGGREGATES, **TRAIN_ONWARDS},
        "change_one_record": {"ingest": 1, "manifest": 1, **one_shard, **AGGREGATES, **TRAIN_ONWARDS},
        "rewrite_verdicts": {"gate": 2, "generation_gate": 1, "run_report": 1, "all": 1},
        "train_lr": TRAIN_ONWARDS,
        "extract_codec": {"plan": 1, "generation_gate": 1, "extract": shards,
                          **TRAIN_ONWARDS},
        # the plan resolves the layer ids; extract and train take them from it (a param, in one invocation)
        "target_layers": {"plan": 1, "generation_gate": 1, "extract": shards,
                          **TRAIN_ONWARDS},
        "max_new_tokens": {"calibrate": 1, "plan": 1, "generation_gate": 1, "generate": shards,
                           "completions_from_group": shards, "tokenize": shards, "tokens_from_group": shards,
                           "audit": 1, "gate": 1, "extract": shards, **TRAIN_ONWARDS},
    }[change.__name__]


REAL_RUN_CHANGES = [change for _, _, change in TABLE
                    if change.__name__ not in ("resources", "operational", "turn_samples")]


@pytest.mark.parametrize("change", REAL_RUN_CHANGES, ids=lambda c: c.__name__)
def test_one_invocation_redoes_exactly_what_the_change_invalidates(pristine, tmp_path, change):
    work = copy_run(pristine, tmp_path / "run")
    shards = _shards(work)
    calibration = work / "results/calibration/generation.json"
    sample_before = sample_identity(str(work / "results/calibration/sample.parquet"))
    before = snapshot(work)
    configs = change(work, ("tiny.yaml",))
    # Training onward is the same jobs after every change, and extraction the same per shard: the rows of
    # train_lr and extract_codec run them up to train (export and evaluation after a change are the full run's,
    # the fixture's: --omit-from export); the other rows stop before extraction (--omit-from extract: their
    # change is upstream of it, and whether it reaches extraction, and for which shards, is the count the dry
    # run plans). The dry run that follows must plan exactly the omitted jobs, no more. (The run is the same one
    # invocation cut in two: the dry run after it plans the whole rest of the DAG.)
    trains = change.__name__ in ("train_lr", "extract_codec", "target_layers")
    omit = ("--omit-from", "export" if trains else "extract")
    jobs = ran(snakemake(work, "--cores", "2", *omit, configfiles=configs))
    expected = _expected(change, len(shards))
    if change is change_one_record:
        # the record's shard is in the calibration's sample: a new draw, and a new calibration only if the
        # draw picked other prompts (a content hash of the prompts decides, not the file's time)
        expected["calibration_sample"] = 1
        if sample_identity(str(work / "results/calibration/sample.parquet")) != sample_before:
            expected["calibrate"] = 1
    rest = planned(snakemake(work, "-n", configfiles=configs))
    assert set(rest) <= set(TRAIN_ONWARDS) | {"extract"}, rest
    if trains:  # training ran after the change (and, for extract_codec, the new extraction it reads)
        assert jobs.get("train") == 1 and "extract" not in rest, (jobs, rest)
    else:
        assert "extract" not in jobs, jobs
    assert dict(Counter(jobs) + Counter(rest)) == expected, (jobs, rest)
    redone = _per_shard(p for p in changed(before, snapshot(work)) if "/completions/" in p or "/hidden/" in p)
    if change in (add_raw_file, change_one_record):
        # generation of no other shard: its files are the very same (and extraction of none: one extract job
        # above, in the jobs planned after the run)
        assert len(redone) == 1 and set(redone) <= set(_shards(work)), redone
    if change is add_raw_file:
        assert calibration.stat().st_mtime_ns == before[str(calibration.relative_to(work))]


@pytest.mark.parametrize("change", [change_resources, change_operational, change_turn_samples_first],
                         ids=lambda c: c.__name__)
def test_resources_and_operational_knobs_rerun_nothing(pristine, tmp_path, change):
    """More GPUs, nodes or memory for a stage is a scheduling change; progress, timeouts, retries, journal
    flushing, the running servers and encode threads change how a job runs, not what it writes."""
    work = copy_run(pristine, tmp_path / "run")
    configs = change(work, ("tiny.yaml",))
    # the run's summary compares GPU-hours with the plan: it is redrawn (seconds of CPU) when GPU counts change
    reruns = {"run_report": 1, "all": 1} if change is change_resources else {}
    assert planned(snakemake(work, "-n", configfiles=configs)) == reruns


def test_readme_table_is_the_tested_one(repo_root):
    """docs/running.md "Run it again after a change" shows exactly the rows these tests check."""
    assert readme_table() in (repo_root / "docs/running.md").read_text()


def test_reset_redoes_what_forcerun_resumes(done_run):
    """`--forcerun generate` deletes a job's outputs, not its resume state: the generation journal answers every
    sample again and nothing is generated. `dflash-pipeline reset STAGE --yes` (README: "Resume, rerun, redo")
    deletes that state, and the same forced run then really generates; training checkpoints go with `reset train`."""
    shard = next(s for s in _shards(done_run) if s.startswith("sharegpt_part2"))  # a shard no test above changed
    target = f"results/completions/{shard}.parquet"
    log = done_run / f"results/logs/generate/{_group(shard, 'g')}.log"
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
