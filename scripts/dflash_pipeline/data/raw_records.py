"""Stream the records of one raw file (JSON array or JSONL, optionally .gz/.zst) with exact byte offsets.

Both readers work on bytes: a record's offset is counted, never recomputed by re-encoding text, and each
record is parsed on its own, so one bad record (invalid UTF-8, a lone surrogate, a 5000-digit integer,
200k-deep nesting, a record over `max_record_bytes`) is reported as that record's error while the file goes
on. Damage inside a JSON array (a lost quote, a stray bracket, garbage between elements) costs the damaged
bytes: the reader resyncs at the next record and reports the span in `ReadResult.spans`. Only a stream that
ends or breaks (truncated or corrupt compressed data) ends the file; it is reported in `ReadResult.damage`
with the offset in the (decompressed) stream, after every complete record before it was handed out.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import zlib
from dataclasses import dataclass, field
from typing import IO, Iterator

import zstandard

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.storage import open_binary

CHUNK = 1 << 20
RAW_TEXT_LIMIT = 100_000  # characters of a rejected record kept for the quarantine file

# everything up to the next bracket, whole strings included (so brackets inside strings do not count); it
# stops at a bracket, at the opening quote of a string that does not end in the buffer, or at the end
_SKIP = re.compile(rb'(?:[^"\[\]{}]+|"[^"\\]*(?:\\.[^"\\]*)*")*', re.S)
_STRING_BODY = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.S)  # up to the closing quote (or the buffer's end)
_QUOTE, _END, _COMMA_CHAR = ord('"'), ord("]"), ord(",")
_COMMA = re.compile(rb"[ \t\r\n]*,[ \t\r\n]*")
_SPACE = re.compile(rb"[ \t\r\n]*")
_SCALAR = re.compile(rb"[^,\]\s]*")
_CLOSER = {ord("["): ord("]"), ord("{"): ord("}")}
_SCALAR_START = frozenset(b"-0123456789tfn")


class InputChangedError(PipelineError):
    """The raw file changed while it was read."""


@dataclass
class RawRecord:
    index: int  # position in the file, counting every record read
    offset: int  # byte offset of the record in the decompressed stream
    value: object = None  # the parsed JSON value, or None when `error` is set
    error: str | None = None  # why the record could not be parsed
    raw: str | None = None  # (a prefix of) the raw text, for the quarantine file when parsing failed
    end: int | None = None  # for a damaged span of a JSON array: the offset where it ends


@dataclass
class Damage:
    offset: int
    reason: str
    kind: str = "truncated"  # truncated | corrupt (compressed data) | damaged (a span resynced past) | trailing data
    end: int | None = None


@dataclass
class ReadResult:
    damage: Damage | None = None
    container: str = "jsonl"
    compression: str = "none"
    spans: list = field(default_factory=list)  # damaged spans of a JSON array that the reader resynced past
    count_only: bool = False  # set by the caller once it only counts what follows: records are not parsed


class _CountingReader:
    """Counts decompressed bytes handed out, so errors can name an offset."""

    def __init__(self, raw: IO[bytes]):
        self.raw, self.offset = raw, 0

    def read(self, n: int) -> bytes:
        data = self.raw.read(n)
        self.offset += len(data)
        return data


class _Decompressor:
    """Incremental gzip/zstd decompression that hands out every byte before damage, then raises.

    (gzip.GzipFile and zstd stream readers drop the chunk they were decoding when the stream breaks, which
    would lose complete records that salvage must keep.) Multi-member gzip and multi-frame zstd are read
    across members; garbage after the last frame is damage at the end of the valid data.
    """

    def __init__(self, fh: IO[bytes], kind: str):
        self.fh, self.kind = fh, kind
        self.buf = b""
        self.dec, self.bounds = self._new(), _ZstdBounds()
        self.pending = b""  # compressed bytes read but not decoded yet
        self.member_start: int | None = None  # compressed offset of the member/frame after the first
        self.consumed = 0  # compressed bytes read
        self.finished = False  # the compressed input is exhausted
        self.error: Exception | None = None  # raised once everything decoded before it is handed out

    def _new(self):
        if self.kind == "gzip":
            return zlib.decompressobj(wbits=47)
        return zstandard.ZstdDecompressor().decompressobj()

    def _fill(self) -> None:
        """Decode one bounded step: at most about CHUNK bytes of output per call, so 10 GiB of NULs from 320 KiB
        of zstd stream through a CHUNK at a time instead of being decoded by one call."""
        if not self.pending or (self.kind == "zstd" and not self.bounds.take(self.pending, CHUNK)):
            raw = self.fh.read(CHUNK)
            self.consumed += len(raw)
            if not raw and not self.pending:
                self.finished = True
                if not self.dec.eof:
                    self.error = EOFError(f"{self.kind} stream ends before its end marker (truncated file)")
                return
            self.pending += raw
            final = not raw
        else:
            final = False
        try:
            if self.dec.eof:  # the next member/frame, or garbage after the last one
                self.member_start = self.consumed - len(self.pending)
                self.dec, self.bounds = self._new(), _ZstdBounds()
            if self.kind == "gzip":
                self.buf += self.dec.decompress(self.pending, CHUNK)
                self.pending = self.dec.unused_data if self.dec.eof else self.dec.unconsumed_tail
            else:
                n = self.bounds.take(self.pending, CHUNK) or (len(self.pending) if final else 0)
                feed, self.pending = self.pending[:n], self.pending[n:]
                self.buf += self.dec.decompress(feed)
                if self.dec.eof and self.dec.unused_data:
                    self.pending = self.dec.unused_data + self.pending
        except (EOFError, OSError, zlib.error, zstandard.ZstdError) as exc:
            where = "" if self.member_start is None else f" (data after a complete {self.kind} stream, at compressed byte {self.member_start})"
            self.error = type(exc)(f"{exc}{where}")

    def read(self, n: int) -> bytes:
        while not self.buf and self.error is None and not self.finished:
            self._fill()
        if not self.buf and self.error is not None:
            raise self.error
        out, self.buf = self.buf[:n], self.buf[n:]  # bytes: a bytearray trimmed at the front kept its peak size
        return out


DECOMPRESSION_ERRORS = (EOFError, OSError, zlib.error, zstandard.ZstdError)
_ZSTD_MAGIC, _ZSTD_SKIPPABLE = 0xFD2FB528, 0x184D2A50
_ZSTD_BLOCK_MAX = 128 << 10


class _ZstdBounds:
    """Where to cut zstd input so that one decompress call makes at most about `limit` bytes (python-zstandard's
    decompressobj has no output bound). Block headers give each block's decoded size (raw and RLE blocks
    exactly, compressed ones at most 128 KiB), so input is fed a few blocks at a time whatever its ratio. Bytes
    that are not a zstd frame are fed whole: the decoder rejects them without output."""

    def __init__(self):
        self.unit, self.state, self.checksum = 0, "frame", 0

    def take(self, data: bytes, limit: int) -> int:
        """How many bytes of `data` to feed now (0: more input is needed to tell). Stops at a frame's end."""
        i = out = 0
        while i < len(data):
            if self.unit:
                step = min(self.unit, len(data) - i)
                i, self.unit = i + step, self.unit - step
                if not self.unit and self.state == "end":
                    return i
                continue
            if self.state == "raw":
                return len(data)
            if self.state == "frame":
                if len(data) - i < 8:
                    return i
                magic = int.from_bytes(data[i:i + 4], "little")
                if magic & 0xFFFFFFF0 == _ZSTD_SKIPPABLE:
                    self.unit, self.state = 8 + int.from_bytes(data[i + 4:i + 8], "little"), "end"
                    continue
                if magic != _ZSTD_MAGIC:
                    self.state = "raw"
                    continue
                d = data[i + 4]
                single = (d >> 5) & 1
                self.unit = 5 + (1 - single) + (0, 1, 2, 4)[d & 3] + (single, 2, 4, 8)[d >> 6]
                self.checksum, self.state = (d >> 2) & 1, "block"
                continue
            if self.state == "block":
                if len(data) - i < 3:
                    return i
                h = int.from_bytes(data[i:i + 3], "little")
                kind, size = (h >> 1) & 3, h >> 3
                bound = size if kind in (0, 1) else _ZSTD_BLOCK_MAX
                if out and out + bound > limit:
                    return i
                out += bound
                self.unit = 3 + (1 if kind == 1 else size)
                if h & 1:  # the frame's last block (and its checksum)
                    self.unit += 4 * self.checksum
                    self.state = "end"
                continue
            return i  # "end": the frame is complete
        return i


