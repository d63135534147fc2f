"""Exactly-once bookkeeping for generation: an append-only journal of finished samples per shard.

Every finished sample (ok, or failed with a reason) is appended to `<journal>.jsonl` as one JSON line.
Appends are batched: records are buffered and written with one `write` + `fsync` every `flush_every`
records or `flush_interval_s` seconds, whichever comes first. A `kill -9` can therefore lose only what was
in flight or in the buffer (at most one batch), never corrupt what was already synced: a torn last line
(no trailing newline, or not JSON) is cut off when the journal is opened again.

The first line is a header with a fingerprint of everything that changes the answers (model, sampling
parameters, turn mode, thinking). A journal written under another fingerprint is set aside
(`*.stale-<time>`), never mixed into the new run.

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

LOG = logging.getLogger(__name__)
JOURNAL_VERSION = 1


def fingerprint(settings: dict) -> str:
    canonical = json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


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
                          shard, mirror, type(exc).__name__, str(exc)[:200])
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
            except ValueError:
                continue  # an object cut short cannot happen with put_object; be lenient anyway
            if "journal" in rec:
                current = rec.get("fingerprint")
                if current == self.fingerprint and header is None:
                    header = line
            elif current == self.fingerprint:
                keep.append(line)
        if header is None:
            return
        LOG.info("%s: restoring %d journal records from the S3 mirror", self.shard, len(keep))
        with storage.atomic_open(self.path, "wb") as fh:
            fh.writelines([header] + keep)

    def _open(self, settings: dict) -> None:
        header = None
        valid_end = 0
        if self.path.exists():
            with open(self.path, "rb") as fh:
                data = fh.read()
            pos = 0
            while pos < len(data):
                nl = data.find(b"\n", pos)
                if nl < 0:
                    break  # torn tail: no newline
                line = data[pos:nl]
                try:
                    rec = json.loads(line)
                except ValueError:
                    rest = data[nl + 1:]
                    if rest.strip():
                        raise RuntimeError(f"{self.path}: corrupt journal line at byte {pos} (not at the end)")
                    break  # torn tail
                if header is None:
                    header = rec
                    if rec.get("fingerprint") != self.fingerprint:
                        break
                else:
                    self.done[rec["sample_id"]] = rec
                pos = nl + 1
                valid_end = pos
            if header is None or header.get("fingerprint") != self.fingerprint:
                if header is not None or valid_end:
                    stale = self.path.with_name(self.path.name + f".stale-{int(time.time())}")
                    LOG.warning("%s: journal %s was written with other generation settings; set aside as %s",
                                self.shard, self.path, stale.name)
                    os.replace(self.path, stale)
                else:
                    self.path.unlink()
                self.done.clear()
                header = None
            elif valid_end < len(data):
                LOG.warning("%s: cutting a torn journal tail (%d bytes)", self.shard, len(data) - valid_end)
                with open(self.path, "rb+") as fh:
                    fh.truncate(valid_end)
                    os.fsync(fh.fileno())
        self._fh = open(self.path, "ab")
        if header is None:
            line = json.dumps({"journal": JOURNAL_VERSION, "shard": self.shard, "fingerprint": self.fingerprint,
                               "settings": settings}, default=str).encode("utf-8") + b"\n"
            self._fh.write(line)
            self._fh.flush()
            os.fsync(self._fh.fileno())
            storage._fsync_dir(self.path.parent)
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
