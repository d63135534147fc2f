"""One forward of all blocks of a batch and the DFlash loss.

Same-position labels: block position k predicts token anchor + k; position 0 is the anchor and is not
scored; labels must be supervised and inside the sequence. Cross-entropy weighted per block position and
normalized (`train.loss_normalization`) by the sum of weights (a weighted mean), or by the micro-batch's samples
as SpecForge 0.2.0's D-PACE does (its loss is then in the thousands and grad_clip scales every step's gradient to
unit norm; within a batch the tokens weigh the same either way). Weightings (`train.loss_weighting`):
- decay (the paper's): w_k = exp(-(k-1)/gamma);
- dpace (the default): the decay times D-PACE's detached weight, which follows how likely the block is to get
  that far: with q_j the drafter's probability of label j and s_j = (1 - alpha) q_j + alpha, P_k = prod_{j<=k}
  s_j and w_k = sum_{j>=k, scored} P_j (a position counts for the scored positions behind it that a mistake
  there would cost). The D-PACE weight is the one SpecForge 0.2.0's `dpace` loss type and speculators 0.9.0's
  `dpace_loss_decay` compute; both use it alone (no decay; speculators' gamma unused) and SpecForge divides by
  the batch's samples, not the weight sum. `gamma: 0` here is D-PACE alone;
- none: w_k = 1 (SpecForge's default).
With `soft` (train.labels: distill, online) each scored token's CE is against the target's whole next-token
distribution (head_loss.py); its accuracy counts the target's argmax as the label, and D-PACE's q_j is the
drafter's probability of that argmax (what greedy verification accepts; exp(-soft CE) would also fall with the
target's own entropy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from dflash_pipeline.drafter.batch import Batch, scored_mask
from dflash_pipeline.drafter.head_loss import head_cross_entropy, head_soft_cross_entropy
from dflash_pipeline.drafter.masks import dense_block_mask, flex_block_mask, tile_block_mask
from dflash_pipeline.drafter.model import DFlashDrafter
from dflash_pipeline.drafter.split_attention import split_block_mask
from dflash_pipeline.drafter.target_head import TargetHead


# attention -> mask builder: dense bool mask for SDPA (CPU); flex BlockMask built from per-tile counts, or
# ("flex-create", the earlier path, kept for benchmarks/train_throughput.py) by torch's create_block_mask;
# split: context and own block attended apart, merged by log-sum-exp (split_attention.py)
MASK_BUILDERS = {"sdpa": dense_block_mask, "flex": tile_block_mask, "flex-create": flex_block_mask,
                 "split": split_block_mask}


def decay_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block positions k >= 1; position 0 (the anchor) has weight 0."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1).clamp(min=0) / float(gamma)) if gamma and gamma > 0 else torch.ones_like(k)
    w[0] = 0.0
    return w


@dataclass
class BlockLoss:
    loss: torch.Tensor               # scalar: the weighted CE sum over the weights' sum or the samples
    weight_sum: torch.Tensor         # scalar (detached), on the loss's device: read it without a synchronisation
    count: torch.Tensor              # [bs] scored labels per block position
    correct: torch.Tensor            # [bs] argmax == label per block position
    ce_sum: torch.Tensor             # [bs] summed CE per block position
    scored_tokens: int
    weighted_sum: torch.Tensor       # scalar (detached): sum of CE x weight; the log reports / weight_sum, whatever
                                     # the normalization


WEIGHTINGS = ("decay", "dpace", "none")
NORMALIZATIONS = ("weights", "samples")


def dpace_weights(ce: torch.Tensor, index: torch.Tensor, total: int, bs: int, alpha: float) -> torch.Tensor:
    """D-PACE weights of the scored tokens (ordered like `ce`), detached; `index`: their flat positions among the
    batch's `total` block positions."""
    with torch.no_grad():
        q = torch.ones(total, device=ce.device)
        q[index] = (1.0 - alpha) * torch.exp(-ce.detach().float()) + alpha
        scored = torch.zeros(total, device=ce.device)
        scored[index] = 1.0
        prefix = torch.cumprod(q.view(-1, bs), dim=-1)                 # unscored positions multiply by 1
        suffix = (prefix * scored.view(-1, bs)).flip(-1).cumsum(-1).flip(-1)
        return suffix.view(-1)[index]


