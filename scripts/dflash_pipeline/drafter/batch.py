"""Anchors and padded batches.

Anchors: up to `num_anchors` random positions p of a sample whose token and next token are both supervised
(loss_mask[p] = loss_mask[p + 1] = 1): the block anchored at p scores labels p + 1 ..., so an anchor on a
turn's last supervised token would train nothing (5.1% of the former candidates on the demo data,
benchmarks/wasted_anchors.py). Drawn from a generator seeded by (seed, epoch, position in the epoch): a resumed
run draws the same anchors as an uninterrupted one. A batch packs all blocks of each sequence into one
forward (see masks.py for who sees what).

Two layouts: `collate` pads every sample to one row ([B, S], blocks [B, N]); `collate_packed` puts all samples
of a micro-batch end to end in one row ([1, sum of lengths], blocks [1, sum of anchors]), rounded up to
multiples only, so the drafter computes the blocks that are trained and no padding blocks (at ShareGPT
lengths a padded GPU batch of 512 blocks per row computed ~2x the blocks it trained: docs/training.md,
"Training at small shapes"). Same attention visibility and loss, sample by sample.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from dflash_pipeline.drafter.head_loss import chunk_spans


def anchor_candidates(loss_mask) -> np.ndarray:
    """Positions p whose block scores something: loss_mask[p] and loss_mask[p + 1] both set."""
    m = np.asarray(loss_mask) > 0
    return np.flatnonzero(m[:-1] & m[1:])


def sample_anchors(loss_mask: np.ndarray, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Sorted anchor positions among `anchor_candidates`, at most num_anchors."""
    valid = anchor_candidates(loss_mask)
    if len(valid) > num_anchors:
        pick = torch.randperm(len(valid), generator=generator)[:num_anchors].numpy()
        valid = np.sort(valid[pick])
    return torch.as_tensor(valid, dtype=torch.long)


@dataclass
class Batch:
    input_ids: torch.Tensor      # [B, S] long (padded with 0)
    loss_mask: torch.Tensor      # [B, S] float
    lengths: torch.Tensor        # [B] long
    anchors: torch.Tensor        # [B, N] long (0 where not valid)
    block_valid: torch.Tensor    # [B, N] bool
    features: torch.Tensor | None  # [B, S, n*H] (offline) or None (online: computed by the target)
    # packed layout only (None: one sample per row, positions 0.., blocks see keys [0, anchor), labels < length)
    positions: torch.Tensor | None = None    # [B, S] position of each token inside its own sample
    block_start: torch.Tensor | None = None  # [B, N] first token of the block's sample
    block_end: torch.Tensor | None = None    # [B, N] end (exclusive) of the block's sample
    sample_spans: torch.Tensor | None = None  # [samples, 2] (offset, length) of each sample in the packed row
    # the scored block positions, flat indices into [B * N * block_size] (with_scored_index: computed on the host,
    # so the loss selects them without a device synchronisation); None: the loss computes them
    scored_index: torch.Tensor | None = None
    # soft labels (with_scored_index(soft_chunk=)): the positions the scored tokens read the target's distribution
    # at, each once (flat into [B * S], sorted), each scored token's one among them, and per head chunk the span
    # of them its tokens read (head_loss.chunk_spans): the head then runs once per position, not per block
    soft_rows: torch.Tensor | None = None
    soft_inverse: torch.Tensor | None = None
    soft_spans: tuple = ()
    max_sample: int = 0                       # the longest sample's length (online: the target's padded width)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def num_samples(self) -> int:
        """Samples in the batch, from shapes alone (no device synchronisation): rows, or the packed spans."""
        return int(self.sample_spans.shape[0] if self.sample_spans is not None else self.input_ids.shape[0])

    def _map(self, fn) -> "Batch":
        """The batch with `fn` applied to each of its tensors (the host-side fields kept)."""
        return replace(self, **{f.name: fn(t) for f in fields(self)
                                if isinstance(t := getattr(self, f.name), torch.Tensor)})

    def to(self, device) -> "Batch":
        return self._map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> "Batch":
        """Page-locked host copies (CPU -> GPU copies then run asynchronously, `to(non_blocking)`)."""
        return self._map(lambda t: t.pin_memory())


