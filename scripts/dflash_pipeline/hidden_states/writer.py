"""Writing a hidden-state shard (layout.py), resumably.

`HiddenStateShardWriter(path, ..., resume=True)` appends records to `path + ".partial"` and, on each
`flush()`, fsyncs it and appends the new index entries to `path + ".journal"` (one JSON line per flush, with
its own CRC). The journal's first line states the metadata and codec: a partial file written with any other
(another target, other input tokens, another codec) is never resumed. After a kill a new writer truncates the
partial file to the last journaled record and reports `completed_ids`; `close()` writes index and footer and
renames the partial file into place, so the final name only ever holds a complete file.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Iterable

import zstandard

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.hidden_states.codec import DEFAULT_LEVEL, Codec, EncodedSample, crc_chain
from dflash_pipeline.hidden_states.layout import (
    FOOTER,
    FOOTER_MAGIC,
    HEADER_SIZE,
    INDEX_COLUMNS,
    INDEX_RAW_LENGTH_OFFSET,
    VERSION,
    align,
    pack_header,
)


def _journal_lines(path: Path) -> list[str]:
    """The journal's intact lines (each with a matching CRC), up to the first torn or damaged one."""
    lines = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.endswith("\n"):
                break  # torn last line
            crc, _, text = line.rstrip("\n").partition(" ")
            try:
                ok = int(crc, 16) == zlib.crc32(text.encode()) & 0xFFFFFFFF
            except ValueError:
                ok = False
            if not ok:
                break
            lines.append(text)
    return lines


def _journal_columns(lines: list[str]) -> dict[str, list] | None:
    """The index entries the journal lines hold, or None when a line is not what this writer journals."""
    cols: dict[str, list] = {c: [] for c in INDEX_COLUMNS}
    try:
        for text in lines:
            entries = json.loads(text)
            if len({len(entries[c]) for c in INDEX_COLUMNS}) != 1:
                return None
            for c in INDEX_COLUMNS:
                cols[c].extend(entries[c])
    except (ValueError, KeyError, TypeError):
        return None
    return cols


