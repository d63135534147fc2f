"""Stream the records of one raw file (JSON array or JSONL, optionally .gz/.zst) with exact byte offsets.

Both readers work on bytes: a record's offset is counted, never recomputed by re-encoding text, and each
record is parsed on its own, so one bad record (invalid UTF-8, a lone surrogate, a 5000-digit integer,
200k-deep nesting, a record over `max_record_bytes`) is reported as that record's error while the file goes
on. Only damage to the container itself (a truncated or corrupt stream, garbage between array elements)
ends the file; it is reported in `ReadResult.damage` with the offset in the decompressed stream, after
every complete record before it was handed out.
"""

from __future__ import annotations

import io
import json
import os
import re
import zlib
from dataclasses import dataclass
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


@dataclass
class Damage:
    offset: int
    reason: str


@dataclass
class ReadResult:
    damage: Damage | None = None
    container: str = "jsonl"
    compression: str = "none"


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
        self.buf = bytearray()
        self.dec = self._new()
        self.consumed = 0  # compressed bytes read
        self.finished = False  # the compressed input is exhausted
        self.error: Exception | None = None  # raised once everything decoded before it is handed out

    def _new(self):
        if self.kind == "gzip":
            return zlib.decompressobj(wbits=47)
        return zstandard.ZstdDecompressor().decompressobj()

    def _fill(self) -> None:
        raw = self.fh.read(CHUNK)
        self.consumed += len(raw)
        if not raw:
            self.finished = True
            if not self.dec.eof:
                self.error = EOFError(f"{self.kind} stream ends before its end marker (truncated file)")
            return
        member_start = None
        try:
            while raw:
                if self.dec.eof:  # the next member/frame, or garbage after the last one
                    member_start = self.consumed - len(raw)
                    self.dec = self._new()
                self.buf += self.dec.decompress(raw)
                raw = self.dec.unused_data if self.dec.eof else b""
        except (EOFError, OSError, zlib.error, zstandard.ZstdError) as exc:
            where = "" if member_start is None else f" (data after a complete {self.kind} stream, at compressed byte {member_start})"
            self.error = type(exc)(f"{exc}{where}")

    def read(self, n: int) -> bytes:
        while not self.buf and self.error is None and not self.finished:
            self._fill()
        if not self.buf and self.error is not None:
            raise self.error
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


DECOMPRESSION_ERRORS = (EOFError, OSError, zlib.error, zstandard.ZstdError)


def _decompressed(path: str, fh: IO[bytes]) -> tuple[IO[bytes], str]:
    name = path.lower()
    if name.endswith(".gz"):
        return _Decompressor(fh, "gzip"), "gzip"
    if name.endswith((".zst", ".zstd")):
        return _Decompressor(fh, "zstd"), "zstd"
    return fh, "none"


def parse_record(data: bytes) -> tuple[object, str | None]:
    """(value, None) or (None, reason): every way one record's bytes can fail to be JSON, as a reason."""
    try:
        return json.loads(data), None
    except RecursionError:
        return None, "invalid JSON: nested too deeply to parse"
    except UnicodeDecodeError as exc:
        return None, f"invalid UTF-8 at byte {exc.start} of the record ({exc.reason})"
    except ValueError as exc:  # JSONDecodeError, and integers over Python's digit limit
        return None, f"invalid JSON: {exc}"


def safe_text(raw) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
    return text[:RAW_TEXT_LIMIT]


def iter_raw_records(path: str, result: ReadResult, max_record_bytes: int) -> Iterator[RawRecord]:
    """Yield every record of the file; on damage, set `result.damage` and stop (the caller decides).
    A local file that changed while it was read (rewritten in place, replaced, grown or cut) is an error
    after the last record: its records would mix two versions (S3 GETs read one object version)."""
    with open_binary(path) as fh:
        before = _file_identity(path, fh)
        yield from _records(path, fh, result, max_record_bytes)
        if before is not None:
            _check_unchanged(path, fh, before)


