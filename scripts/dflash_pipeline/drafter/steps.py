"""Which samples and anchors each optimizer step uses, built one step ahead in a thread.

Everything random is drawn from generators seeded by (seed, epoch, position), so the data of step n is a
function of n alone: a resumed run sees exactly the batches an uninterrupted run sees.
"""

from __future__ import annotations

import threading
from queue import Queue

import torch

from dflash_pipeline.drafter.batch import sample_anchors
from dflash_pipeline.drafter.sources import check_token_range, derived_seed, epoch_order


class StepData:
    """Micro-batches (samples, anchors) of this rank's share of one optimizer step."""

    def __init__(self, source, *, seed: int, batch_size: int, grad_accum: int, num_anchors: int, rank: int,
                 world: int, vocab_rows: int):
        self.source, self.seed, self.batch_size, self.grad_accum = source, seed, batch_size, grad_accum
        self.num_anchors, self.rank, self.world, self.vocab_rows = num_anchors, rank, world, vocab_rows
        self.global_batch = batch_size * grad_accum * world
        self.steps_per_epoch = len(source) // self.global_batch
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            self._orders = {epoch: epoch_order(self.source, self.seed, epoch)}
        return self._orders[epoch]

    def __call__(self, step: int) -> list[tuple[list[dict], list[torch.Tensor]]]:
        epoch, off = divmod(step, self.steps_per_epoch)
        order = self._order(epoch)
        mine = list(range(off * self.global_batch, (off + 1) * self.global_batch))[self.rank::self.world]
        micro = []
        for m in range(self.grad_accum):
            samples, anchors = [], []
            for pos in mine[m * self.batch_size:(m + 1) * self.batch_size]:
                x = self.source.get(order[pos])
                check_token_range(x, self.vocab_rows)
                g = torch.Generator().manual_seed(derived_seed(self.seed, epoch, pos, 2))
                samples.append(x)
                anchors.append(sample_anchors(x["loss_mask"], self.num_anchors, g))
            micro.append((samples, anchors))
        return micro


class Prefetcher:
    """Builds the next step's micro-batches (shard reads, decoding, collation) while the GPU works."""

    def __init__(self, fn):
        self.fn = fn
        self.q: Queue = Queue(maxsize=1)
        self.thread = None

    def start(self, key):
        def work():
            try:
                self.q.put((key, self.fn(key), None))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                self.q.put((key, None, exc))

        self.thread = threading.Thread(target=work, daemon=True)
        self.thread.start()

    def get(self):
        key, value, exc = self.q.get()
        if exc is not None:
            raise exc
        return key, value