class HiddenStateShardWriter:
    """Writes one shard file; `add()` samples (or `add_encoded()` from a worker pool), then `close()`.

    metadata: a JSON-able dict; must contain target_layer_ids, hidden_size, num_layers (of the target) and
    model_path (stored as given). `dtype` and the codec settings are added.
    """

    def __init__(self, path: str | os.PathLike, metadata: dict, codec: str = "zstd", level: int = DEFAULT_LEVEL,
                 dtype: str = "bfloat16", compress_mantissa: bool = False, resume: bool = False):
        self.path = Path(path)
        self.codec = Codec(codec, level, dtype, compress_mantissa)
        self.metadata = dict(metadata)
        for key in ("target_layer_ids", "hidden_size"):
            if key not in self.metadata:
                raise PipelineError(f"hidden-state shard metadata needs {key!r}")
        self.metadata["dtype"] = dtype
        self.metadata["num_feature_layers"] = len(self.metadata["target_layer_ids"])
        self.partial = Path(str(self.path) + ".partial")
        self.journal = Path(str(self.path) + ".journal")
        self._cols: dict[str, list] = {c: [] for c in INDEX_COLUMNS}
        self._journaled = 0
        self._queued = 0  # entries handed to a flush (journaled once it completes)
        self._syncer = None
        self._pending: list = []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._header_line = json.dumps({"metadata": self.metadata, "codec": self.codec.describe(),
                                        "format": VERSION}, sort_keys=True)
        if not (resume and self._resume()):
            self._start()
        self._closed = False

    # -- starting and resuming
    def _start(self) -> None:
        self._fh = open(self.partial, "wb")
        self._fh.write(pack_header())
        self._pos = HEADER_SIZE
        self._journal_fh = open(self.journal, "w", encoding="utf-8")
        self._write_journal_line(self._header_line)

    def _write_journal_line(self, text: str) -> None:
        crc = zlib.crc32(text.encode()) & 0xFFFFFFFF
        self._journal_fh.write(f"{crc:08x} {text}\n")
        self._journal_fh.flush()
        os.fsync(self._journal_fh.fileno())

    def _resume(self) -> bool:
        if not (self.partial.exists() and self.journal.exists()):
            return False
        lines = _journal_lines(self.journal)
        if not lines or lines[0] != self._header_line:
            return False  # other settings, other inputs, or nothing usable: start over
        cols = _journal_columns(lines[1:])
        if cols is None:
            return False
        end = align(cols["offsets"][-1] + cols["lengths"][-1]) if cols["offsets"] else HEADER_SIZE
        if self.partial.stat().st_size < end:
            return False
        self._cols = cols
        self._fh = open(self.partial, "r+b")
        self._fh.truncate(end)
        self._fh.seek(end)
        self._pos = end
        self._journaled = self._queued = len(cols["offsets"])
        self._journal_fh = open(self.journal, "w", encoding="utf-8")  # rewritten without any torn tail
        self._write_journal_line(self._header_line)
        if self._journaled:
            self._write_journal_line(json.dumps(cols))
        return True

    @property
    def completed_ids(self) -> set[str]:
        """Samples durably written (journaled); after a resume these are the ones to skip."""
        return set(self._cols["sample_ids"][: self._journaled])

    def __len__(self) -> int:
        return len(self._cols["sample_ids"])

    # -- writing
    def encode(self, *args, **kwargs) -> EncodedSample:
        return self.codec.encode(*args, **kwargs)

    def add(self, sample_id: str, input_ids, loss_mask, hidden=None, **kwargs) -> None:
        self.add_encoded(self.codec.encode(sample_id, input_ids, loss_mask, hidden, **kwargs))

    def add_encoded(self, enc: EncodedSample) -> None:
        if self._closed:
            raise PipelineError("writer is closed")
        offset = self._pos
        rel = 0
        sections = []
        parts = []
        for payload, raw_len in enc.sections:
            mv = memoryview(payload).cast("B")
            sections.append([rel, len(mv), raw_len])
            parts.append(mv)
            rel += len(mv)
        crc = enc.crc32 if enc.crc32 >= 0 else crc_chain(parts)
        for mv in parts:
            self._fh.write(mv)
        pad = align(offset + rel) - (offset + rel)
        if pad:
            self._fh.write(bytes(pad))
        self._pos = offset + rel + pad
        for c, v in zip(INDEX_COLUMNS, (enc.sample_id, offset, rel, enc.num_tokens, crc, sections)):
            self._cols[c].append(v)

    def flush(self, background: bool = False) -> None:
        """Make everything added so far durable and resumable. With `background`, the fsync and the
        journal line happen in a helper thread while the caller keeps appending (an fsync covers at least
        the bytes written before it started); `close()` waits for it."""
        self._fh.flush()
        n = len(self)
        if n <= self._queued:
            return
        new = {c: list(self._cols[c][self._queued:n]) for c in INDEX_COLUMNS}
        self._queued = n
        if not background:
            while self._pending:  # journal lines stay in order: earlier background syncs first
                self._pending.pop(0).result()
            self._sync(new, n)
            return
        if self._syncer is None:
            import concurrent.futures as cf

            self._syncer = cf.ThreadPoolExecutor(1, thread_name_prefix="fsync")
        self._pending.append(self._syncer.submit(self._sync, new, n))
        while self._pending and self._pending[0].done():
            self._pending.pop(0).result()

    def _sync(self, new: dict, n: int) -> None:
        os.fsync(self._fh.fileno())
        self._write_journal_line(json.dumps(new))
        self._journaled = n

    def _wait_syncs(self) -> None:
        while self._pending:
            self._pending.pop(0).result()
        if self._syncer is not None:
            self._syncer.shutdown(wait=True)
            self._syncer = None

    # -- finishing
    def close(self) -> None:
        if self._closed:
            return
        self._fh.flush()
        self._wait_syncs()
        ids = self._cols["sample_ids"]
        if len(set(ids)) != len(ids):
            raise PipelineError(f"{self.path}: duplicate sample ids in shard")
        index = json.dumps({"metadata": self.metadata, "codec": self.codec.describe(),
                           "samples": {c: self._cols[c] for c in INDEX_COLUMNS}}).encode()
        blob = zstandard.ZstdCompressor(level=3).compress(index)
        self._fh.write(blob)
        self._fh.write(FOOTER.pack(self._pos, len(blob), zlib.crc32(blob) & 0xFFFFFFFF, VERSION, FOOTER_MAGIC))
        self._fh.flush()
        os.pwrite(self._fh.fileno(), len(index).to_bytes(8, "little"), INDEX_RAW_LENGTH_OFFSET)
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._journal_fh.close()
        os.replace(self.partial, self.path)
        self.journal.unlink(missing_ok=True)
        self._closed = True

    def abort(self) -> None:
        """Close the files without finishing (the partial file and journal stay for a resume)."""
        if not self._closed:
            try:
                self._fh.flush()
                self._wait_syncs()
            finally:
                self._fh.close()
                self._journal_fh.close()
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_shard(path, samples: Iterable[dict], metadata: dict, codec: str = "zstd", level: int = DEFAULT_LEVEL,
                dtype: str = "bfloat16") -> None:
    """Write dicts (sample_id, input_ids, loss_mask, hidden) to a new shard file."""
    with HiddenStateShardWriter(path, metadata, codec=codec, level=level, dtype=dtype) as w:
        for s in samples:
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden"])