def _records(path: str, fh, result: ReadResult, max_record_bytes: int) -> Iterator[RawRecord]:
    stream, result.compression = _decompressed(path, fh)
    reader = _CountingReader(stream)
    try:
        first = reader.read(CHUNK)
    except DECOMPRESSION_ERRORS as exc:
        result.damage = Damage(0, f"cannot decompress ({result.compression}): {exc}")
        return
    head = first.lstrip()
    if head.startswith(b"\xef\xbb\xbf"):  # UTF-8 BOM
        head = head[3:].lstrip()
    result.container = "json-array" if head.startswith(b"[") else "jsonl"
    if result.container == "json-array":
        yield from _ArrayReader(reader, first, result, max_record_bytes).records()
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
            start = scan = nl + 1
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
            result.damage = Damage(reader.offset, f"decompression failed: {exc}")
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
    """The stream ended (or broke) inside the value being scanned."""


class _Mismatch(Exception):
    """A closing bracket that does not match: the container is broken from here on."""


class _ArrayReader:
    """The elements of a top-level JSON array, found by a byte scanner (brackets, strings) and parsed one by
    one. The scanner's state (bracket stack, inside a string) carries over buffer refills, so an element over
    `max_record_bytes` is skipped while it streams past: positions of the element's start go negative once
    its head has been dropped, and `end - start` is still its size."""

    def __init__(self, reader: _CountingReader, first: bytes, result: ReadResult, limit: int):
        self.reader, self.result, self.limit = reader, result, limit
        self.buf, self.base, self.eof = first, 0, False
        self.pos = first.index(b"[") + 1
        self.at = 0  # stream offset of what is being read now, for damage reports

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
            raise _Incomplete(f"decompression failed: {exc}") from None
        self.eof = not data
        self.buf += data
        return keep_from

    def records(self) -> Iterator[RawRecord]:
        index, expect_comma = 0, False
        try:
            while True:
                if expect_comma and (m := _COMMA.match(self.buf, self.pos)) is not None:
                    self.pos, expect_comma = m.end(), False  # the usual case: `,` and the next record
                self._skip_space()
                self.at = self.base + self.pos
                if self.pos >= len(self.buf):
                    raise _Incomplete("file ends inside the JSON array (no closing ']')")
                ch = self.buf[self.pos]
                if ch == _END:
                    return self._check_tail()
                if expect_comma or ch == _COMMA_CHAR:
                    if ch != _COMMA_CHAR or not expect_comma:
                        raise _Mismatch(f"expected a record, ',' or ']', found {chr(ch)!r}")
                    self.pos, expect_comma = self.pos + 1, False
                    continue
                if ch not in _CLOSER and ch != _QUOTE and ch not in _SCALAR_START:
                    raise _Mismatch(f"invalid JSON: unexpected {chr(ch)!r} where a record starts")
                yield self._record(index)
                index, expect_comma = index + 1, True
        except (_Incomplete, _Mismatch) as exc:
            self.result.damage = Damage(self.at, str(exc))

    def _skip_space(self) -> None:
        while True:
            self.pos = _SPACE.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or self.eof:
                return
            self.pos -= self._more(self.pos)

    def _record(self, index: int) -> RawRecord:
        offset, head = self.at, self.buf[self.pos:self.pos + 1000]
        try:
            start, end = self._value_end(self.pos)
        except _Incomplete as exc:
            if not str(exc).startswith("decompression"):
                exc.args = (f"file ends inside record {index} (starting at byte {offset})",)
                self.at = offset
            raise
        self.pos = end
        if end - start > self.limit:
            return _too_big(index, offset, end - start, self.limit, head)
        data = self.buf[start:end]
        value, error = parse_record(data)
        return RawRecord(index, offset, value=value, error=error, raw=None if error is None else safe_text(data))

    def _value_end(self, start: int) -> tuple[int, int]:
        """(start, end) in buf of the value at `start` (start < 0 once an over-limit value's head is dropped)."""
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
                        self.at = self.base + scan - 1
                        raise _Mismatch(f"invalid JSON: unmatched {chr(c)!r} inside a record")
                    if not stack:
                        return start, scan
                    continue
            # need more data: keep the element's bytes unless it is over the limit already
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
                self.result.damage = Damage(self.base + self.pos, "unexpected data after the closing ']'")
                return
            if self.eof:
                return
