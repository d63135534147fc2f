"""Bounded-memory statistics for the audit: binned histograms and exact counts of answer hashes.

Tokenize writes them per shard; the audit stage merges them. Nothing here grows with the number of samples
in memory: a histogram has at most a few thousand bins whatever the values, and answer counts spill to
hash-partitioned files on disk past a fixed buffer, then are counted one partition at a time.
"""

from __future__ import annotations

import hashlib
import heapq
import os
import re
import tempfile
from collections import Counter

import numpy as np

AUDIT_FORMAT = 2  # per-shard audit layout; 2: binned histograms and answer-hash counts (1 held per-sample lists)
ANSWER_KEY_CHARS = 80
EXACT_BELOW = 256  # histogram values below this are their own bin; above, 8 significant bits (< 1% error)
TEXTS_KEPT = 10_000  # answer texts remembered for the report (placeholders repeat, so they come early)


def answer_key(text: str) -> str:
    """Normalized final answer: short answers verbatim (readable in the report), long ones hashed."""
    norm = re.sub(r"\s+", " ", text.strip().lower())
    if len(norm) <= ANSWER_KEY_CHARS:
        return norm
    return "sha:" + hashlib.blake2b(norm.encode("utf-8"), digest_size=8).hexdigest()


def answer_hash(key: str) -> str:
    """64-bit hash of an answer key, as 16 hex digits (what shards and the audit count)."""
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def bin_of(value: int) -> int:
    value = int(value)
    if value < EXACT_BELOW:
        return value
    shift = value.bit_length() - 8
    return (value >> shift) << shift


class Histogram(Counter):
    """value bin -> samples; JSON keys are strings."""

    def add(self, value: int) -> None:
        self[bin_of(value)] += 1

    def to_json(self) -> dict:
        return {str(k): v for k, v in sorted(self.items())}

    def merge_json(self, data: dict) -> None:
        for k, v in data.items():
            self[int(k)] += v


class HashCounter:
    """Exact counts of 64-bit hashes in bounded memory: (hash, count) pairs are buffered, spilled to
    `partitions` files by the hash's top bits, and each partition is counted on its own at the end."""

    def __init__(self, buffer_pairs: int = 1 << 20, partitions: int = 64):
        self.buffer_pairs, self.partitions = buffer_pairs, partitions
        self.hashes: list[int] = []
        self.counts: list[int] = []
        self.dir: tempfile.TemporaryDirectory | None = None
        self.total = 0

    def add_many(self, counts: dict[str, int]) -> None:
        for h, c in counts.items():
            self.hashes.append(int(h, 16))
            self.counts.append(c)
            self.total += c
        if len(self.hashes) >= self.buffer_pairs:
            self._spill()

    def _spill(self) -> None:
        if self.dir is None:
            self.dir = tempfile.TemporaryDirectory(prefix="dflash-audit-")
        h = np.array(self.hashes, dtype=np.uint64)
        c = np.array(self.counts, dtype=np.int64)
        part = (h >> np.uint64(58)).astype(np.int64) % self.partitions
        for p in np.unique(part):
            sel = part == p
            with open(os.path.join(self.dir.name, f"{p}.bin"), "ab") as fh:
                np.stack([h[sel], c[sel].astype(np.uint64)], axis=1).tofile(fh)
        self.hashes, self.counts = [], []

    def _partitions(self):
        if self.dir is None:
            yield np.array(self.hashes, dtype=np.uint64), np.array(self.counts, dtype=np.int64)
            return
        self._spill()
        for p in range(self.partitions):
            path = os.path.join(self.dir.name, f"{p}.bin")
            if os.path.exists(path):
                pairs = np.fromfile(path, dtype=np.uint64).reshape(-1, 2)
                yield pairs[:, 0], pairs[:, 1].astype(np.int64)
        self.dir.cleanup()

    def summarize(self, min_repeats: int, top: int = 50) -> tuple[int, list[tuple[str, int]]]:
        """(samples whose hash occurs >= min_repeats times, the `top` most frequent hashes with counts)."""
        repeated, best = 0, []
        for h, c in self._partitions():
            if not len(h):
                continue
            uniq, inverse = np.unique(h, return_inverse=True)
            sums = np.bincount(inverse.reshape(-1), weights=c).astype(np.int64)
            repeated += int(sums[sums >= min_repeats].sum())
            order = np.argsort(-sums, kind="stable")[:top]
            best = heapq.nlargest(top, best + [(int(sums[i]), f"{int(uniq[i]):016x}") for i in order])
        return repeated, [(h, c) for c, h in best]