def decompression_damage(offset: int, reason: str) -> Damage:
    """A compressed stream that breaks: cut short (truncated) or corrupt (nothing after it can be decoded)."""
    return Damage(offset, reason, kind="truncated" if "before its end marker" in reason else "corrupt")


def _decompressed(path: str, fh: IO[bytes]) -> tuple[IO[bytes], str]:
    name = path.lower()
    if name.endswith(".gz"):
        return _Decompressor(fh, "gzip"), "gzip"
    if name.endswith((".zst", ".zstd")):
        return _Decompressor(fh, "zstd"), "zstd"
    return fh, "none"


def parse_record(data: bytes) -> tuple[object, str | None]:
    """(value, None) or (None, reason): every way one record's bytes can fail to be JSON, as a reason."""
    value, error, _ = _parse(data)
    return value, error


def _parse(data: bytes) -> tuple[object, str | None, bool]:
    """parse_record, and whether the failure is a syntax error (bytes that may not be this record's own)."""
    try:
        return json.loads(data), None, False
    except RecursionError:
        return None, "invalid JSON: nested too deeply to parse", False
    except UnicodeDecodeError as exc:
        return None, f"invalid UTF-8 at byte {exc.start} of the record ({exc.reason})", False
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON: {exc}", True
    except ValueError as exc:  # integers over Python's digit limit
        return None, f"invalid JSON: {exc}", False