def block_loss(drafter: DFlashDrafter, head: TargetHead, batch: Batch, features: torch.Tensor, gamma: float,
               attention: str = "sdpa", compute_dtype: torch.dtype | None = None,
               labels: torch.Tensor | None = None, head_chunk: int = 0, weighting: str = "decay",
               dpace_alpha: float = 0.5, soft: torch.Tensor | None = None,
               normalization: str = "weights") -> BlockLoss:
    """One forward of all blocks of the batch and the weighted same-position cross-entropy.

    `labels` [B, S]: the token expected at each position (default: the data, `batch.input_ids`); block
    position k of the block anchored at p is scored against labels[p + k]. `head_chunk` > 0: the LM head and
    CE run over that many scored tokens at a time (head_loss.py), never holding all logits. `soft` [B, S, H]:
    the target's final hidden state whose head logits are the distribution of the token at each position
    (features.py), scored by soft CE instead of `labels`.
    """
    bs = drafter.config.block_size
    hidden = draft_all_blocks(drafter, head, batch, features, attention, compute_dtype)   # [B, N*bs, H]
    if weighting not in WEIGHTINGS:
        raise ValueError(f"loss weighting {weighting!r} is not one of {WEIGHTINGS}")
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"loss normalization {normalization!r} is not one of {NORMALIZATIONS}")
    y, w, pos_k, index = scored_labels(batch, batch.input_ids if labels is None else labels, bs,
                                       0.0 if weighting == "none" else gamma)
    scored = int(index.shape[0])  # a shape: known on the host
    if scored == 0:
        z = torch.zeros(bs, device=hidden.device)
        return BlockLoss(hidden.sum() * 0.0, z.sum(), z, z.clone(), z.clone(), 0, z.sum())
    scored_hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
    if soft is None:
        ce, top = head_cross_entropy(scored_hidden, head.lm_head.weight, y, head_chunk)
        nll_y = ce
    elif batch.soft_rows is None:  # D-PACE's q: the drafter's probability of the target's greedy token
        ce, top, y, nll_y = head_soft_cross_entropy(scored_hidden, head.lm_head.weight,
                                                    scored_rows(batch, soft, index, bs), head_chunk)
    else:  # each position's distribution once, however many blocks score it (with_scored_index)
        width = batch.input_ids.shape[1]
        rows = soft[batch.soft_rows // width, batch.soft_rows % width]
        ce, top, y, nll_y = head_soft_cross_entropy(scored_hidden, head.lm_head.weight, rows, head_chunk,
                                                    batch.soft_inverse, batch.soft_spans)
    if weighting == "dpace":
        w = w * dpace_weights(nll_y, index, hidden.shape[0] * hidden.shape[1], bs, dpace_alpha)
    wsum, total = w.sum(), (ce * w).sum()
    loss = total / (wsum if normalization == "weights" else batch.num_samples)
    with torch.no_grad():
        def per_position(values):
            return torch.zeros(bs, device=ce.device).index_add_(0, pos_k, values)

        count, correct = per_position(torch.ones_like(ce)), per_position((top == y).float())
        ce_sum = per_position(ce.detach())
    return BlockLoss(loss, wsum.detach(), count, correct, ce_sum, scored, total.detach())


def draft_all_blocks(drafter, head: TargetHead, batch: Batch, features: torch.Tensor, attention: str,
                     compute_dtype: torch.dtype | None) -> torch.Tensor:
    """Drafter hidden states of every block `[anchor, MASK x (bs-1)]` of the batch, in one forward."""
    cfg = drafter.config
    bs, ids, anchors, valid = cfg.block_size, batch.input_ids, batch.anchors, batch.block_valid
    b, s = ids.shape
    n, dev = anchors.shape[1], ids.device
    noise = torch.full((b, n, bs), cfg.mask_token_id, dtype=torch.long, device=dev)
    noise[:, :, 0] = torch.where(valid, ids.gather(1, anchors), torch.full_like(anchors, cfg.mask_token_id))
    dtype = compute_dtype or head.embed.weight.dtype
    emb = head.embed(noise.view(b, n * bs)).to(dtype)
    if batch.positions is None:  # one sample per row
        ctx_pos, anchor_pos = torch.arange(s, device=dev).expand(b, s), anchors
    else:  # packed: positions restart at every sample
        ctx_pos, anchor_pos = batch.positions, batch.positions.gather(1, anchors)
    blk_pos = (anchor_pos[:, :, None] + torch.arange(bs, device=dev)).view(b, n * bs)
    mask = MASK_BUILDERS[attention](anchors, valid, s, bs, batch.block_start)
    return drafter(emb, features.to(dtype), ctx_pos, blk_pos, mask)


def scored_labels(batch: Batch, labels: torch.Tensor, bs: int, gamma: float):
    """(labels, weights, block positions, index) of the scored block tokens (batch.scored_mask), flattened;
    `index`: their flat positions among the batch's [B * N * bs]. The batch's host-computed `scored_index` when
    it has one (the training step's: no device synchronisation here), else found here."""
    index = batch.scored_index
    if index is None:
        index = scored_mask(batch, bs).nonzero().squeeze(1)
    k = index % bs
    return scored_rows(batch, labels, index, bs), decay_weights(bs, gamma, device=index.device)[k], k, index


def scored_rows(batch: Batch, values: torch.Tensor, index: torch.Tensor, bs: int) -> torch.Tensor:
    """values[b, p + k] ([B, S, ...]) of each scored block token (flat `index`, scored_labels' order)."""
    n = batch.anchors.shape[1]
    block, k = index // bs, index % bs
    return values[block // n, batch.anchors.view(-1)[block] + k]
