"""One shard of `generate`: read its samples, resume from its journal, write its completions and summary.

Per shard: `OUT` (Parquet, `client.COMPLETION_SCHEMA`, exactly one row per input sample, in input order), `OUT`
with `.summary.json` (counts, tokens, throughput) and a journal `JOURNAL_DIR/<shard>.jsonl` (see `journal`).
"""

from __future__ import annotations

import io
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline import storage
from dflash_pipeline.data.conversations import check_conversation_table, with_sample_columns
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.generation.client import COMPLETION_SCHEMA, Counters
from dflash_pipeline.generation.journal import Journal

LOG = logging.getLogger("dflash_pipeline.generation.stage")


class ShardJob:
    """One shard's generation: its input rows, journal, counters, and the files it finally writes."""

    def __init__(self, input_path: str, out: str, journal_path: Path, mirror: str | None):
        self.input_path = input_path
        self.out = out
        self.name = Path(out.rstrip("/")).name.removesuffix(".parquet")
        self.summary_path = out.removesuffix(".parquet") + ".summary.json"
        self.journal_path = journal_path
        self.mirror = mirror
        self.rows = _read_rows(input_path)
        ids = [r["sample_id"] for r in self.rows]
        if len(set(ids)) != len(ids):
            raise PipelineError(f"{input_path}: duplicate sample ids; generation is keyed by sample id")
        self.counters = Counters()
        self.journal: Journal | None = None
        self.todo: list[dict] = []
        self.remaining = 0
        self.resumed = 0
        self.t0 = time.monotonic()
        self.finalized = False

    def open(self, settings: dict, args, unidentified: str | None = None) -> None:
        """Open the journal; `unidentified` (why the weights cannot be identified) refuses to reuse its answers."""
        self.journal = Journal(self.journal_path, self.name, settings, flush_every=args.flush_every,
                               flush_interval_s=args.flush_interval, mirror=self.mirror,
                               mirror_interval_s=args.mirror_interval)
        if unidentified and self.journal.done:
            n = len(self.journal.done)
            self.journal.close()
            raise PipelineError(f"{self.journal_path}: holds {n} answers, not reused: {unidentified}")
        wanted = {r["sample_id"] for r in self.rows}
        stray = set(self.journal.done) - wanted
        if stray:
            LOG.warning("%s: %d journal records are not in the input (ignored)", self.name, len(stray))
        for row in self.rows:
            rec = self.journal.done.get(row["sample_id"])
            if rec is None or (args.retry_failed and rec["status"] != "ok" and not rec.get("permanent", True)):
                self.todo.append(row)
        self.resumed = len(self.rows) - len(self.todo)
        self.remaining = len(self.todo)
        if self.resumed:
            LOG.info("%s: %d of %d samples already done (journal); %d to generate", self.name, self.resumed,
                     len(self.rows), len(self.todo))

    def finalize(self, meta: dict) -> dict:
        """Write the shard (one row per input sample, input order) and its summary from the journal."""
        self.journal.flush()
        records = []
        for row in self.rows:
            rec = self.journal.done.get(row["sample_id"])
            if rec is None:
                raise RuntimeError(f"{self.name}: sample {row['sample_id']} has no result")  # cannot happen
            records.append({k: rec.get(k) for k in COMPLETION_SCHEMA.names})
        _write_parquet(pa.Table.from_pylist(records, schema=COMPLETION_SCHEMA), self.out)
        summary = {**self._summary(records), **meta}
        _write_json(summary, self.summary_path)
        self.finalized = True
        LOG.info("%s: done: %d ok, %d failed (%s) -> %s", self.name, summary["ok"], summary["failed"],
                 summary["failure_reasons"] or "none", self.out)
        return summary

    def _summary(self, records: list[dict]) -> dict:
        statuses = [r["status"] for r in records]
        wall = time.monotonic() - self.t0
        reasons: dict[str, int] = {}
        for r in records:
            if r["status"] != "ok":
                key = r["failure_reason"].split(":")[0][:80]
                reasons[key] = reasons.get(key, 0) + 1
        return {
            "shard": self.name,
            "input": self.input_path,
            "output": self.out,
            "samples": len(records),
            "ok": statuses.count("ok"),
            "failed": statuses.count("failed"),
            "failure_reasons": reasons,
            "finish_reason_length": sum(r["finish_reason"] == "length" for r in records if r["status"] == "ok"),
            "with_token_ids": sum(r["output_ids"] is not None for r in records),
            "prompt_tokens": sum(r["prompt_tokens"] for r in records),
            "completion_tokens": sum(r["completion_tokens"] for r in records),
            "resumed_from_journal": self.resumed,
            "this_run": {**asdict(self.counters), "wall_s": round(wall, 3),
                         "completion_tokens_per_s": round(self.counters.completion_tokens / max(wall, 1e-9), 1),
                         "samples_per_s": round(len(self.todo) / max(wall, 1e-9), 3)},
        }


def _read_rows(path: str) -> list[dict]:
    try:
        if storage.is_s3(path):
            with storage.open_binary(path) as fh:
                table = pq.read_table(pa.BufferReader(fh.read()))
        else:
            table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise PipelineError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    check_conversation_table(path, table)
    missing = {"sample_id", "source", "source_id", "messages"} - set(table.column_names)
    if missing:
        raise PipelineError(f"{path}: not an ingested shard (missing columns {sorted(missing)})")
    # a shard written before tool calling reads with null tools and tool fields
    return with_sample_columns(table).select(["sample_id", "source", "source_id", "messages", "tools"]).to_pylist()


def _write_parquet(table: pa.Table, out: str) -> None:
    if storage.is_s3(out):
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        bucket, key = storage.split_s3(out)
        storage.s3_client().put_object(Bucket=bucket, Key=key, Body=buf.getvalue())
        return
    with storage.atomic_path(out) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def _write_json(obj: dict, out: str) -> None:
    if storage.is_s3(out):
        bucket, key = storage.split_s3(out)
        storage.s3_client().put_object(Bucket=bucket, Key=key, Body=json.dumps(obj, indent=2).encode())
        return
    storage.write_json(out, obj)
