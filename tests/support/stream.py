"""Streaming the samples of many hidden-state shards, decoded ahead by background threads."""

from __future__ import annotations

import random
import threading
from typing import Iterator, Sequence

from dflash_pipeline.hidden_states.reader import HiddenStateShardReader

_DONE, _ERR = object(), object()


def _plan(paths: list[str], rng: random.Random | None, verify: bool, opened: set):
    """(reader, sample index, is the reader's last job) in reading order; readers open one shard at a time."""
    for path in paths:
        reader = HiddenStateShardReader(path, verify=verify)
        opened.add(reader)
        idx = list(range(len(reader)))
        if rng is not None:
            rng.shuffle(idx)
        if not idx:
            reader.close()
        for k, i in enumerate(idx):
            yield reader, i, k == len(idx) - 1


class _Prefetcher:
    """Worker threads take jobs in plan order and decode them; results come out in plan order, at most
    `ahead` results before the one the consumer waits for (tickets numbered by job)."""

    def __init__(self, jobs, workers: int, ahead: int):
        self.jobs, self.ahead = jobs, ahead
        self.job_lock = threading.Lock()
        self.cond = threading.Condition()
        self.tickets: dict[int, tuple] = {}
        self.next_job = self.consumed = 0
        self.stopped = False
        self.threads = [threading.Thread(target=self._work, daemon=True) for _ in range(workers)]
        for th in self.threads:
            th.start()

    def _take_job(self):
        """(ticket, reader, i, last), or None after posting the end of the plan (or the error opening a shard)."""
        with self.job_lock:
            if self.stopped:
                return None
            n = self.next_job
            try:
                reader, i, last = next(self.jobs)
            except BaseException as exc:  # StopIteration, or opening a shard failed
                self.stopped = True
                self._post(n, (_DONE, None) if isinstance(exc, StopIteration) else (_ERR, exc), wait=False)
                return None
            self.next_job += 1
            return n, reader, i, last

    def _post(self, n: int, item: tuple, wait: bool = True) -> None:
        with self.cond:
            while wait and n - self.consumed >= self.ahead and not self.stopped:
                self.cond.wait()
            self.tickets[n] = item
            self.cond.notify_all()

    def _work(self) -> None:
        while (job := self._take_job()) is not None:
            n, reader, i, last = job
            try:
                item = (reader if last else None, reader.read(i))
            except BaseException as exc:
                item = (_ERR, exc)
            self._post(n, item)

    def results(self) -> Iterator[tuple]:
        """(reader to close after this sample or None, sample) in plan order; raises a worker's error."""
        while True:
            with self.cond:
                while self.consumed not in self.tickets:
                    self.cond.wait()
                kind, value = self.tickets.pop(self.consumed)
                self.consumed += 1
                self.cond.notify_all()
            if kind is _DONE:
                return
            if kind is _ERR:
                raise value
            yield kind, value

    def stop(self) -> None:
        with self.job_lock:  # once this returns, no worker advances the plan (opens a shard) any more
            self.stopped = True
        with self.cond:
            self.cond.notify_all()


def iter_shard_samples(paths: Sequence[str], seed: int | None = None, prefetch: int = 4,
                       verify: bool = True, workers: int = 4) -> Iterator[dict]:
    """Stream samples of several shards (local or s3://), decoded by background threads `prefetch` ahead.

    seed=None: shards in the given order, samples in file order. With a seed, the shard order and the
    order inside each shard are shuffled (deterministically for that seed). Errors in a background thread
    are raised in the caller. A shard's file is closed once its last sample is out.
    """
    rng = random.Random(seed) if seed is not None else None
    order = [str(p) for p in paths]
    if rng is not None:
        rng.shuffle(order)
    opened: set = set()
    prefetcher = _Prefetcher(_plan(order, rng, verify, opened), max(1, workers), max(1, int(prefetch)))
    try:
        for finished, sample in prefetcher.results():
            if finished is not None:
                finished.close()
            yield sample
    finally:
        prefetcher.stop()
        for reader in list(opened):
            reader.close()
