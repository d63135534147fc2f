"""Anchors and padded batches.

Anchors: up to `num_anchors` random positions p of a sample whose token and next token are both supervised
(loss_mask[p] = loss_mask[p + 1] = 1): the block anchored at p scores labels p + 1 ..., so an anchor on a
turn's last supervised token would train nothing (5.1% of the former candidates on the demo data,
benchmarks/wasted_anchors.py). Drawn from a generator seeded by (seed, epoch, position in the epoch): a resumed
run draws the same anchors as an uninterrupted one. A batch packs all blocks of each sequence into one
forward (see masks.py for who sees what).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device) -> "Batch":
        return Batch(
            self.input_ids.to(device), self.loss_mask.to(device), self.lengths.to(device),
            self.anchors.to(device), self.block_valid.to(device),
            None if self.features is None else self.features.to(device, non_blocking=True),
        )


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
