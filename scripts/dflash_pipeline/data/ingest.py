"""Ingest one raw ShareGPT-style file: stream it, normalize every record or quarantine it with a reason.

Reads JSON arrays (the usual `*_cleaned_split.json`) and JSONL, each optionally `.gz` or `.zst`, from a
local path or an s3:// URI, without loading the file whole. A truncated or corrupt file is an error that
names the byte offset (in the decompressed stream) and how many records were read; with
`--on-corrupt salvage` the complete records before the damage are kept and the loss is reported.

Outputs: the file's normalized records (Parquet, in file order), a quarantine JSONL with every rejected
record and its reason, and stats whose counts add up: read = kept + quarantined.
Deduplication across files happens in the manifest stage.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline import package_paths
from dflash_pipeline.data.conversations import (SAMPLE_SCHEMA, RecordRejected, normalize_record, sample_id,
                                                tool_calls_of)
from dflash_pipeline.data.eval_prompts import excluded_prompts, first_user_turn, normalise
from dflash_pipeline.data.raw_records import RawRecord, ReadResult, iter_raw_records, safe_text
from dflash_pipeline.data.tool_turns import TOOL_REASON_KINDS
from dflash_pipeline.errors import CorruptInputError, PipelineError
from dflash_pipeline.storage import atomic_open, atomic_path, write_json

log = logging.getLogger(__name__)

RECORDS_SCHEMA = SAMPLE_SCHEMA.append(pa.field("record_index", pa.int64()))
DECONTAMINATED_EXAMPLES = 50
ROW_GROUP = 2048  # records per Parquet row group: the shard stage reads only the groups it needs


class _RecordsWriter:
    """Normalized records to Parquet, a row group at a time: the file is never held in memory."""

    def __init__(self, path):
        self.writer = pq.ParquetWriter(path, RECORDS_SCHEMA, compression="zstd")
        self.rows = {f.name: [] for f in RECORDS_SCHEMA}

    def add(self, name: str, rec: RawRecord, source_id, messages, sid: str, tools: str | None = None) -> None:
        for key, value in (("sample_id", sid), ("source", f"{name}#{rec.index}"), ("source_id", source_id),
                           ("messages", messages), ("tools", tools), ("record_index", rec.index)):
            self.rows[key].append(value)
        if len(self.rows["sample_id"]) >= ROW_GROUP:
            self.flush()

    def flush(self) -> None:
        if self.rows["sample_id"]:
            self.writer.write_table(pa.Table.from_pydict(self.rows, schema=RECORDS_SCHEMA))
            self.rows = {f.name: [] for f in RECORDS_SCHEMA}

    def close(self) -> None:
        self.flush()
        self.writer.close()

    def abort(self) -> None:
        """Close without writing what is buffered: the caller's error (e.g. ENOSPC) stays the one reported."""
        try:
            self.writer.close()
        except Exception:  # noqa: BLE001 - the temporary file is deleted anyway
            pass