def safe_text(raw) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
    return text[:RAW_TEXT_LIMIT]


def iter_raw_records(path: str, result: ReadResult, max_record_bytes: int) -> Iterator[RawRecord]:
    """Yield every record of the file; on damage, set `result.damage` and stop (the caller decides).
    A local file that changed while it was read (rewritten in place, replaced, grown or cut) is an error
    after the last record: its records would mix two versions (S3 GETs read one object version)."""
    with open_binary(path) as fh, contextlib.ExitStack() as reopened:
        before = _file_identity(path, fh)
        yield from _records(path, fh, result, max_record_bytes, lambda at: _reopen(path, at, reopened))
        if before is not None:
            _check_unchanged(path, fh, before)


def _reopen(path: str, offset: int, stack: contextlib.ExitStack) -> _CountingReader:
    """The file read again from `offset` of its (decompressed) stream: a resync goes back to where damage
    started once those bytes are no longer held. Local plain files seek; others are read up to there."""
    fh = stack.enter_context(open_binary(path))
    stream, _ = _decompressed(path, fh)
    skip = offset
    if stream is fh and getattr(fh, "seekable", lambda: False)():
        fh.seek(offset)
        skip = 0
    reader = _CountingReader(stream)
    while skip:
        data = reader.read(min(CHUNK, skip))
        if not data:
            break
        skip -= len(data)
    reader.offset = offset
    return reader


def _records(path: str, fh, result: ReadResult, max_record_bytes: int, reopen) -> Iterator[RawRecord]:
    stream, result.compression = _decompressed(path, fh)
    reader = _CountingReader(stream)
    try:
        first = reader.read(CHUNK)
    except DECOMPRESSION_ERRORS as exc:
        result.damage = decompression_damage(0, f"cannot decompress ({result.compression}): {exc}")
        return
    head = first.lstrip()
    if head.startswith(b"\xef\xbb\xbf"):  # UTF-8 BOM
        head = head[3:].lstrip()
    result.container = "json-array" if head.startswith(b"[") else "jsonl"
    if result.container == "json-array":
        yield from _ArrayReader(reader, first, result, max_record_bytes, reopen).records()
    else:
        yield from _iter_jsonl(reader, first, result, max_record_bytes)


