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
import codecs
import gzip
import json
import logging
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import IO, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from dflash_pipeline.data.conversations import SAMPLE_SCHEMA, RecordRejected, normalize_record, sample_id
from dflash_pipeline.errors import CorruptInputError, PipelineError
from dflash_pipeline.storage import atomic_open, atomic_path, open_binary, write_json

log = logging.getLogger(__name__)

CHUNK = 1 << 20
QUARANTINE_RECORD_LIMIT = 100_000  # characters of a rejected record kept in the quarantine file
RECORDS_SCHEMA = SAMPLE_SCHEMA.append(pa.field("record_index", pa.int64()))


@dataclass
class RawRecord:
    index: int  # position in the file, counting every record read
    offset: int  # byte offset of the record in the decompressed stream
    value: object = None  # the parsed JSON value, or None when `error` is set
    error: str | None = None  # the reason the record could not be parsed
    raw: str | None = None  # the raw text, kept for the quarantine file when parsing failed


@dataclass
class Damage:
    offset: int
    reason: str


@dataclass
class ReadResult:
    damage: Damage | None = None
    container: str = "jsonl"
    compression: str = "none"
    extra: dict = field(default_factory=dict)


class _CountingReader:
    """Counts decompressed bytes handed out, so errors can name an offset."""

    def __init__(self, raw: IO[bytes]):
        self.raw, self.offset = raw, 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.offset += len(data)
        return data


class _Decompressor:
    """Incremental gzip/zstd decompression that hands out every byte before a truncation, then raises.

    (gzip.GzipFile and zstd stream readers drop the partial chunk they were decoding when the stream
    ends early, which would lose complete records that salvage must keep.) Multi-member gzip and
    multi-frame zstd are read across members.
    """

    def __init__(self, fh: IO[bytes], kind: str):
        self.fh, self.kind = fh, kind
        self.buf = bytearray()
        self.dec = self._new()
        self.done = False

    def _new(self):
        if self.kind == "gzip":
            return zlib.decompressobj(wbits=47)
        return zstandard.ZstdDecompressor().decompressobj()

    def _fill(self) -> None:
        raw = self.fh.read(CHUNK)
        if not raw:
            self.done = True
            if not self.dec.eof:
                raise EOFError(f"{self.kind} stream ends before its end marker (truncated file)")
            return
        while raw:
            self.buf += self.dec.decompress(raw)
            if self.dec.eof:
                raw = self.dec.unused_data
                if raw:
                    self.dec = self._new()
            else:
                raw = b""

    def read(self, n: int = -1) -> bytes:
        while not self.done and (n < 0 or len(self.buf) < n):
            if self.buf and n >= 0:
                # hand out what we have first, so data before a truncation is never lost
                break
            self._fill()
        take = len(self.buf) if n < 0 else min(n, len(self.buf))
        out = bytes(self.buf[:take])
        del self.buf[:take]
        return out


def _decompressed(path: str, fh: IO[bytes]) -> tuple[IO[bytes], str]:
    name = path.lower()
    if name.endswith(".gz"):
        return _Decompressor(fh, "gzip"), "gzip"
    if name.endswith(".zst") or name.endswith(".zstd"):
        return _Decompressor(fh, "zstd"), "zstd"
    return fh, "none"


_DECOMPRESSION_ERRORS = (EOFError, OSError, zlib.error, zstandard.ZstdError)


def iter_raw_records(path: str, result: ReadResult, max_record_bytes: int) -> Iterator[RawRecord]:
    """Yield every record of the file; on damage, set `result.damage` and stop (the caller decides)."""
    with open_binary(path) as fh:
        stream, result.compression = _decompressed(path, fh)
        reader = _CountingReader(stream)
        try:
            first = reader.read(CHUNK)
        except _DECOMPRESSION_ERRORS as exc:
            result.damage = Damage(0, f"cannot decompress ({result.compression}): {exc}")
            return
        stripped = first.lstrip()
        if stripped.startswith(b"\xef\xbb\xbf"):  # UTF-8 BOM
            stripped = stripped[3:].lstrip()
        result.container = "json-array" if stripped.startswith(b"[") else "jsonl"
        if result.container == "json-array":
            yield from _iter_array(reader, first, result, max_record_bytes)
        else:
            yield from _iter_jsonl(reader, first, result, max_record_bytes)