def _json_line(obj) -> str:
    """One JSON line, readable UTF-8 where possible; text that is not valid Unicode (lone surrogates) is escaped."""
    line = json.dumps(obj, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(obj)
    return line + "\n"


def _accept(rec: RawRecord) -> tuple[str | None, list[dict], str, str | None]:
    """(source id, messages, sample id, tools) of a record, or RecordRejected with the reason."""
    if rec.error:
        raise RecordRejected(rec.error)
    source_id, messages, tools = normalize_record(rec.value)
    try:
        sid = sample_id(messages, tools)
        if source_id is not None:
            source_id.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RecordRejected(f"text is not valid Unicode (a lone surrogate {exc.object[exc.start:exc.end]!r} "
                             f"at character {exc.start})") from None
    return source_id, messages, sid, tools


def _quarantine_entry(name: str, rec: RawRecord, reason: str) -> str:
    if rec.raw is not None:
        raw = rec.raw
    else:
        try:
            raw = safe_text(json.dumps(rec.value, ensure_ascii=False))
        except (ValueError, RecursionError):  # e.g. an integer too long to print
            raw = safe_text(repr(rec.value)[:1000])
    entry = {"file": name, "record_index": rec.index, "byte_offset": rec.offset, "reason": reason, "record": raw}
    if rec.end is not None:  # a damaged span of a JSON array: exactly which bytes were set aside
        entry["byte_range"] = [rec.offset, rec.end]
    return _json_line(entry)


def _read_file(path, name, max_record_bytes, writer, qfh, result, max_records: int = 0,
               excluded: dict | None = None, dropped: list | None = None, salvage: bool = False) -> Counter:
    counts: Counter[str] = Counter()
    for rec in iter_raw_records(path, result, max_record_bytes):
        if result.count_only:  # past damage without salvage: only count what follows, for the error
            counts["after_damage"] += 1
            continue
        if rec.end is not None and not salvage:
            result.count_only = True  # the records after it are counted by the scan, not parsed
            continue
        if max_records and counts["read"] >= max_records:
            counts["not_read"] = 1  # the rest of the file is not read (a sized run): said in the stats
            break
        counts["read"] += 1
        try:
            source_id, messages, sid, tools = _accept(rec)
        except RecordRejected as exc:
            counts["quarantined"] += 1
            counts["reason:" + _reason_kind(str(exc))] += 1
            qfh.write(_quarantine_entry(name, rec, str(exc)))
            continue
        if excluded:
            hit = excluded.get(normalise(first_user_turn(messages) or ""))
            if hit is not None:  # an evaluation prompt: never trains (counted, and listed in the stats)
                counts["decontaminated"] += 1
                if len(dropped) < DECONTAMINATED_EXAMPLES:
                    dropped.append({"record_index": rec.index, "sample_id": sid, "evaluation_prompt": hit})
                continue
        counts["kept"] += 1
        calls = sum(len(tool_calls_of(m)) for m in messages)
        counts["tool_call_samples"] += calls > 0
        counts["tool_calls"] += calls
        writer.add(name, rec, source_id, messages, sid, tools)
    return counts


def ingest_file(
    path: str,
    out_records: str,
    out_stats: str,
    out_quarantine: str,
    name: str | None = None,
    on_corrupt: str = "error",
    max_record_bytes: int = 64 << 20,
    max_records: int = 0,
    exclude_prompts: list[str] | None = None,
) -> dict:
    name = name or path
    if max_record_bytes < 1:
        raise PipelineError(f"{name}: max_record_bytes {max_record_bytes} must be at least 1")
    result = ReadResult()
    excluded, dropped = excluded_prompts(exclude_prompts or []), []
    with atomic_open(out_quarantine, "w", encoding="utf-8") as qfh, atomic_path(out_records) as tmp:
        writer = _RecordsWriter(tmp)
        try:
            counts = _read_file(path, name, max_record_bytes, writer, qfh, result, max_records, excluded, dropped,
                                on_corrupt == "salvage")
        except BaseException:
            writer.abort()
            raise
        writer.close()
        compressed = result.compression != "none"
        if result.spans and on_corrupt != "salvage":
            span = result.spans[0]
            raise CorruptInputError(name, span.offset, counts["read"], span.reason, compressed, "damaged",
                                    counts["after_damage"])
        if result.damage is not None:
            if on_corrupt != "salvage":
                raise CorruptInputError(name, result.damage.offset, counts["read"], result.damage.reason, compressed,
                                        result.damage.kind)
            log.warning("%s: %s at byte %d (%s); salvaged %d complete records before it", name,
                        result.damage.kind, result.damage.offset, result.damage.reason, counts["read"])
        for span in result.spans:
            log.warning("%s: %s", name, span.reason)
    stats = _stats(name, result, counts)
    if exclude_prompts:
        stats["decontamination"] = {"prompt_files": list(exclude_prompts), "prompts": len(excluded),
                                    "dropped": counts["decontaminated"], "examples": dropped}
    if max_records:
        stats["max_records"] = {"limit": max_records, "rest_of_file_not_read": bool(counts["not_read"])}
    write_json(out_stats, stats)
    return stats


def _stats(name: str, result: ReadResult, counts: Counter) -> dict:
    reasons = Counter({k.removeprefix("reason:"): v for k, v in counts.items() if k.startswith("reason:")})
    read, kept, quarantined, decontaminated = counts["read"], counts["kept"], counts["quarantined"], counts["decontaminated"]
    if read != kept + quarantined + decontaminated:
        raise RuntimeError(f"{name}: accounting broken: read {read} != kept {kept} + quarantined {quarantined} "
                           f"+ decontaminated {decontaminated}")
    damage = result.damage
    return {
        "file": name,
        "container": result.container,
        "compression": result.compression,
        "records_read": read,
        "kept": kept,
        "quarantined": quarantined,
        "decontaminated": decontaminated,
        "quarantine_reasons": dict(reasons.most_common()),
        "damage": None if damage is None else {
            "byte_offset": damage.offset,
            "kind": damage.kind,
            "reason": damage.reason,
            "salvaged_records": read,
            "note": DAMAGE_NOTES[damage.kind],
        },
        "damaged_spans": [{"byte_range": [s.offset, s.end], "reason": s.reason} for s in result.spans],
        # kept samples that call tools, their calls, and records quarantined for a malformed call or tools list
        "tool_calls": {"samples": counts["tool_call_samples"], "calls": counts["tool_calls"],
                       "malformed_quarantined": sum(reasons[k] for k in TOOL_REASON_KINDS)},
    }


DAMAGE_NOTES = {
    "truncated": "the file is cut short here: no records follow the damage",
    "corrupt": "the compressed data is corrupt here: the records after it cannot be decompressed (how many is unknown)",
    "trailing data": "every record of the array was read; the data after its closing ']' is ignored",
}


def _reason_kind(reason: str) -> str:
    """Group reasons for counting: 'turn 3 has unknown role 'robot'' -> 'unknown role'."""
    for kind in TOOL_REASON_KINDS + (
            "over max_record_bytes", "invalid UTF-8", "not valid Unicode", "unknown role", "invalid JSON",
            "no text", "no role", "empty conversation", "no user turn", "system turn",
            "no 'conversations', 'messages' or 'conversation' field", "not an object", "not a list",
            "reasoning_content"):
        if kind in reason:
            return kind
    return reason


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, help="raw file: local path or s3:// URI")
    p.add_argument("--name", help="name recorded as the source (default: the input path)")
    p.add_argument("--out", required=True, help="normalized records (Parquet)")
    p.add_argument("--stats", required=True, help="counts (JSON)")
    p.add_argument("--quarantine", required=True, help="rejected records with reasons (JSONL)")
    p.add_argument("--on-corrupt", choices=["error", "salvage"])
    p.add_argument("--max-record-bytes", type=int)
    p.add_argument("--exclude-prompts", nargs="*",
                   help="evaluation prompt files (MT-Bench question.jsonl): samples whose first user turn is one of "
                        "their prompts are dropped and counted (decontamination)")
    p.add_argument("--max-records", type=int,
                   help="read at most this many records of the file (0: all); sizes a run on a large corpus")


