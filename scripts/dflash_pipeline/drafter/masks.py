"""Attention visibility of the packed training forward.

Queries are the blocks `[anchor, MASK x (block_size-1)]`, keys are `[context (S) | blocks]`; block j
(queries j*bs .. j*bs+bs-1) sees context keys `< anchor_j` and its own block's keys only. A block that is
not valid (padding) sees its own keys only, so no query row is fully masked. `dense_block_mask` serves SDPA
(CPU), `flex_block_mask` flex attention on GPU: the same visibility, block-sparse.
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


def flex_block_mask(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: int, block_size: int):
    """The same visibility as a flex-attention BlockMask (block-sparse: skips invisible 128x128 tiles)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, n = anchors.shape
    s = ctx_len

    def mask_mod(bi, h, q_idx, kv_idx):
        j = q_idx // block_size
        anchor = anchors[bi, j]
        ok = block_valid[bi, j]
        ctx = (kv_idx < s) & (kv_idx < anchor) & ok
        own = (kv_idx >= s) & ((kv_idx - s) // block_size == j)
        return ctx | own

    return create_block_mask(mask_mod, B=b, H=None, Q_LEN=n * block_size, KV_LEN=s + n * block_size,
                             device=anchors.device)
