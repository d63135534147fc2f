"""What a change to a finished run redoes: the changes of the README table "what you change -> what reruns",
made to a run directory, and the count of the jobs a run then started. Shared by tests/test_incremental.py
(tiny config, every row checked) and benchmarks/rerun_scope.py (demo config, before and after)."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import yaml

FINISHED = re.compile(r"Finished jobid: \d+ \(Rule: (\w+)\)")


def ran(proc) -> dict[str, int]:
    """Jobs per rule that a real run finished (from Snakemake's log lines)."""
    return dict(Counter(FINISHED.findall(proc.stdout + proc.stderr)))


def copy_run(src: Path, dst: Path) -> Path:
    """A finished run directory copied with its times and Snakemake's metadata: a scenario of its own."""
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("locks", "incomplete"))
    return dst


def _inputs(work: Path, configfiles) -> list[str]:
    inputs = yaml.safe_load((work / "config/config.yaml").read_text())["inputs"]
    for name in configfiles:
        inputs = (yaml.safe_load((work / name).read_text()) or {}).get("inputs", inputs)
    return list(inputs)


def _overlay(work: Path, configfiles, name: str, text: str) -> tuple[str, ...]:
    (work / name).write_text(text)
    return (*configfiles, name)


def add_raw_file(work: Path, configfiles, records: int = 20) -> tuple[str, ...]:
    """A new raw file of `records` conversations no other file has (one new shard)."""
    path = work / "data/added/new_part.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for i in range(records):
            fh.write(json.dumps({"id": f"new-{i}", "conversations": [
                {"from": "human", "value": f"Name {i + 3} things that are green, number {i}."},
                {"from": "gpt", "value": f"Grass, leaves and limes are green; that makes {i + 3} with more."}]}) + "\n")
    inputs = _inputs(work, configfiles) + ["data/added/new_part.jsonl"]
    return _overlay(work, configfiles, "added.yaml", yaml.safe_dump({"inputs": inputs}))


def change_one_record(work: Path, configfiles) -> tuple[str, ...]:
    """The last well-formed record of the first raw file (a JSON array) gets a revised answer: only the shard
    that holds it changes."""
    raw = work / _inputs(work, configfiles)[0]
    records = json.loads(raw.read_text())
    for record in reversed(records):
        turns = record.get("conversations") if isinstance(record, dict) else None
        if isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, dict) for t in turns) \
                and isinstance(turns[-1].get("value"), str) and turns[-1].get("from") == "gpt":
            turns[-1]["value"] += " (revised)"
            break
    else:
        raise AssertionError(f"{raw}: no well-formed record to change")
    raw.write_text(json.dumps(records, indent=1))
    return tuple(configfiles)


def rewrite_verdicts(work: Path, configfiles) -> tuple[str, ...]:
    """Every audit report, gate and the plan rewritten with the same verdict but other bytes (a newline more),
    as a rerun that decides the same would leave them: the gates, and what reads the plan, run again."""
    results = work / "results"
    # the gates first, then what they read: newer reports than gates, as after a re-audit
    for rel in ("audit/source/gate.ok", "audit/regenerated/gate.ok", "calibration/gate.ok",
                "audit/source/report.json", "audit/regenerated/report.json", "plan.txt", "plan.json"):
        path = results / rel
        if path.exists():
            path.write_bytes(path.read_bytes() + b"\n")
    return tuple(configfiles)


def config_change(name: str, text: str):
    def apply(work: Path, configfiles) -> tuple[str, ...]:
        return _overlay(work, configfiles, name, text)
    apply.__name__ = name.removesuffix(".yaml")
    return apply


change_train = config_change("train_lr.yaml", "train:\n  lr: 1.0e-3\n")
change_extract_codec = config_change("extract_codec.yaml", "extract:\n  codec: raw\n")
change_max_new_tokens = config_change("max_new_tokens.yaml", "generate:\n  max_new_tokens: 12\n")
change_target_layers = config_change("target_layers.yaml", "drafter:\n  target_layer_ids: [2, 4]\n")
change_resources = config_change(
    "resources.yaml",
    "train:\n  gpus: 2\n  nodes: 1\n  mem_mb: 64000\n  runtime_min: 99\nevaluate:\n  gpus: 1\n  mem_mb: 9000\n"
    "extract:\n  gpus: 1\n  mem_mb: 9000\n  runtime_min: 99\ngenerate:\n  mem_mb: 64000\n  runtime_min: 99\n")
change_turn_samples_first = config_change("turn_samples.yaml", "tokenize:\n  turn_samples: every\n")
change_operational = config_change(
    "operational.yaml",
    "generate:\n  progress_interval_s: 3\n  request_timeout_s: 60\n  all_down_timeout_s: 30\n  max_retries: 2\n"
    "  empty_retries: 3\n  retry_failed: false\n  journal_flush_every: 4\n"
    "  servers: ['http://127.0.0.1:30000']\n  hf:\n    threads: 1\nextract:\n  encode_threads: 1\ntrain:\n  cpu_threads: 2\n"
    "evaluate:\n  cpu_threads: 2\n  batch_size: 3\n  eager: true\n")


# (what you change, what reruns, the change): the README table's rows, in its order
TABLE = [
    ("a raw file added", "its ingest, shard, tokenize, generate, tokenize (regenerated) and extract; the "
     "manifest, audits, gates, plan and generation gate; train, export, evaluate, report. Not the calibration: "
     "its sample is kept", add_raw_file),
    ("one record of a raw file changed", "that file's ingest, then only the shard holding the record, through "
     "generate and extract; the aggregates; train onwards. The calibration sample is drawn again (one of its "
     "shards changed), the calibration only if that draw holds other prompts",
     change_one_record),
    ("an audit report, gate or the plan rewritten with the same verdict", "the gates, the generation gate and "
     "the report (seconds of CPU); no per-shard job", rewrite_verdicts),
    ("a `train:` setting (here `lr`)", "train, export, evaluate, report (`epochs`, `mode`, `num_anchors` and "
     "`max_length` also re-plan: the plan projects training hours)", change_train),
    ("an `extract:` setting that changes the bytes (here `codec`)", "the plan, every extract, then train "
     "onwards; no generation", change_extract_codec),
    ("`drafter.target_layer_ids` (or `num_layers`: the ids the plan resolves)", "the plan, every extract, "
     "then train onwards; no generation", change_target_layers),
    ("`generate.max_new_tokens`", "the calibration, the plan and its gate, every generate and what follows; "
     "not ingest nor the source tokenize", change_max_new_tokens),
    ("resources only (GPUs of train, extract and evaluate, nodes, memory, run time)",
     "only the run's report (its GPU-hours); no stage (`generate.gpus` also re-plans: the plan's GPU-hours)",
     change_resources),
    ("`tokenize.turn_samples` while `generate.turns: first` (one generated turn a conversation: the same samples)",
     "nothing (with `turns: all`: the regenerated tokenize, its audit and gate, every extract, train onwards)",
     change_turn_samples_first),
    ("an operational knob: progress interval, timeouts, retries, journal flush, the list of running servers, "
     "CPU threads (hf generation, encode, train, evaluate), evaluation batch and CUDA graphs", "nothing", change_operational),
]


def readme_table() -> str:
    rows = ["| what you change | what reruns (one `snakemake`, then `snakemake -n` says nothing to do) |",
            "|---|---|"]
    rows += [f"| {change} | {reruns} |" for change, reruns, _ in TABLE]
    return "\n".join(rows) + "\n"
