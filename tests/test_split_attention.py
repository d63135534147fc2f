"""`train.attention: split` (context and own-block attention merged by log-sum-exp) against the one-mask path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_pipeline.drafter.batch import collate, collate_packed
from dflash_pipeline.drafter.config import DrafterConfig
from dflash_pipeline.drafter.loss import block_loss, draft_all_blocks
from dflash_pipeline.drafter.masks import _context_mask_mod, dense_context_mask, tile_context_mask
from dflash_pipeline.drafter.model import DFlashDrafter
from dflash_pipeline.drafter.split_attention import SplitMask, split_attend
from dflash_pipeline.drafter.target_head import TargetHead


def _config(bs: int = 4) -> DrafterConfig:
    return DrafterConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, num_hidden_layers=2, num_target_layers=4, target_layer_ids=[1, 2],
                         block_size=bs, mask_token_id=0, vocab_size=50)


def _samples(cfg, lengths=(30, 9, 41), prompts=(6, 0, 12)):
    """Samples with features; the second has no prompt and an anchor at its first token (empty context)."""
    rng = np.random.default_rng(0)
    samples, anchors = [], []
    for n, p in zip(lengths, prompts):
        mask = np.zeros(n, np.uint8)
        mask[p:] = 1
        samples.append({"input_ids": rng.integers(1, cfg.vocab_size, n), "loss_mask": mask,
                        "features": torch.randn(n, 2 * cfg.hidden_size, generator=torch.Generator().manual_seed(n))})
        cand = np.flatnonzero(mask[:-1] & mask[1:])
        anchors.append(torch.as_tensor(np.sort(rng.choice(cand, min(7, len(cand)), replace=False))))
    anchors[1][0] = 0
    return samples, anchors


def _run(cfg, head, batch, attention):
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    hidden = draft_all_blocks(drafter, head, batch, batch.features, attention, None)
    w = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1))
    (hidden * w).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in drafter.parameters()])
    drafter.zero_grad()
    loss = block_loss(drafter, head, batch, batch.features, 7.0, attention=attention, head_chunk=16).loss
    return hidden.detach(), grads, float(loss.detach())


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_split_attention_gives_the_one_mask_outputs_and_gradients(layout):
    """Padded (padding blocks beyond each row's anchors) and packed (3 samples, tail padding): same hidden
    states of every block (valid or not), same gradients, same loss; one block starts its sample (no context)."""
    cfg = _config()
    head = TargetHead(torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.5, None)
    samples, anchors = _samples(cfg)
    if layout == "padded":
        batch = collate(samples, anchors, num_blocks=9)
        assert not bool(batch.block_valid.all()) and int(batch.anchors[1, 0]) == 0
    else:
        batch = collate_packed(samples, anchors, token_multiple=32, block_multiple=8)
        assert not bool(batch.block_valid.all())
        assert int(batch.anchors[0, 7]) == int(batch.block_start[0, 7]) == 30
    # one row packed, a row each padded: loss_normalization "samples" divides by the samples either way
    assert batch.num_samples == len(samples) > 1
    assert batch.input_ids.shape[0] == (1 if layout == "packed" else len(samples))
    h_ref, g_ref, l_ref = _run(cfg, head, batch, "sdpa")
    h_new, g_new, l_new = _run(cfg, head, batch, "split")
    assert torch.isfinite(h_new).all() and torch.isfinite(g_new).all()
    assert float((h_new - h_ref).abs().max()) < 1e-5 * float(h_ref.abs().max())
    assert float((g_new - g_ref).norm() / g_ref.norm()) < 1e-5
    assert abs(l_new - l_ref) < 1e-5 * abs(l_ref)


def test_split_attend_merges_disjoint_key_sets_exactly():
    """The merge alone, GQA, a row with no context: softmax over [context | own block] keys, gradients of
    q, k and v equal to one SDPA call over the concatenated keys with the combined mask."""
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, n, bs, s, d = 2, 6, 2, 5, 4, 13, 8
    q = torch.randn(b, hq, n * bs, d, generator=g, requires_grad=True)
    k_ctx, v_ctx, k_blk, v_blk = (torch.randn(b, hkv, m, d, generator=g, requires_grad=True)
                                  for m in (s, s, n * bs, n * bs))
    anchors = torch.tensor([[0, 3, 7, 9, 12], [2, 2, 5, 0, 0]])
    valid = torch.tensor([[True] * 5, [True, True, True, False, False]])
    ctx = dense_context_mask(anchors, valid, s, bs)
    out = split_attend(q, k_ctx, v_ctx, k_blk, v_blk, SplitMask(ctx, bs), 0.3)
    j = torch.arange(n * bs) // bs
    full = torch.cat([ctx, (j[:, None] == j[None, :]).expand(b, 1, -1, -1)], dim=-1)
    k, v = torch.cat([k_ctx, k_blk], 2), torch.cat([v_ctx, v_blk], 2)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=full, scale=0.3, enable_gqa=True)
    w = torch.randn(out.shape, generator=g)
    grads = [torch.autograd.grad((x * w).sum(), (q, k_ctx, v_ctx, k_blk, v_blk)) for x in (out, ref)]
    assert float((out - ref).abs().max()) < 1e-5
    for a, r in zip(*grads):
        assert float((a - r).abs().max()) < 1e-5 * max(1.0, float(r.abs().max()))


def _tile_sets(m):
    return [[(sorted(m.kv_indices[bi, 0, qi, :int(m.kv_num_blocks[bi, 0, qi])].tolist()),
              sorted(m.full_kv_indices[bi, 0, qi, :int(m.full_kv_num_blocks[bi, 0, qi])].tolist()))
             for qi in range(m.kv_num_blocks.shape[2])] for bi in range(m.kv_num_blocks.shape[0])]


@pytest.mark.parametrize("packed", [False, True])
def test_tile_context_mask_equals_create_block_mask(packed):
    """The context-only BlockMask counted per tile (the GPU's split path) has exactly the tiles torch's
    create_block_mask finds from its mask function; and most non-empty tiles are full at these lengths."""
    from torch.nn.attention.flex_attention import create_block_mask

    g = torch.Generator().manual_seed(2)
    bs = 16
    if packed:
        rng = np.random.default_rng(3)
        samples, anchors = [], []
        for n in (300, 520, 77, 410, 900):
            mask = np.ones(n, np.uint8)
            mask[: n // 3] = 0
            cand = np.flatnonzero(mask[:-1] & mask[1:])
            samples.append({"input_ids": np.zeros(n, np.int64), "loss_mask": mask})
            anchors.append(torch.as_tensor(np.sort(rng.choice(cand, min(60, len(cand)), replace=False))))
        bt = collate_packed(samples, anchors)
        a, valid, starts, s = bt.anchors, bt.block_valid, bt.block_start, bt.input_ids.shape[1]
    else:
        b, n, s = 3, 40, 1024
        a = torch.sort(torch.randint(0, s, (b, n), generator=g), dim=1).values
        valid, starts = torch.arange(n).expand(b, n) < n - 5, None
    new = tile_context_mask(a, valid, s, bs, starts)
    ref = create_block_mask(_context_mask_mod(a, valid, bs, starts), B=a.shape[0], H=None,
                            Q_LEN=a.shape[1] * bs, KV_LEN=s, device="cpu")
    assert _tile_sets(new) == _tile_sets(ref) and new.seq_lengths == ref.seq_lengths
    partial = sum(len(p) for row in _tile_sets(new) for p, _ in row)
    full = sum(len(f) for row in _tile_sets(new) for _, f in row)
    assert partial > 0 and full > 0


def test_flex_context_part_equals_the_dense_one_forward():
    """CPU flex runs forward only (no backward, eager): the context part through flex with the per-tile
    BlockMask gives the dense path's outputs and log-sum-exp (-inf for rows without context)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    g = torch.Generator().manual_seed(4)
    bs, n, s = 16, 24, 512
    anchors = torch.sort(torch.randint(0, s, (1, n), generator=g), dim=1).values
    anchors[0, 0] = 0
    valid = torch.arange(n)[None] < n - 3
    q = torch.randn(1, 6, n * bs, 16, generator=g)
    k, v = torch.randn(1, 2, s, 16, generator=g), torch.randn(1, 2, s, 16, generator=g)
    from dflash_pipeline.drafter.split_attention import _dense_with_lse

    o_ref, lse_ref = _dense_with_lse(q, k, v, dense_context_mask(anchors, valid, s, bs), 0.25)
    out, aux = flex_attention(q, k, v, block_mask=tile_context_mask(anchors, valid, s, bs), scale=0.25,
                              enable_gqa=True, return_aux=AuxRequest(lse=True))
    assert float((out - o_ref).abs().max()) < 1e-5
    empty = torch.isinf(lse_ref)
    assert bool(empty.any()) and torch.equal(empty, torch.isinf(aux.lse))
    assert float((aux.lse - lse_ref)[~empty].abs().max()) < 1e-4


def test_packed_samples_aligned_to_tiles_train_as_padded():
    """collate_packed(sample_multiple=16): samples start on multiples of 16 (padding between them, seen by no
    block), same loss and gradients as one padded row per sample, same FLOP counts."""
    from dflash_pipeline.drafter.flops import batch_counts

    cfg = _config()
    head = TargetHead(torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.5, None)
    samples, anchors = _samples(cfg)
    padded = collate(samples, anchors, num_blocks=9)
    packed = collate_packed(samples, anchors, token_multiple=32, block_multiple=8, sample_multiple=16)
    assert packed.block_start[0, :7].unique().tolist() == [0] and int(packed.block_start[0, 7]) == 32
    assert int(packed.block_start[0, 14]) == 48 and packed.input_ids.shape == (1, 96)
    got = []
    for batch, attention in ((padded, "sdpa"), (packed, "split")):
        torch.manual_seed(0)
        drafter = DFlashDrafter(cfg)
        loss = block_loss(drafter, head, batch, batch.features, 7.0, attention=attention, head_chunk=16).loss
        loss.backward()
        got.append((float(loss.detach()), torch.cat([p.grad.flatten() for p in drafter.parameters()])))
    (l_ref, g_ref), (l_new, g_new) = got
    assert float((g_new - g_ref).norm() / g_ref.norm()) < 1e-5 and abs(l_new - l_ref) < 1e-5 * abs(l_ref)
    assert batch_counts(padded, cfg.block_size) == batch_counts(packed, cfg.block_size)