def _stat_key(st: os.stat_result) -> tuple:
    # ctime too: a rewrite that restores size and mtime (cp -p, rsync -t) still changes it
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _file_identity(path: str, fh) -> tuple | None:
    try:
        return _stat_key(os.fstat(fh.fileno()))
    except (OSError, AttributeError, io.UnsupportedOperation):  # an S3 stream has no descriptor
        return None


def _check_unchanged(path: str, fh, before: tuple) -> None:
    """Two stat calls: the open file (rewritten in place) and the path (replaced by another file)."""
    try:
        now_fd, now_path = _stat_key(os.fstat(fh.fileno())), _stat_key(os.stat(path))
    except FileNotFoundError:
        now_fd, now_path = _stat_key(os.fstat(fh.fileno())), None
    if now_fd == before and now_path == before:
        return
    if now_path is None:
        how = "deleted"
    elif now_path[:2] != before[:2]:
        how = "replaced by another file"
    else:
        how = f"rewritten (size {before[2]} -> {now_fd[2]} bytes, mtime changed: {now_fd[3] != before[3]})"
    raise InputChangedError(f"{path}: the file was {how} while it was being read; its records would mix two "
                            "versions, so nothing was written. Rerun once the file no longer changes.")


def _too_big(index: int, offset: int, size: int, limit: int, head: bytes) -> RawRecord:
    return RawRecord(index, offset, error=f"record of {size} bytes is over max_record_bytes ({limit}); skipped",
                     raw=safe_text(head[:1000]))


def _iter_lines(reader: _CountingReader, first: bytes, result: ReadResult, limit: int):
    """(offset, line or None when over the limit, size, ends with a newline); an over-long line is dropped
    while it streams, so it never has to fit in memory."""
    buf, base, start, scan, eof, dropped, head = first, 0, 0, 0, False, 0, b""
    while True:
        nl = buf.find(b"\n", scan)
        if nl >= 0 or eof:
            end = nl if nl >= 0 else len(buf)
            size = dropped + end - start
            if nl < 0 and size == 0:
                return  # the file ends with its newline: nothing after it
            yield base + start - dropped, (None if size > limit else buf[start:end]), size, nl >= 0, head
            if nl < 0:
                return
            blank_end = _SPACE.match(buf, nl + 1).end()  # skip blank lines in one call (an empty-line bomb)
            start = scan = buf.rfind(b"\n", nl, blank_end) + 1
            dropped, head = 0, b""
            continue
        if dropped or len(buf) - start > limit:  # over the limit already: keep only its head for the report
            head = head or buf[start:start + 1000]
            dropped += len(buf) - start
            base, buf, start = base + len(buf), b"", 0
        elif start:
            base, buf, start = base + start, buf[start:], 0
        scan = len(buf)
        try:
            more = reader.read(CHUNK)
        except DECOMPRESSION_ERRORS as exc:
            result.damage = decompression_damage(reader.offset, f"decompression failed: {exc}")
            return
        eof = not more
        buf += more


def _iter_jsonl(reader: _CountingReader, first: bytes, result: ReadResult, limit: int):
    index = 0
    for offset, line, size, complete, head in _iter_lines(reader, first, result, limit):
        if line is None:
            yield _too_big(index, offset, size, limit, head)
            index += 1
            continue
        text = line.strip()
        if not text:
            continue
        value, error = parse_record(text)
        if error and not complete:  # an unparsable final line with no newline: the file was cut short
            result.damage = Damage(offset, f"truncated final line ({error})")
            return
        yield RawRecord(index, offset, value=value, error=error, raw=None if error is None else safe_text(text))
        index += 1


class _Incomplete(Exception):
    """The stream ended inside the value being scanned."""


