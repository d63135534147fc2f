"""Attention visibility of the packed training forward.

Queries are the blocks `[anchor, MASK x (block_size-1)]`, keys are `[context (S) | blocks]`; block j
(queries j*bs .. j*bs+bs-1) sees context keys `< anchor_j` and its own block's keys only. A block that is
not valid (padding) sees its own keys only, so no query row is fully masked. `dense_block_mask` serves SDPA
(CPU), `tile_block_mask` flex attention on GPU: the same visibility, block-sparse, its 128x128 tiles
counted from the anchors (2.6 ms at the Qwen3-8B shape on an H200, against 8.5 ms for `flex_block_mask`,
torch's create_block_mask evaluating every pair; benchmarks/train_throughput.py).
"""

from __future__ import annotations

import torch


def dense_block_mask(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """Bool [B, 1, N*bs, S + N*bs], True = visible (for scaled_dot_product_attention)."""
    b, n = anchors.shape
    dev = anchors.device
    q_block = torch.arange(n * block_size, device=dev) // block_size          # [Q]
    anchor_q = anchors[:, q_block]                                            # [B, Q]
    valid_q = block_valid[:, q_block]                                         # [B, Q]
    kv_ctx = torch.arange(ctx_len, device=dev)
    ctx_vis = (kv_ctx[None, None, :] < anchor_q[:, :, None]) & valid_q[:, :, None]     # [B, Q, S]
    kv_block = torch.arange(n * block_size, device=dev) // block_size
    blk_vis = (q_block[:, None] == kv_block[None, :]).expand(b, -1, -1)              # [B, Q, N*bs]
    return torch.cat([ctx_vis, blk_vis], dim=-1)[:, None]


def _mask_mod(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: int, block_size: int):
    def mask_mod(bi, h, q_idx, kv_idx):
        j = q_idx // block_size
        ctx = (kv_idx < ctx_len) & (kv_idx < anchors[bi, j]) & block_valid[bi, j]
        own = (kv_idx >= ctx_len) & ((kv_idx - ctx_len) // block_size == j)
        return ctx | own

    return mask_mod


def flex_block_mask(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: int, block_size: int):
    """The same visibility as a flex-attention BlockMask (block-sparse: skips invisible 128x128 tiles),
    built by evaluating the mask function on every (query, key) pair (torch's create_block_mask)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, n = anchors.shape
    return create_block_mask(_mask_mod(anchors, block_valid, ctx_len, block_size), B=b, H=None,
                             Q_LEN=n * block_size, KV_LEN=ctx_len + n * block_size, device=anchors.device)


def _visible_per_tile(anchors, block_valid, ctx_len: int, block_size: int, tile: int):
    """(visible pairs, pairs) per (batch, query tile, key tile), counted from the anchors per query row:
    context keys [0, min(anchor, S)) if the block is valid, then the block's own keys."""
    b, n = anchors.shape
    dev = anchors.device
    q_len, kv_len = n * block_size, ctx_len + n * block_size
    qt, kt = -(-q_len // tile), -(-kv_len // tile)
    lo = torch.arange(kt, device=dev) * tile                                   # key tile [lo, hi)
    hi = (lo + tile).clamp(max=kv_len)
    j = torch.arange(q_len, device=dev) // block_size                          # block of each query row
    reach = torch.where(block_valid, anchors.clamp(max=ctx_len), 0)[:, j]      # [B, Q] context keys seen
    ctx = (torch.minimum(reach[:, :, None], hi) - lo).clamp(min=0)             # [B, Q, KT]
    own_lo = ctx_len + j * block_size
    own = (torch.minimum(own_lo[:, None] + block_size, hi) - torch.maximum(own_lo[:, None], lo)).clamp(min=0)
    rows = torch.zeros(b, qt * tile, kt, dtype=torch.long, device=dev)
    rows[:, :q_len] = ctx + own[None]
    visible = rows.view(b, qt, tile, kt).sum(2)                                # [B, QT, KT]
    q_rows = (q_len - torch.arange(qt, device=dev) * tile).clamp(max=tile)
    return visible, q_rows[:, None] * (hi - lo)[None, :]


def tile_block_mask(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: int, block_size: int,
                    tile: int = 128):
    """`flex_block_mask`'s BlockMask built from per-tile counts (O(queries x key tiles) instead of
    O(queries x keys) mask evaluations): a tile with every pair visible is full, one with some is partial
    (the mask function decides inside it), one with none is skipped."""
    from torch.nn.attention.flex_attention import BlockMask

    b, n = anchors.shape
    visible, pairs = _visible_per_tile(anchors, block_valid, ctx_len, block_size, tile)
    full = (visible == pairs) & (pairs == tile * tile)   # an edge tile stays partial, as create_block_mask has it
    partial = (visible > 0) & ~full

    def blocks(sel):
        order = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return sel.sum(-1).to(torch.int32)[:, None], order[:, None]

    kv_num, kv_idx = blocks(partial)
    full_num, full_idx = blocks(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile,
                                    mask_mod=_mask_mod(anchors, block_valid, ctx_len, block_size),
                                    seq_lengths=(n * block_size, ctx_len + n * block_size))