def collate(samples: list[dict], anchors: list[torch.Tensor], pad_multiple: int = 1, num_blocks: int = 0) -> Batch:
    """Pad a batch; `pad_multiple` rounds the sequence length up and `num_blocks` fixes the block count, so
    compiled kernels (flex attention, torch.compile on GPU) see few distinct shapes instead of one per batch."""
    b = len(samples)
    s = max(len(x["input_ids"]) for x in samples)
    s = -(-s // pad_multiple) * pad_multiple
    n = max(1, num_blocks, max(len(a) for a in anchors))
    input_ids = torch.zeros(b, s, dtype=torch.long)
    loss_mask = torch.zeros(b, s, dtype=torch.float32)
    lengths = torch.zeros(b, dtype=torch.long)
    anc = torch.zeros(b, n, dtype=torch.long)
    valid = torch.zeros(b, n, dtype=torch.bool)
    feats = None
    if "features" in samples[0]:
        f0 = samples[0]["features"]
        feats = torch.zeros(b, s, f0.shape[-1], dtype=f0.dtype)
    for i, (x, a) in enumerate(zip(samples, anchors)):
        t = len(x["input_ids"])
        input_ids[i, :t] = torch.as_tensor(x["input_ids"])
        loss_mask[i, :t] = torch.as_tensor(x["loss_mask"], dtype=torch.float32)
        lengths[i] = t
        anc[i, : len(a)] = a
        valid[i, : len(a)] = True
        if feats is not None:
            feats[i, :t] = x["features"]
    return Batch(input_ids, loss_mask, lengths, anc, valid, feats)


def _round_up(x: int, multiple: int) -> int:
    return max(multiple, -(-x // multiple) * multiple)


def collate_packed(samples: list[dict], anchors: list[torch.Tensor], token_multiple: int = 128,
                   block_multiple: int = 8, sample_multiple: int = 1) -> Batch:
    """All samples end to end in one row: tokens [1, T], blocks [1, N], T and N the totals rounded up to
    `token_multiple` / `block_multiple` (tile-aligned; the padding tokens belong to no sample and no valid
    block sees them). `lengths` is [1]: the real tokens of the row. `sample_multiple` 128: every sample starts
    on a 128-key tile (padding between samples), so no attention tile is cut by a sample's start."""
    sizes = [len(x["input_ids"]) for x in samples]
    offsets = [0]
    for t in sizes:
        offsets.append(-(-(offsets[-1] + t) // sample_multiple) * sample_multiple)
    total, n_blocks = sum(sizes), sum(len(a) for a in anchors)
    t_pad, n_pad = _round_up(offsets[-2] + sizes[-1], token_multiple), _round_up(n_blocks, block_multiple)
    input_ids = torch.zeros(1, t_pad, dtype=torch.long)
    loss_mask = torch.zeros(1, t_pad, dtype=torch.float32)
    positions = torch.zeros(1, t_pad, dtype=torch.long)
    anc = torch.zeros(1, n_pad, dtype=torch.long)
    start = torch.zeros(1, n_pad, dtype=torch.long)
    end = torch.zeros(1, n_pad, dtype=torch.long)
    feats = None
    if "features" in samples[0]:
        f0 = samples[0]["features"]
        feats = torch.zeros(1, t_pad, f0.shape[-1], dtype=f0.dtype)
    blk = 0
    for x, a, t, off in zip(samples, anchors, sizes, offsets):
        input_ids[0, off:off + t] = torch.as_tensor(x["input_ids"])
        loss_mask[0, off:off + t] = torch.as_tensor(x["loss_mask"], dtype=torch.float32)
        positions[0, off:off + t] = torch.arange(t)
        anc[0, blk:blk + len(a)] = a + off
        start[0, blk:blk + len(a)] = off
        end[0, blk:blk + len(a)] = off + t
        if feats is not None:
            feats[0, off:off + t] = x["features"]
        blk += len(a)
    valid = torch.arange(n_pad)[None, :] < n_blocks
    spans = torch.tensor([[off, t] for off, t in zip(offsets, sizes)], dtype=torch.long)
    return Batch(input_ids, loss_mask, torch.tensor([total]), anc, valid, feats, positions, start, end, spans,
                 max_sample=max(sizes))


def scored_mask(batch: Batch, block_size: int) -> torch.Tensor:
    """[B * N * block_size] bool, on the batch's device: position k of a valid block anchored at p is scored when
    its label p + k is inside the block's sample and supervised (position 0, the anchor itself, never is)."""
    anchors = batch.anchors
    b, n = anchors.shape
    k = torch.arange(block_size, device=anchors.device)
    label_pos = anchors[:, :, None] + k                                              # [B, N, bs]
    end = batch.lengths[:, None] if batch.block_end is None else batch.block_end     # labels inside the sample
    safe = label_pos.clamp(max=batch.loss_mask.shape[1] - 1).view(b, n * block_size)
    supervised = batch.loss_mask.gather(1, safe).view(b, n, block_size) > 0
    return (batch.block_valid[:, :, None] & (label_pos < end[:, :, None]) & supervised & (k > 0)).view(-1)


def with_scored_index(batch: Batch, block_size: int, soft_chunk: int | None = None) -> Batch:
    """The batch with its scored positions as an index (on the host, where the batch is collated); with
    `soft_chunk` (soft labels: the head's chunk) also the positions whose target distribution they read."""
    index = scored_mask(batch, block_size).nonzero().squeeze(1)
    if soft_chunk is None:
        return replace(batch, scored_index=index)
    n, width = batch.anchors.shape[1], batch.input_ids.shape[1]
    block = index // block_size
    flat = (block // n) * width + batch.anchors.view(-1)[block] + index % block_size
    rows, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    return replace(batch, scored_index=index, soft_rows=rows, soft_inverse=inverse,
                   soft_spans=chunk_spans(inverse, soft_chunk))
