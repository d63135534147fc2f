"""Training attention in two parts merged by log-sum-exp (`train.attention: split`).

A block's queries see (1) its sample's context keys [start, anchor) and (2) its own block_size keys. In one
flex call over [context | blocks] keys the own-block keys add a partial 128x128 tile to every query tile and
the whole call ran at a few percent of the matmul rate (docs/training.md, "Training at small shapes"). Here:
(1) is a flex call over the context keys alone (masks.tile_context_mask: blocks are anchor-sorted, so a
query tile's keys are full tiles with partial ones only at its two ends; on CPU the dense mask, same math);
(2) is a dense batched [blocks, heads, bs, bs] attention. Softmax over the union of two disjoint key sets:
out = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2) = o2 + sigmoid(lse1 - lse2) (o1 - o2). A row with no
context (a block at its sample's start, a padding block) has lse1 = -inf, o1 = 0: out = o2, no NaN in the
gradient (sigmoid's derivative is 0 there). Autograd goes through the merge and flex's lse.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import AuxRequest

from dflash_pipeline.drafter.masks import dense_context_mask, tile_context_mask


class SplitMask(NamedTuple):
    context: object      # flex BlockMask over [N*bs, S] (GPU) or bool [B, 1, N*bs, S] (True = visible)
    block_size: int


def split_block_mask(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: int, block_size: int,
                     starts: torch.Tensor | None = None) -> SplitMask:
    build = tile_context_mask if anchors.is_cuda else dense_context_mask
    return SplitMask(build(anchors, block_valid, ctx_len, block_size, starts), block_size)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, ...] -> [B, Hkv, Hq/Hkv, ...]: query head h reads kv head h // (Hq/Hkv), as SDPA's enable_gqa."""
    return q.unflatten(1, (kv_heads, q.shape[1] // kv_heads))


def _dense_with_lse(q, k, v, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and its log-sum-exp with a bool mask [B, 1, Lq, Lk] (rows may be empty: lse -inf, out 0)."""
    s = torch.matmul(_grouped(q, k.shape[1]), k[:, :, None].transpose(-1, -2)).float() * scale
    s = s.masked_fill(~mask[:, :, None], float("-inf"))                       # [B, Hkv, g, Lq, Lk]
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.matmul(p.to(v.dtype), v[:, :, None])
    return out.flatten(1, 2), lse.flatten(1, 2)


_FLEX = None


def compiled_flex_attention():
    """flex_attention compiled once per static shape (uncompiled it runs unfused and materializes scores)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def _context(q, k, v, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(mask, torch.Tensor):
        return _dense_with_lse(q, k, v, mask, scale)
    out, aux = compiled_flex_attention()(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                                 return_aux=AuxRequest(lse=True))
    return out, aux.lse


def _own_block(q, k, v, block_size: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's queries against its own keys, dense: [B, H, N*bs, D] viewed as [B, H, N, bs, D]."""
    def blocks(x):
        return x.unflatten(2, (x.shape[2] // block_size, block_size))

    qg = _grouped(blocks(q), k.shape[1])                                       # [B, Hkv, g, N, bs, D]
    s = torch.matmul(qg, blocks(k)[:, :, None].transpose(-1, -2)).float() * scale
    lse = torch.logsumexp(s, dim=-1)                                           # [B, Hkv, g, N, bs]
    out = torch.matmul(torch.exp(s - lse[..., None]).to(v.dtype), blocks(v)[:, :, None])
    return out.flatten(1, 2).flatten(2, 3), lse.flatten(1, 2).flatten(2, 3)


def split_attend(q, k_ctx, v_ctx, k_blk, v_blk, mask: SplitMask, scale: float) -> torch.Tensor:
    """q [B, Hq, N*bs, D]; k/v_ctx [B, Hkv, S, D]; k/v_blk [B, Hkv, N*bs, D] -> [B, Hq, N*bs, D]."""
    o1, lse1 = _context(q, k_ctx, v_ctx, mask.context, scale)
    o2, lse2 = _own_block(q, k_blk, v_blk, mask.block_size, scale)
    a = torch.sigmoid(lse1.float() - lse2)[..., None]
    o2 = o2.float()
    return (o2 + a * (o1.float() - o2)).to(q.dtype)