def _iter_jsonl(reader: _CountingReader, first: bytes, result: ReadResult, max_record_bytes: int):
    pending, offset, index, eof = first, 0, 0, False
    while True:
        newline = pending.find(b"\n")
        if newline < 0 and not eof:
            if len(pending) > max_record_bytes:
                result.damage = Damage(offset, f"line longer than max_record_bytes ({max_record_bytes})")
                return
            try:
                more = reader.read(CHUNK)
            except _DECOMPRESSION_ERRORS as exc:
                result.damage = Damage(reader.offset, f"decompression failed: {exc}")
                return
            eof = not more
            pending += more
            continue
        if newline < 0:  # eof: last line without a newline
            line, pending = pending, b""
        else:
            line, pending = pending[:newline], pending[newline + 1:]
        line_offset, offset = offset, offset + len(line) + (newline >= 0)
        text = line.strip()
        if text:
            try:
                value = json.loads(text)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                if newline < 0:  # an unparsable final line with no newline: the file was cut short
                    result.damage = Damage(line_offset, f"truncated final line ({exc})")
                    return
                yield RawRecord(index, line_offset, error=f"invalid JSON: {exc}", raw=_safe_text(text))
            else:
                yield RawRecord(index, line_offset, value=value)
            index += 1
        if newline < 0 and eof:
            return


def _iter_array(reader: _CountingReader, first: bytes, result: ReadResult, max_record_bytes: int):
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    buf = utf8.decode(first)
    base = 0  # byte offset of buf[0]
    pos = buf.index("[") + 1
    eof, index, expect_comma = False, 0, False

    def byte_offset(p: int) -> int:
        return base + len(buf[:p].encode("utf-8"))

    def read_more() -> bool:
        nonlocal buf, base, pos, eof
        if pos > CHUNK:  # drop what has been consumed
            base += len(buf[:pos].encode("utf-8"))
            buf, pos = buf[pos:], 0
        data = reader.read(CHUNK)
        if not data:
            eof = True
            buf += utf8.decode(b"", final=True)
            return False
        buf += utf8.decode(data)
        return True

    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n":
            pos += 1
        if pos >= len(buf):
            try:
                if read_more():
                    continue
            except (UnicodeDecodeError, *_DECOMPRESSION_ERRORS) as exc:
                result.damage = Damage(reader.offset, f"decompression/decoding failed: {exc}")
                return
            result.damage = Damage(byte_offset(pos), "file ends inside the JSON array (no closing ']')")
            return
        ch = buf[pos]
        if ch == "]":
            rest = buf[pos + 1:].strip()
            if rest:
                result.damage = Damage(byte_offset(pos + 1), "unexpected data after the closing ']'")
            return
        if expect_comma:
            if ch != ",":
                result.damage = Damage(byte_offset(pos), f"expected ',' or ']' between records, found {ch!r}")
                return
            pos += 1
            expect_comma = False
            continue
        try:
            value, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as exc:
            incomplete = exc.pos >= len(buf) - 1 or exc.msg.startswith("Unterminated string")
            if incomplete and not eof:
                if len(buf) - pos > max_record_bytes:
                    result.damage = Damage(byte_offset(pos), f"record larger than max_record_bytes ({max_record_bytes})")
                    return
                try:
                    read_more()
                except (UnicodeDecodeError, *_DECOMPRESSION_ERRORS) as exc2:
                    result.damage = Damage(reader.offset, f"decompression/decoding failed: {exc2}")
                    return
                continue
            what = "file ends inside a record" if incomplete else f"invalid JSON ({exc.msg})"
            result.damage = Damage(byte_offset(min(exc.pos, len(buf))), what)
            return
        yield RawRecord(index, byte_offset(pos), value=value)
        index += 1
        pos, expect_comma = end, True


