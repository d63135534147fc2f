"""Exactly-once bookkeeping for generation: an append-only journal of finished samples per shard.

Every finished sample (ok, or failed with a reason) is appended to `<journal>.jsonl` as one JSON line.
Appends are batched: records are buffered and written with one `write` + `fsync` every `flush_every`
records or `flush_interval_s` seconds, whichever comes first. A `kill -9` can therefore lose only what was
in flight or in the buffer (at most one batch), never corrupt what was already synced: a torn last line
(no trailing newline, or not JSON) is cut off when the journal is opened again.

The first line is a header with a fingerprint of everything that changes the answers (the weights' identity,
model, sampling parameters, turn mode, thinking, and the record format). A journal written under another
fingerprint is set aside (`*.stale-<time>`), never mixed into the new run.

A line that is not a record of this format (garbage in the middle, an array, a record without a sample id or
status, a second header) is quarantined: moved to `<journal>.quarantine.jsonl` with its byte offset and the
reason, counted and logged; the run goes on with the valid records (the samples of bad lines are generated
again).

Keys are sample ids: a rerun skips every sample already in the journal (the last record of a sample wins, so
a transient failure that is retried later is superseded by its success). When outputs live on S3, the
journal is mirrored in batches to `<mirror>/part-<seq>.jsonl` objects with boto3 from a background thread,
and a fresh node without a local journal restores it from there first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dflash_pipeline import storage
from dflash_pipeline.storage import redact_credentials

LOG = logging.getLogger(__name__)
JOURNAL_VERSION = 1
# the record's shape (columns of client.COMPLETION_SCHEMA): 2 added output_ids and prompt_ids. turn_prompt_ids came
# later without a new format: a record without it reads as null (its row gives its last turn only), so a journal
# written before it still resumes
RECORD_FORMAT = 2
STATUSES = ("ok", "failed")


def fingerprint(settings: dict) -> str:
    canonical = json.dumps({**settings, "record_format": RECORD_FORMAT}, sort_keys=True, separators=(",", ":"),
                           default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def record_problem(rec) -> str | None:
    """Why a parsed journal line is not a sample record (None when it is one)."""
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}, not an object"
    if "journal" in rec:
        return "a second header"
    if not isinstance(rec.get("sample_id"), str) or not rec["sample_id"]:
        return "no sample_id"
    if rec.get("status") not in STATUSES:
        return f"status {rec.get('status')!r} is not one of {', '.join(STATUSES)}"
    if not isinstance(rec.get("messages"), list):
        return "no messages list"
    return None


class S3Mirror:
    """Uploads journal lines to S3 in batches (one object per batch) from a background thread."""

    def __init__(self, uri: str, interval_s: float = 30.0):
        if not storage.is_s3(uri):
            raise ValueError(f"journal mirror must be an s3:// URI, got {uri!r}")
        self.bucket, prefix = storage.split_s3(uri)
        self.prefix = prefix.rstrip("/") + "/" if prefix else ""
        self.interval_s = interval_s
        self._client = storage.s3_client()
        self._pending: list[bytes] = []
        self._lock = threading.Lock()
        self._seq = self._next_seq()
        self._wake = threading.Event()
        self._stop = False
        self._errors = 0
        self._thread = threading.Thread(target=self._loop, name="journal-s3-mirror", daemon=True)
        self._thread.start()

    def _list_parts(self) -> list[str]:
        keys, token = [], None
        while True:
            kwargs = {"Bucket": self.bucket, "Prefix": self.prefix + "part-"}
            if token:
                kwargs["ContinuationToken"] = token
            resp = self._client.list_objects_v2(**kwargs)
            keys.extend(obj["Key"] for obj in resp.get("Contents", []))
            if not resp.get("IsTruncated"):
                return sorted(keys)
            token = resp["NextContinuationToken"]

    def _next_seq(self) -> int:
        parts = self._list_parts()
        if not parts:
            return 0
        return int(parts[-1].rsplit("part-", 1)[1].split(".")[0].split("-")[0]) + 1

    def restore_lines(self) -> list[bytes]:
        """Every line ever mirrored, in upload order."""
        lines: list[bytes] = []
        for key in self._list_parts():
            body = self._client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            lines.extend(line + b"\n" for line in body.split(b"\n") if line.strip())
        return lines

    def add(self, data: bytes) -> None:
        with self._lock:
            self._pending.append(data)

    def _upload_pending(self) -> None:
        with self._lock:
            if not self._pending:
                return
            body, self._pending = b"".join(self._pending), []
            key = f"{self.prefix}part-{self._seq:08d}-{os.getpid()}.jsonl"
            self._seq += 1
        for attempt in range(5):
            try:
                self._client.put_object(Bucket=self.bucket, Key=key, Body=body)
                return
            except Exception as exc:  # network trouble: keep the batch, try again later
                self._errors += 1
                LOG.warning("journal mirror upload to s3://%s/%s failed (%s), attempt %d", self.bucket, key,
                            type(exc).__name__, attempt + 1)
                time.sleep(min(30.0, 0.5 * 2**attempt))
        with self._lock:  # put it back in front: the next upload carries it
            self._pending.insert(0, body)

    def _loop(self) -> None:
        while not self._stop:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self._upload_pending()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join()
        self._upload_pending()


class Journal:
    """The per-shard journal. `done` maps sample id -> the last record written for it."""

    def __init__(self, path: str | os.PathLike, shard: str, settings: dict, *, flush_every: int = 32,
                 flush_interval_s: float = 2.0, mirror: str | None = None, mirror_interval_s: float = 30.0):
        self.path = Path(path)
        self.shard = shard
        self.fingerprint = fingerprint(settings)
        self.flush_every = max(1, flush_every)
        self.flush_interval_s = flush_interval_s
        self.done: dict[str, dict] = {}
        self.quarantined = 0
        self._buffer: list[bytes] = []
        self._last_flush = time.monotonic()
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"journal-{shard}")
        self._pending = None
        self.mirror = None
        if mirror:
            try:
                self.mirror = S3Mirror(mirror, mirror_interval_s)
            except Exception as exc:  # the local journal still gives exactly-once on this node
                LOG.error("%s: journal mirror %s is not usable (%s: %s); continuing with the local journal only",
                          shard, redact_credentials(mirror), type(exc).__name__, redact_credentials(str(exc))[:200])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.mirror and not self.path.exists():
            self._restore_from_mirror()
        self._open(settings)

    # -- opening and recovery ------------------------------------------------------------------------
    def _restore_from_mirror(self) -> None:
        lines = self.mirror.restore_lines()
        keep, header, current = [], None, None
        for line in lines:
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):
                rec = None
            if isinstance(rec, dict) and "journal" in rec:
                current = rec.get("fingerprint")
                if current == self.fingerprint and header is None:
                    header = line
            elif current == self.fingerprint:
                keep.append(line)  # bad lines come along and are quarantined when the journal is opened
        if header is None:
            return
        LOG.info("%s: restoring %d journal records from the S3 mirror", self.shard, len(keep))
        with storage.atomic_open(self.path, "wb") as fh:
            fh.writelines([header] + keep)

    def _open(self, settings: dict) -> None:
        header = None
        if self.path.exists():
            header, valid_end, size, bad = self._read_existing()
            if header is None or header.get("fingerprint") != self.fingerprint:
                self._set_aside(header is not None or valid_end > 0)
                header = None
            else:
                if bad:
                    self._quarantine(bad)
                if bad or valid_end < size:
                    self._rewrite_valid(bad, valid_end, size)
        self._fh = open(self.path, "ab")
        if header is None:
            self._write_header(settings)

    def _read_existing(self) -> tuple[dict | None, int, int, list]:
        """(header, end of the last complete line, file size, bad lines as (offset, line, reason)); fills done.
        A last line without its newline is a torn tail (a kill in the middle of a write), not a bad line."""
        data = self.path.read_bytes()
        header, pos, bad = None, 0, []
        while pos < len(data):
            nl = data.find(b"\n", pos)
            if nl < 0:
                break  # torn tail
            line = data[pos:nl]
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):
                rec, problem = None, "not JSON"
            else:
                problem = None if header is None else record_problem(rec)
            if header is None and problem is None and isinstance(rec, dict) and "journal" in rec:
                header = rec
                if rec.get("fingerprint") != self.fingerprint:
                    return header, nl + 1, len(data), bad
            elif header is None:
                return None, 0, len(data), bad  # no header: not one of our journals
            elif problem:
                bad.append((pos, line, problem))
            else:
                self.done[rec["sample_id"]] = rec
            pos = nl + 1
        return header, pos, len(data), bad

    def _set_aside(self, keep: bool) -> None:
        if keep:
            stale = self.path.with_name(self.path.name + f".stale-{int(time.time())}")
            LOG.warning("%s: journal %s was written with other generation settings (weights, sampling or record "
                        "format); set aside as %s", self.shard, self.path, stale.name)
            os.replace(self.path, stale)
        else:
            self.path.unlink()
        self.done.clear()

    def _quarantine(self, bad: list) -> None:
        side = self.path.with_name(self.path.name.removesuffix(".jsonl") + ".quarantine.jsonl")
        with open(side, "ab") as fh:
            for offset, line, reason in bad:
                fh.write(json.dumps({"journal": str(self.path), "offset": offset, "reason": reason,
                                     "line": line.decode("utf-8", "replace")}).encode("utf-8") + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        self.quarantined = len(bad)
        LOG.warning("%s: %d bad journal line(s) quarantined to %s (first at byte %d: %s); their samples are "
                    "generated again", self.shard, len(bad), side, bad[0][0], bad[0][2])

    def _rewrite_valid(self, bad: list, valid_end: int, size: int) -> None:
        """The journal without its bad lines and torn tail (atomically), so the next open finds it clean."""
        if valid_end < size:
            LOG.warning("%s: cutting a torn journal tail (%d bytes)", self.shard, size - valid_end)
        data = self.path.read_bytes()[:valid_end]
        for offset, line, _ in sorted(bad, reverse=True):
            data = data[:offset] + data[offset + len(line) + 1:]
        with storage.atomic_open(self.path, "wb") as fh:
            fh.write(data)

    def _write_header(self, settings: dict) -> None:
        line = json.dumps({"journal": JOURNAL_VERSION, "record_format": RECORD_FORMAT, "shard": self.shard,
                           "fingerprint": self.fingerprint, "settings": settings}, default=str).encode("utf-8") + b"\n"
        self._fh.write(line)
        self._fh.flush()
        os.fsync(self._fh.fileno())
        _fsync_dir(self.path.parent)  # the new file's name is durable too
        if self.mirror:
            self.mirror.add(line)

    # -- appending -----------------------------------------------------------------------------------
    # Writes and fsyncs run on one background thread (in order), so the event loop never waits for the
    # disk; `flush()` and `close()` wait until everything handed over is durable.
    def add(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"
        with self._lock:
            self.done[record["sample_id"]] = record
            self._buffer.append(line)
            due = len(self._buffer) >= self.flush_every or (
                time.monotonic() - self._last_flush >= self.flush_interval_s)
        if due:
            self._hand_over()

    def _hand_over(self):
        with self._lock:
            self._last_flush = time.monotonic()
            if not self._buffer:
                return self._pending
            data, self._buffer = b"".join(self._buffer), []
            self._pending = self._writer.submit(self._write, data)
            return self._pending

    def _write(self, data: bytes) -> None:
        self._fh.write(data)
        self._fh.flush()
        os.fsync(self._fh.fileno())
        if self.mirror:
            self.mirror.add(data)

    def flush(self) -> None:
        """Everything added so far is on disk when this returns."""
        pending = self._hand_over()
        if pending is not None:
            pending.result()

    def maybe_flush(self) -> None:
        if self._buffer and time.monotonic() - self._last_flush >= self.flush_interval_s:
            self._hand_over()

    def close(self) -> None:
        self.flush()
        self._writer.shutdown(wait=True)
        self._fh.close()
        if self.mirror:
            self.mirror.close()