class _Fatal(Exception):
    """The decompressed stream broke: nothing after this point can be read."""


class _Mismatch(Exception):
    """A closing bracket that does not match: the container is broken from here on."""


class _TooLong(Exception):
    """A resync candidate runs past max_record_bytes: not taken as a record."""


class _Broken(Exception):
    """The record (or the gap between records) at stream offset `start` is damaged; `scanner_end`: where the
    scanner thought a balanced but unparsable record ended (the resync tells whether it was right)."""

    def __init__(self, start: int, detail: str, scanner_end: int | None = None, eof: bool = False):
        super().__init__(detail)
        self.start, self.detail, self.scanner_end, self.eof = start, detail, scanner_end, eof


_BOUNDARY = re.compile(rb"[,\]]")
_RECORD_KEYS = ("conversations", "messages", "conversation")  # what a top-level record holds (normalize_record)


class _ArrayReader:
    """The elements of a top-level JSON array, found by a byte scanner (brackets, strings) and parsed one by
    one. The scanner's state (bracket stack, inside a string) carries over buffer refills, so an element over
    `max_record_bytes` is skipped while it streams past: positions of the element's start go negative once
    its head has been dropped, and `end - start` is still its size.

    Damage inside the array (a lost quote flips what the scanner sees as strings, a stray bracket, garbage
    between records) costs the damaged bytes only: the reader goes back to where the damage starts (reopening
    the file when those bytes are no longer held) and resyncs at the next record boundary at array depth 1, a
    `,` followed by a complete value that parses, looks like the file's records (same first key) and is
    followed by `,` or `]`; or the array's final `]`. Only a stream that ends inside the damage is a truncation."""

    def __init__(self, reader: _CountingReader, first: bytes, result: ReadResult, limit: int, reopen=None):
        self.reader, self.result, self.limit, self.reopen = reader, result, limit, reopen
        self.buf, self.base, self.eof = first, 0, False
        self.pos = first.index(b"[") + 1
        self.at = 0  # stream offset of what is being read now, for damage reports
        self.index, self.expect_comma = 0, False
        self.first_keys: set = set()  # the first key of the records read (resync candidates must share it)
        self.where = " of the decompressed stream" if result.compression != "none" else ""

    def _more(self, keep_from: int) -> int:
        """Drop buf[:keep_from] and read a chunk; returns the shift of positions. _Incomplete at the end."""
        self.base += keep_from
        self.buf = self.buf[keep_from:]
        if self.eof:
            raise _Incomplete("file ends inside the JSON array (no closing ']')")
        try:
            data = self.reader.read(CHUNK)
        except DECOMPRESSION_ERRORS as exc:
            self.at = self.reader.offset
            raise _Fatal(f"decompression failed: {exc}") from None
        self.eof = not data
        self.buf += data
        return keep_from

    def records(self) -> Iterator[RawRecord]:
        try:
            while True:
                try:
                    yield from self._scan()
                    return
                except _Broken as exc:
                    resumed = yield from self._recover(exc)
                    if not resumed:
                        return
        except _Incomplete as exc:  # between records: the array's `]` is missing
            self.result.damage = Damage(self.at, f"{exc}: the file is truncated", kind="truncated")
        except _Fatal as exc:
            self.result.damage = decompression_damage(self.at, str(exc))

    def _scan(self) -> Iterator[RawRecord]:
        while True:
            if self.expect_comma and (m := _COMMA.match(self.buf, self.pos)) is not None:
                self.pos, self.expect_comma = m.end(), False  # the usual case: `,` and the next record
            self._skip_space()
            self.at = self.base + self.pos
            if self.pos >= len(self.buf):
                raise _Incomplete(f"file ends after record {self.index - 1} without the array's closing ']'")
            ch = self.buf[self.pos]
            if ch == _END:
                return self._check_tail()
            if self.expect_comma or ch == _COMMA_CHAR:
                if ch != _COMMA_CHAR or not self.expect_comma:
                    raise _Broken(self.at, f"expected ',' or ']' after a record, found {chr(ch)!r}")
                self.pos, self.expect_comma = self.pos + 1, False
                continue
            if ch not in _CLOSER and ch != _QUOTE and ch not in _SCALAR_START:
                raise _Broken(self.at, f"unexpected {chr(ch)!r} where a record starts")
            yield self._record()
            self.index, self.expect_comma = self.index + 1, True

    def _skip_space(self) -> None:
        while True:
            self.pos = _SPACE.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or self.eof:
                return
            self.pos -= self._more(self.pos)

    def _record(self) -> RawRecord:
        offset, head = self.at, self.buf[self.pos:self.pos + 1000]
        try:
            start, end = self._value_end(self.pos)
        except _Incomplete:
            raise _Broken(offset, "its quotes or brackets do not balance (scanned to the end of the file without "
                          "closing it)", eof=True) from None
        except _Mismatch as exc:
            raise _Broken(offset, str(exc)) from None
        self.pos = end
        if end - start > self.limit:
            return _too_big(self.index, offset, end - start, self.limit, head)
        if self.result.count_only:
            return RawRecord(self.index, offset)
        data = self.buf[start:end]
        value, error, syntax = _parse(data)
        if syntax:
            raise _Broken(offset, error, scanner_end=self.base + end)
        self._learn(value)
        return RawRecord(self.index, offset, value=value, error=error, raw=None if error is None else safe_text(data))

    def _learn(self, value) -> None:
        if isinstance(value, dict) and value and len(self.first_keys) < 16:
            self.first_keys.add(next(iter(value)))

    def _looks_like_record(self, value) -> bool:
        if not isinstance(value, dict) or not value:
            return False
        if self.first_keys:
            return next(iter(value)) in self.first_keys
        return any(k in value for k in _RECORD_KEYS)

    def _recover(self, exc: _Broken):
        """Resync after the damage at `exc.start`; yield the damaged span (quarantined) and the record found
        after it. False when the stream ends inside the damage (a truncation)."""
        found = self._resync(exc.start)
        if found is None:
            kind = "ends inside" if exc.eof else "ends inside the damage that starts at"
            self.result.damage = Damage(exc.start, f"the file {kind} record {self.index} (starting at byte "
                                        f"{exc.start}{self.where}): it is truncated", kind="truncated")
            return False
        span_end, candidate = found
        text = self._span_text(exc.start, span_end)
        if exc.scanner_end is not None and span_end == exc.scanner_end:  # a balanced record that is not JSON
            yield RawRecord(self.index, exc.start, error=exc.detail, raw=safe_text(text))
        else:
            after = f"reading resumed at the next record, byte {candidate[0]}" if candidate else "the array ends after it"
            reason = (f"invalid JSON (damaged record, bytes {exc.start}-{span_end}{self.where}): {exc.detail}; "
                      f"{after}")
            self.result.spans.append(Damage(exc.start, reason, kind="damaged", end=span_end))
            yield RawRecord(self.index, exc.start, error=reason, raw=safe_text(text), end=span_end)
        self.index += 1
        if candidate is None:
            return False
        offset, value, data = candidate
        self._learn(value)
        yield RawRecord(self.index, offset, value=value)
        self.index, self.expect_comma = self.index + 1, True
        return True

    def _seek(self, offset: int) -> None:
        """Scan from stream offset `offset` again: in the buffer while it is held, else from a reopened file."""
        if self.base <= offset <= self.base + len(self.buf):
            self.pos = offset - self.base
            return
        self.reader, self.buf, self.base, self.pos, self.eof = self.reopen(offset), b"", offset, 0, False

    def _span_text(self, start: int, end: int) -> bytes:
        want = min(end - start, RAW_TEXT_LIMIT)
        if self.base <= start and start + want <= self.base + len(self.buf):
            return self.buf[start - self.base:start - self.base + want]
        reader = self.reopen(start)
        return reader.read(want)

    def _resync(self, start: int):
        """(end of the damaged span, (offset, value, bytes) of the next record or None at the array's end), or
        None when the stream ends first."""
        self._seek(start + 1)
        while True:
            m = _BOUNDARY.search(self.buf, self.pos)
            if m is None:
                if self.eof:
                    return None
                held = len(self.buf)
                keep = max(self.pos, held - 64)  # a little before: the span's trailing spaces
                self._more(keep)
                self.pos = held - keep
                continue
            k = e = m.start()
            while e > 0 and self.buf[e - 1] in b" \t\r\n":
                e -= 1
            span_end, is_end = max(self.base + e, start + 1), self.buf[k] == _END
            self.pos = k + 1
            self._skip_space()
            if self.pos >= len(self.buf):  # the stream ends: after the array's `]`, or cut short
                return (span_end, None) if is_end else None
            if is_end:
                continue  # a `]` inside the damage: the array's end only when nothing but spaces follows
            candidate = self._candidate()
            if candidate is not None:
                return span_end, candidate

    def _candidate(self):
        """The record at self.pos if it is one (see the class doc); else None, with self.pos just past its start."""
        c = self.base + self.pos
        if self.buf[self.pos] not in _CLOSER and self.buf[self.pos] != _QUOTE and self.buf[self.pos] not in _SCALAR_START:
            return None
        try:
            s, e = self._value_end(self.pos, bounded=True)
        except (_Incomplete, _Mismatch, _TooLong):
            self.pos = c - self.base + 1
            return None
        data = self.buf[s:e]
        value, error, _ = _parse(data)
        if error is None and self._looks_like_record(value):
            self.pos = e
            self._skip_space()
            if self.pos >= len(self.buf) or self.buf[self.pos] in (_COMMA_CHAR, _END):
                return c, value, data
        self.pos = c - self.base + 1
        return None

    def _value_end(self, start: int, bounded: bool = False) -> tuple[int, int]:
        """(start, end) in buf of the value at `start` (start < 0 once an over-limit value's head is dropped).
        `bounded`: _TooLong instead of streaming past a value over the limit."""
        if self.buf[start] in _SCALAR_START:
            return self._scalar_end(start)
        # one regex call per bracket: strings are skipped inside the regex engine
        stack, in_string, scan = [], self.buf[start] == _QUOTE, start + (self.buf[start] == _QUOTE)
        while True:
            buf = self.buf
            if in_string:  # inside a string that did not end in the buffer (or a top-level string)
                scan = _STRING_BODY.match(buf, scan).end()
                in_string = scan >= len(buf) or buf[scan] != _QUOTE  # else: it stopped at a final backslash
                if not in_string:
                    scan += 1
                    if not stack:
                        return start, scan
                    continue
            else:
                scan = _SKIP.match(buf, scan).end()
                if scan < len(buf):
                    c = buf[scan]
                    scan += 1
                    if c == _QUOTE:
                        in_string = True
                        continue
                    if c in _CLOSER:
                        stack.append(_CLOSER[c])
                        continue
                    if not stack or stack.pop() != c:
                        raise _Mismatch(f"unmatched {chr(c)!r} at byte {self.base + scan - 1}{self.where}")
                    if not stack:
                        return start, scan
                    continue
            # need more data: keep the element's bytes unless it is over the limit already
            if bounded and scan - start > self.limit:
                raise _TooLong()
            shift = self._more(scan if scan - start > self.limit else start)
            start, scan = start - shift, scan - shift

    def _scalar_end(self, start: int) -> tuple[int, int]:
        scan = start
        while True:
            scan = _SCALAR.match(self.buf, scan).end()
            if scan < len(self.buf) or self.eof:
                return start, scan
            shift = self._more(scan if scan - start > self.limit else start)
            start, scan = start - shift, scan - shift

    def _check_tail(self) -> None:
        self.pos += 1
        while True:
            self._skip_space()
            if self.pos < len(self.buf):
                self.result.damage = Damage(self.base + self.pos, "unexpected data after the closing ']'",
                                            kind="trailing data")
                return
            if self.eof:
                return
