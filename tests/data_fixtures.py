"""Helpers shared by the data tests: the supervised pieces of a tokenized sample, and the front half of the
pipeline (ingest -> manifest -> shards -> tokenize) run in-process on a few raw files."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_pipeline.data.ingest import ingest_file
from dflash_pipeline.data.manifest import build_manifest, write_shard
from dflash_pipeline.data.tokenize import tokenize_shard
from dflash_pipeline.storage import write_json


def supervised_runs(tokenizer, sample) -> list[str]:
    """Each contiguous run of supervised tokens (loss_mask 1), decoded."""
    runs, current = [], []
    for tid, m in zip(sample.input_ids + [None], sample.loss_mask + [0]):
        if m:
            current.append(tid)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


def tokenized_audits(raw_files: list[Path], tmp: Path, model_dir: Path, **tokenize_kw) -> list[str]:
    """Ingest each raw file (source name: its name up to the first dot), build the manifest (tmp/manifest.json),
    write and tokenize every shard; the shards' audit files, in manifest order."""
    records, stats = [], []
    for f in raw_files:
        src = f.name.split(".")[0]
        ingest_file(str(f), str(tmp / f"{src}.parquet"), str(tmp / f"{src}.stats.json"), str(tmp / f"{src}.q.jsonl"))
        records.append(str(tmp / f"{src}.parquet"))
        stats.append(str(tmp / f"{src}.stats.json"))
    write_json(tmp / "manifest.json", build_manifest(records, stats, shard_size=1000))
    audits = []
    for s in json.loads((tmp / "manifest.json").read_text())["shards"]:
        write_shard(str(tmp / f"{s['src']}.parquet"), s, str(tmp / f"{s['shard']}.parquet"))
        tokenize_shard(str(tmp / f"{s['shard']}.parquet"), str(model_dir), str(tmp / f"{s['shard']}.tokens.parquet"),
                       str(tmp / f"{s['shard']}.audit.json"), **tokenize_kw)
        audits.append(str(tmp / f"{s['shard']}.audit.json"))
    return audits
