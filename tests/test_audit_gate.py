"""The audit gate: fails on placeholder data with a message that says what to do, passes on clean data,
and in a real Snakemake run stops everything downstream of it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import REPO, run_cli
from data_fixtures import tokenized_audits
from dflash_pipeline.data.audit import build_report, write_html
from dflash_pipeline.demo.data import write_demo
from dflash_pipeline.data.ingest import ingest_file
from dflash_pipeline.data.manifest import build_manifest
from dflash_pipeline.storage import write_json
from workflow_runs import make_workdir
from workflow_runs import snakemake as run_workflow


def prepare(tmp: Path, tiny_target: Path, placeholder_rate: float, mode: str, records: int = 90):
    """ingest -> manifest -> shards -> tokenize -> audit in-process (fast); the gate through the CLI."""
    raw = tmp / "raw"
    write_demo(raw, records, placeholder_rate)
    audits = tokenized_audits(sorted(raw.iterdir()), tmp, tiny_target, max_length=1024, trivial_tokens=8)
    thresholds = yaml.safe_load((REPO / "config/config.yaml").read_text())["audit"]
    report = build_report(audits, str(tmp / "manifest.json"), thresholds, mode, "source")
    write_html(report, str(tmp / "report.html"))
    write_json(tmp / "report.json", report)
    gate = run_cli("gate", "--report", tmp / "report.json", "--out", tmp / "gate.ok", check=False)
    return report, gate


def test_gate_fails_on_placeholder_answers(tmp_path, tiny_target):
    report, gate = prepare(tmp_path, tiny_target, placeholder_rate=0.6, mode="full")
    assert not report["passed"]
    failed = {c["check"] for c in report["checks"] if c["status"] == "fail"}
    assert {"trivial", "placeholder"} <= failed
    assert 0.45 < report["fractions"]["trivial"] < 0.75
    assert report["placeholder_answers"][0]["answer"] == "ok."
    assert gate.returncode == 1 and not (tmp_path / "gate.ok").exists()
    assert "DATA AUDIT GATE FAILED" in gate.stderr
    assert "of samples have trivial responses" in gate.stderr and "regenerate" in gate.stderr
    html = (tmp_path / "report.html").read_text()
    assert "FAILED" in html and html.count("data:image/png;base64,") >= 6
    # exact accounting from the manifest reaches the report
    for f in report["ingest"]["files"]:
        assert f["records_read"] == f["kept"] + f["quarantined"] + f["duplicates"]


def test_gate_passes_on_clean_data_and_warns_in_prompt_mode(tmp_path, tiny_target):
    report, gate = prepare(tmp_path / "clean", tiny_target, placeholder_rate=0.0, mode="full")
    assert report["passed"], [c for c in report["checks"] if c["status"] != "pass"]
    assert gate.returncode == 0 and (tmp_path / "clean/gate.ok").exists()
    # before regeneration, bad answers are warnings: they are about to be replaced
    report, gate = prepare(tmp_path / "prompts", tiny_target, placeholder_rate=0.6, mode="prompts")
    assert report["passed"] and gate.returncode == 0
    assert "warning" in gate.stderr and "will be replaced" in gate.stderr


def snakemake(workdir: Path, *args, config: dict, model: Path) -> subprocess.CompletedProcess:
    """The real workflow in a private copy under `workdir`, with `config` merged over the defaults; the demo's
    target (`model`: what the tiny_target rule builds with target_pretrain_steps 0) already in place."""
    if not (workdir / "Snakefile").exists():
        make_workdir(workdir, model=model)
    (workdir / "test-config.yaml").write_text(yaml.safe_dump(config))
    return run_workflow(workdir, *args, configfiles=("test-config.yaml",), check=False)


@pytest.mark.slow
def test_snakemake_failed_gate_stops_the_run(tmp_path, tiny_target):
    """Training on the original placeholder answers (no regeneration): the gate stops the workflow."""
    cfg = {"generate": {"enabled": False},
           "demo": {"enabled": True, "records": 90, "placeholder_rate": 0.5, "target_pretrain_steps": 0}}
    plan = snakemake(tmp_path, "-n", config=cfg, model=tiny_target)
    assert plan.returncode == 0, plan.stderr
    proc = snakemake(tmp_path, config=cfg, model=tiny_target)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "DATA AUDIT GATE FAILED" in out and "trivial responses" in out
    assert (tmp_path / "results/audit/source/report.html").exists()
    assert not (tmp_path / "results/audit/source/gate.ok").exists()
    for downstream in ("completions", "hidden", "drafter", "eval"):
        assert not (tmp_path / "results" / downstream).exists(), downstream
    # once the manifest exists, a dry run plans every shard's jobs (how fast: benchmarks, not a timed assert,
    # which failed on a loaded machine)
    plan = snakemake(tmp_path, "-n", config=cfg, model=tiny_target)
    assert plan.returncode == 0
    assert "gate" in plan.stdout


def test_every_record_quarantined_gate_says_too_few_samples(tmp_path):
    """0 shards: the audit gets no per-shard files (the rule passes `--audits` with nothing after it)."""
    raw = tmp_path / "bad.jsonl"
    raw.write_text('{"id": 1, "conversations": []}\nnot json\n{"dialog": []}\n{"dialog": []}\n')
    ingest_file(str(raw), str(tmp_path / "bad.parquet"), str(tmp_path / "bad.stats.json"), str(tmp_path / "q.jsonl"))
    write_json(tmp_path / "manifest.json", build_manifest([str(tmp_path / "bad.parquet")],
                                                          [str(tmp_path / "bad.stats.json")], shard_size=8))
    thresholds = yaml.safe_load((REPO / "config/config.yaml").read_text())["audit"]
    proc = run_cli("audit", "--audits", "--manifest", tmp_path / "manifest.json", "--thresholds", json.dumps(thresholds),
                   "--out", tmp_path / "report.json", "--html", tmp_path / "report.html", check=False)
    assert proc.returncode == 0, proc.stderr
    gate = run_cli("gate", "--report", tmp_path / "report.json", "--out", tmp_path / "gate.ok", check=False)
    assert gate.returncode == 1 and "0 samples: too few samples survived ingest" in gate.stderr
    assert "100.0% of records read were quarantined" in gate.stderr
    # the gate names the file, its commonest reason and where every quarantined record is
    assert (f"{raw}: 4 of 4 records quarantined, 2 of them for \"no 'conversations', 'messages' or 'conversation' "
            f"field\" (all in {tmp_path / 'files' / 'bad.quarantine.jsonl'})") in gate.stderr, gate.stderr


def test_shard_audit_of_an_older_format_is_named(tmp_path):
    """A results directory tokenized by an older version (per-sample lists): one line naming file and fix."""
    old = tmp_path / "x-00000.audit.json"
    old.write_text(json.dumps({"samples": 1, "per_sample": {"length": [3]}}))
    write_json(tmp_path / "manifest.json", {"totals": {"records_read": 1, "quarantined": 0, "duplicates": 0,
                                                       "samples": 1}, "files": [], "shards": []})
    thresholds = yaml.safe_load((REPO / "config/config.yaml").read_text())["audit"]
    proc = run_cli("audit", "--audits", old, "--manifest", tmp_path / "manifest.json", "--thresholds",
                   json.dumps(thresholds), "--out", tmp_path / "r.json", "--html", tmp_path / "r.html", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert str(old) in proc.stderr and "format 1" in proc.stderr and "tokenize again" in proc.stderr
