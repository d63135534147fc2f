"""Attention visibility of the packed training forward.

Queries are the blocks `[anchor, MASK x (block_size-1)]`, keys are `[context (S) | blocks]`; block j
(queries j*bs .. j*bs+bs-1) sees context keys `start_j <= key < anchor_j` and its own block's keys only
(`starts` None: start 0, one sample per row; a packed row holds several samples, each block starting at its
own sample's first token, batch.collate_packed). A block that is not valid (padding) sees its own keys only,
so no query row is fully masked. `dense_block_mask` serves SDPA
(CPU), `tile_block_mask` flex attention on GPU: the same visibility, block-sparse, its 128x128 tiles
counted from the anchors (2.6 ms at the Qwen3-8B shape on an H200, against 8.5 ms for `flex_block_mask`,
torch's create_block_mask evaluating every pair; benchmarks/train_throughput.py). `dense_context_mask` and
`tile_context_mask` are the context part alone, for split_attention.py (the own block attended apart).
"""

from __future__ import annotations

import torch


def _starts(anchors: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
    return torch.zeros_like(anchors) if starts is None else starts


def dense_block_mask(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: int, block_size: int,
                     starts: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [B, 1, N*bs, S + N*bs], True = visible (for scaled_dot_product_attention)."""
    b, n = anchors.shape
    q_block = torch.arange(n * block_size, device=anchors.device) // block_size      # [Q]
    blk_vis = (q_block[:, None] == q_block[None, :]).expand(b, -1, -1)               # [B, Q, N*bs]
    ctx_vis = dense_context_mask(anchors, block_valid, ctx_len, block_size, starts)[:, 0]
    return torch.cat([ctx_vis, blk_vis], dim=-1)[:, None]


def dense_context_mask(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: int, block_size: int,
                       starts: torch.Tensor | None = None) -> torch.Tensor:
    """The context part of `dense_block_mask` alone: bool [B, 1, N*bs, S] (a row may be all False)."""
    n = anchors.shape[1]
    dev = anchors.device
    q_block = torch.arange(n * block_size, device=dev) // block_size          # [Q]
    anchor_q = anchors[:, q_block]                                            # [B, Q]
    start_q = _starts(anchors, starts)[:, q_block]                            # [B, Q]
    valid_q = block_valid[:, q_block]                                         # [B, Q]
    kv_ctx = torch.arange(ctx_len, device=dev)[None, None, :]
    return ((kv_ctx < anchor_q[:, :, None]) & (kv_ctx >= start_q[:, :, None]) & valid_q[:, :, None])[:, None]


def _mask_mod(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: int, block_size: int, starts):
    starts = _starts(anchors, starts)

    def mask_mod(bi, h, q_idx, kv_idx):
        j = q_idx // block_size
        ctx = (kv_idx < ctx_len) & (kv_idx < anchors[bi, j]) & (kv_idx >= starts[bi, j]) & block_valid[bi, j]
        own = (kv_idx >= ctx_len) & ((kv_idx - ctx_len) // block_size == j)
        return ctx | own

    return mask_mod


def flex_block_mask(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: int, block_size: int,
                    starts: torch.Tensor | None = None):
    """The same visibility as a flex-attention BlockMask (block-sparse: skips invisible 128x128 tiles),
    built by evaluating the mask function on every (query, key) pair (torch's create_block_mask)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, n = anchors.shape
    return create_block_mask(_mask_mod(anchors, block_valid, ctx_len, block_size, starts), B=b, H=None,
                             Q_LEN=n * block_size, KV_LEN=ctx_len + n * block_size, device=anchors.device)


def _visible_per_tile(anchors, block_valid, ctx_len: int, block_size: int, tile: int, starts=None):
    """(visible pairs, pairs) per (batch, query tile, key tile), counted from the anchors per query row:
    context keys [start, min(anchor, S)) if the block is valid, then the block's own keys. The context part
    is counted over the context's key tiles only and the own-block part (one or two key tiles per row) is
    added by index, so a packed row of ~80K queries needs O(queries x context tiles), not x all key tiles."""
    b, n = anchors.shape
    dev = anchors.device
    q_len, kv_len = n * block_size, ctx_len + n * block_size
    qt, kt, kt_ctx = -(-q_len // tile), -(-kv_len // tile), -(-ctx_len // tile)
    lo = torch.arange(kt, device=dev) * tile                                   # key tile [lo, hi)
    hi = (lo + tile).clamp(max=kv_len)
    j = torch.arange(q_len, device=dev) // block_size                          # block of each query row
    visible = torch.zeros(b, qt, kt, dtype=torch.long, device=dev)
    visible[:, :, :kt_ctx] = _context_per_tile(anchors, block_valid, ctx_len, block_size, tile, starts)
    own_lo = ctx_len + j * block_size                                          # own keys [own_lo, own_lo + bs)
    k0 = own_lo // tile
    in_first = torch.minimum(own_lo + block_size, (k0 + 1) * tile) - own_lo   # the rest spills into tile k0 + 1
    q_tile = torch.arange(q_len, device=dev) // tile
    own = torch.zeros(qt * kt, dtype=torch.long, device=dev).index_add_(0, q_tile * kt + k0, in_first)
    spill = in_first < block_size
    own.index_add_(0, (q_tile * kt + k0 + 1)[spill], (block_size - in_first)[spill])
    visible += own.view(qt, kt)[None]
    q_rows = (q_len - torch.arange(qt, device=dev) * tile).clamp(max=tile)
    return visible, q_rows[:, None] * (hi - lo)[None, :]


def tile_block_mask(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: int, block_size: int,
                    starts: torch.Tensor | None = None, tile: int = 128):
    """`flex_block_mask`'s BlockMask built from per-tile counts (O(queries x key tiles) instead of
    O(queries x keys) mask evaluations): a tile with every pair visible is full, one with some is partial
    (the mask function decides inside it), one with none is skipped."""
    n = anchors.shape[1]
    visible, pairs = _visible_per_tile(anchors, block_valid, ctx_len, block_size, tile, starts)
    return _from_counts(visible, pairs, tile, _mask_mod(anchors, block_valid, ctx_len, block_size, starts),
                        (n * block_size, ctx_len + n * block_size))


def _from_counts(visible, pairs, tile: int, mask_mod, seq_lengths):
    from torch.nn.attention.flex_attention import BlockMask

    full = (visible == pairs) & (pairs == tile * tile)   # an edge tile stays partial, as create_block_mask has it
    partial = (visible > 0) & ~full

    def blocks(sel):
        order = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return sel.sum(-1).to(torch.int32)[:, None], order[:, None]

    kv_num, kv_idx = blocks(partial)
    full_num, full_idx = blocks(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=mask_mod,
                                    seq_lengths=seq_lengths)


# Context-only visibility (drafter/split_attention.py: the own-block keys are attended apart, densely).

def _context_per_tile(anchors, block_valid, ctx_len: int, block_size: int, tile: int, starts=None):
    """Visible context pairs [B, query tiles, context key tiles]: keys [start, min(anchor, S)) of each valid
    block's rows, summed per tile."""
    b, n = anchors.shape
    dev = anchors.device
    q_len = n * block_size
    qt, kt_ctx = -(-q_len // tile), -(-ctx_len // tile)
    c_lo = torch.arange(kt_ctx, device=dev) * tile
    c_hi = (c_lo + tile).clamp(max=ctx_len)
    j = torch.arange(q_len, device=dev) // block_size                          # block of each query row
    reach = torch.where(block_valid, anchors.clamp(max=ctx_len), 0)[:, j]      # [B, Q] context keys seen
    first = _starts(anchors, starts)[:, j]
    ctx = (torch.minimum(reach[:, :, None], c_hi) - torch.maximum(first[:, :, None], c_lo)).clamp(min=0)
    rows = torch.zeros(b, qt * tile, kt_ctx, dtype=torch.long, device=dev)
    rows[:, :q_len] = ctx                                                      # [B, Q(padded), KTc]
    return rows.view(b, qt, tile, kt_ctx).sum(2)


def _context_mask_mod(anchors: torch.Tensor, block_valid: torch.Tensor, block_size: int, starts):
    lo = _starts(anchors, starts)
    hi = torch.where(block_valid, anchors, lo)   # an invalid block sees no context: its rows are empty

    def mask_mod(bi, h, q_idx, kv_idx):
        j = q_idx // block_size
        return (kv_idx >= lo[bi, j]) & (kv_idx < hi[bi, j])

    return mask_mod


def tile_context_mask(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: int, block_size: int,
                      starts: torch.Tensor | None = None, tile: int = 128):
    """BlockMask of the context keys alone ([N*bs] queries x [S] keys), counted per tile as `tile_block_mask`.
    A block's rows see one key interval [start, anchor), blocks come anchor-sorted, so a query tile's keys
    are full tiles between its first start and its lowest anchor, partial only at the two ends."""
    n = anchors.shape[1]
    dev = anchors.device
    visible = _context_per_tile(anchors, block_valid, ctx_len, block_size, tile, starts)
    q_rows = (n * block_size - torch.arange(visible.shape[1], device=dev) * tile).clamp(max=tile)
    lo = torch.arange(visible.shape[2], device=dev) * tile
    pairs = q_rows[:, None] * ((lo + tile).clamp(max=ctx_len) - lo)[None, :]
    return _from_counts(visible, pairs, tile, _context_mask_mod(anchors, block_valid, block_size, starts),
                        (n * block_size, ctx_len))