def _safe_text(raw) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    return text[:QUARANTINE_RECORD_LIMIT]


def ingest_file(
    path: str,
    out_records: str,
    out_stats: str,
    out_quarantine: str,
    name: str | None = None,
    on_corrupt: str = "error",
    max_record_bytes: int = 64 << 20,
) -> dict:
    name = name or path
    result = ReadResult()
    reasons: Counter[str] = Counter()
    rows = {f.name: [] for f in RECORDS_SCHEMA}
    read = kept = quarantined = 0
    with atomic_open(out_quarantine, "w", encoding="utf-8") as qfh:
        for rec in iter_raw_records(path, result, max_record_bytes):
            read += 1
            try:
                if rec.error:
                    raise RecordRejected(rec.error)
                source_id, messages = normalize_record(rec.value)
            except RecordRejected as exc:
                quarantined += 1
                reason = str(exc)
                reasons[_reason_kind(reason)] += 1
                raw = rec.raw if rec.raw is not None else _safe_text(json.dumps(rec.value, ensure_ascii=False))
                qfh.write(json.dumps({"file": name, "record_index": rec.index, "byte_offset": rec.offset,
                                      "reason": reason, "record": raw}, ensure_ascii=False) + "\n")
                continue
            kept += 1
            rows["sample_id"].append(sample_id(messages))
            rows["source"].append(f"{name}#{rec.index}")
            rows["source_id"].append(source_id)
            rows["messages"].append(messages)
            rows["record_index"].append(rec.index)
        if result.damage is not None:
            damage = result.damage
            if on_corrupt != "salvage":
                raise CorruptInputError(name, damage.offset, read, damage.reason)
            log.warning("%s: damaged at byte %d (%s); salvaged %d complete records before it",
                        name, damage.offset, damage.reason, read)
    table = pa.Table.from_pydict(rows, schema=RECORDS_SCHEMA)
    with atomic_path(out_records) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    stats = {
        "file": name,
        "container": result.container,
        "compression": result.compression,
        "records_read": read,
        "kept": kept,
        "quarantined": quarantined,
        "quarantine_reasons": dict(reasons.most_common()),
        "damage": None if result.damage is None else {
            "byte_offset": result.damage.offset,
            "reason": result.damage.reason,
            "salvaged_records": read,
            "note": "records after the damage could not be read and are lost",
        },
    }
    assert read == kept + quarantined
    write_json(out_stats, stats)
    return stats


def _reason_kind(reason: str) -> str:
    """Group reasons for counting: 'turn 3 has unknown role 'tool'' -> 'unknown role'."""
    for kind in ("unknown role", "invalid JSON", "no text", "no role", "empty conversation", "no user turn",
                 "system turn", "no 'conversations'", "not an object", "not a list", "reasoning_content"):
        if kind in reason:
            return kind
    return reason


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, help="raw file: local path or s3:// URI")
    p.add_argument("--name", help="name recorded as the source (default: the input path)")
    p.add_argument("--out", required=True, help="normalized records (Parquet)")
    p.add_argument("--stats", required=True, help="counts (JSON)")
    p.add_argument("--quarantine", required=True, help="rejected records with reasons (JSONL)")
    p.add_argument("--on-corrupt", choices=["error", "salvage"], default="error")
    p.add_argument("--max-record-bytes", type=int, default=64 << 20)


def run(args) -> int:
    try:
        stats = ingest_file(args.input, args.out, args.stats, args.quarantine, args.name, args.on_corrupt,
                            args.max_record_bytes)
    except FileNotFoundError as exc:
        raise PipelineError(f"{args.input}: input file not found ({exc})") from exc
    print(json.dumps(stats, indent=2))
    return 0