def run(args) -> int:
    try:
        stats = ingest_file(package_paths.resolve(args.input), args.out, args.stats, args.quarantine,
                            args.name or args.input, args.on_corrupt, args.max_record_bytes, args.max_records,
                            [package_paths.resolve(p) for p in args.exclude_prompts])
    except FileNotFoundError as exc:
        raise PipelineError(f"{args.input}: input file not found ({exc})") from exc
    print(json.dumps(stats, indent=2), flush=True)  # stdout stays one JSON document
    print(console_line(stats, args.quarantine), file=sys.stderr)  # the rule echoes this last line to the console
    return 0


def console_line(stats: dict, quarantine: str) -> str:
    """One line per file for the console: records kept and quarantined (with the commonest reasons and where
    they are), dropped as evaluation prompts, salvaged damage; the audit has the rest."""
    line = f"ingest {stats['file']}: {stats['kept']:,} of {stats['records_read']:,} records kept"
    if stats["quarantined"]:
        reasons = ", ".join(f"{k}: {v:,}" for k, v in list(stats["quarantine_reasons"].items())[:3])
        line += f", {stats['quarantined']:,} quarantined ({reasons}; see {quarantine})"
    if stats.get("decontaminated"):
        line += f", {stats['decontaminated']:,} dropped as evaluation prompts"
    if stats.get("damaged_spans"):
        line += f", {len(stats['damaged_spans'])} damaged span(s) skipped"
    if stats.get("damage"):
        line += f"; {stats['damage']['kind']} at byte {stats['damage']['byte_offset']:,}: {stats['damage']['note']}"
    return line
