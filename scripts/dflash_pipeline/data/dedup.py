"""First-occurrence deduplication of sample ids in bounded memory.

Ids arrive in global order (files in sorted order, rows in file order). Past a fixed buffer they are spilled,
with their global position, to files partitioned by the id's first characters; each partition is then
deduplicated on its own (its rows are still in global order, so the first row of an id is its first
occurrence). Only the duplicates come back, so memory follows the buffer and one partition, not the corpus.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

ROW = np.dtype([("id", "S24"), ("pos", "<i8")])


class Deduplicator:
    def __init__(self, buffer_rows: int = 1 << 18, partitions: int = 64):
        self.buffer_rows, self.partitions = buffer_rows, partitions
        self.buffer: list[np.ndarray] = []
        self.buffered = self.count = 0
        self.dir: tempfile.TemporaryDirectory | None = None

    def add(self, ids: np.ndarray) -> None:
        """The next ids in global order (24-character sample ids as bytes)."""
        if ids.dtype.itemsize > ROW["id"].itemsize:  # would be cut short, and distinct ids could collide
            raise ValueError(f"sample ids longer than {ROW['id'].itemsize} characters")
        rows = np.empty(len(ids), dtype=ROW)
        rows["id"], rows["pos"] = ids, np.arange(self.count, self.count + len(ids))
        self.count += len(ids)
        self.buffer.append(rows)
        self.buffered += len(ids)
        if self.buffered >= self.buffer_rows:
            self._spill()

    def _partition_of(self, rows: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(rows["id"])  # a field of a structured array is strided
        head = ids.view(np.uint8).reshape(len(rows), ids.dtype.itemsize)[:, :2].astype(np.int64)
        return (head[:, 0] * 31 + head[:, 1]) % self.partitions

    def _spill(self) -> None:
        if self.dir is None:
            self.dir = tempfile.TemporaryDirectory(prefix="dflash-dedup-")
        rows = np.concatenate(self.buffer) if self.buffer else np.empty(0, dtype=ROW)
        part = self._partition_of(rows)
        for p in np.unique(part):
            with open(os.path.join(self.dir.name, f"{p}.bin"), "ab") as fh:
                rows[part == p].tofile(fh)
        self.buffer, self.buffered = [], 0

    def _groups(self):
        if self.dir is None:
            yield np.concatenate(self.buffer) if self.buffer else np.empty(0, dtype=ROW)
            return
        self._spill()
        for p in range(self.partitions):
            path = os.path.join(self.dir.name, f"{p}.bin")
            if os.path.exists(path):
                yield np.fromfile(path, dtype=ROW)
        self.dir.cleanup()

    def duplicates(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(positions of duplicate rows, position of each one's first occurrence, their ids), by position."""
        pos, first_pos, ids = [], [], []
        for rows in self._groups():
            if not len(rows):
                continue
            _, first, inverse = np.unique(rows["id"], return_index=True, return_inverse=True)
            first_of = first[inverse.reshape(-1)]
            dup = first_of != np.arange(len(rows))
            pos.append(rows["pos"][dup])
            first_pos.append(rows["pos"][first_of[dup]])
            ids.append(rows["id"][dup])
        if not pos:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, "S24")
        pos, first_pos, ids = np.concatenate(pos), np.concatenate(first_pos), np.concatenate(ids)
        order = np.argsort(pos, kind="stable")
        return pos[order], first_pos[order], ids[order]
