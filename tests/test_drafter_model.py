"""The drafter model and its block-sparse training forward, on the tiny target (CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_pipeline.drafter.batch import collate, sample_anchors
from dflash_pipeline.drafter.config import DrafterConfig
from dflash_pipeline.drafter.features import target_features
from dflash_pipeline.drafter.loss import block_loss, decay_weights
from dflash_pipeline.drafter.masks import dense_block_mask
from dflash_pipeline.drafter.model import ContextCache, DFlashDrafter
from dflash_pipeline.drafter.sources import epoch_order, is_holdout
from dflash_pipeline.drafter.target_head import load_target_head, resolve_mask_token_id
from dflash_pipeline.target import read_config as read_target_config
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.target_layers import default_target_layer_ids


@pytest.fixture(scope="module")
def parts(tiny_target):
    from transformers import AutoModelForCausalLM

    tc = read_target_config(tiny_target)
    head = load_target_head(tiny_target)
    ids = default_target_layer_ids(tc["num_hidden_layers"], 2)
    mask_id = resolve_mask_token_id(tiny_target, None, head.vocab_rows)
    cfg = DrafterConfig.from_target(tc, 2, ids, 8, mask_id, head.vocab_rows)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).eval()
    target = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    return cfg, head, drafter, target


def _batch(cfg, target, lengths=(40, 57), prompt=12, anchors=6, seed=0):
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    samples, anc = [], []
    for n in lengths:
        mask = np.zeros(n, np.uint8)
        mask[prompt:] = 1
        samples.append({"input_ids": rng.integers(0, 1000, n), "loss_mask": mask})
        anc.append(sample_anchors(mask, anchors, g))
    batch = collate(samples, anc)
    feats = target_features(target, batch.input_ids, batch.lengths, cfg.target_layer_ids)
    return batch, feats


def _block_alone(cfg, head, drafter, batch, feats, b, j):
    """Block j of sequence b, run on its own: context = features of positions < anchor, no mask."""
    a, bs = int(batch.anchors[b, j]), cfg.block_size
    noise = torch.full((1, bs), cfg.mask_token_id)
    noise[0, 0] = batch.input_ids[b, a]
    return drafter(head.embed(noise), feats[b:b + 1, :a], torch.arange(a)[None], torch.arange(a, a + bs)[None])


def test_config_from_target_and_mask_token(parts, tiny_target):
    cfg, head, drafter, _ = parts
    tc = read_target_config(tiny_target)
    assert cfg.hidden_size == tc["hidden_size"] and cfg.num_target_layers == tc["num_hidden_layers"]
    assert cfg.target_layer_ids == default_target_layer_ids(tc["num_hidden_layers"], 2)
    assert drafter.fc.weight.shape == (cfg.hidden_size, len(cfg.target_layer_ids) * cfg.hidden_size)
    # the demo target's mask token is a spare embedding row past the tokenizer
    assert resolve_mask_token_id(tiny_target, None, head.vocab_rows) == head.vocab_rows - 1
    head.check_mask_token(head.vocab_rows - 1)
    with pytest.raises(PipelineError, match="not a row"):
        head.check_mask_token(head.vocab_rows)
    # embedding and LM head are frozen and not part of the drafter's weights
    assert not head.embed.weight.requires_grad and not head.lm_head.weight.requires_grad
    names = set(drafter.engine_state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert all(n.startswith("layers.") or n in ("fc.weight", "hidden_norm.weight", "norm.weight") for n in names)


def test_all_blocks_in_one_forward_equal_each_block_alone(parts):
    """The block-sparse batched forward (many blocks per sequence, padding) == one block at a time."""
    cfg, head, drafter, target = parts
    batch, feats = _batch(cfg, target)
    b, n = batch.anchors.shape
    bs = cfg.block_size
    noise = torch.full((b, n, bs), cfg.mask_token_id)
    noise[:, :, 0] = batch.input_ids.gather(1, batch.anchors)
    mask = dense_block_mask(batch.anchors, batch.block_valid, batch.input_ids.shape[1], bs)
    with torch.no_grad():
        together = drafter(head.embed(noise.view(b, -1)), feats,
                           torch.arange(feats.shape[1]).expand(b, -1),
                           (batch.anchors[:, :, None] + torch.arange(bs)).view(b, -1), mask)
        for bi in range(b):
            for j in range(n):
                if batch.block_valid[bi, j]:
                    alone = _block_alone(cfg, head, drafter, batch, feats, bi, j)
                    torch.testing.assert_close(together[bi, j * bs:(j + 1) * bs], alone[0], atol=2e-5, rtol=1e-4)


def _one_sequence_block(parts, j):
    """A 50-token sequence with 3 blocks, the anchor of block j, and block j run alone."""
    cfg, head, drafter, target = parts
    batch, feats = _batch(cfg, target, lengths=(50,), anchors=3)
    with torch.no_grad():
        return batch, feats, int(batch.anchors[0, j]), _block_alone(cfg, head, drafter, batch, feats, 0, j)


def test_block_sees_context_before_anchor_only(parts):
    cfg, head, drafter, _ = parts
    batch, feats, a, base = _one_sequence_block(parts, 1)
    with torch.no_grad():
        changed_after = feats.clone()
        changed_after[:, a:] += 5.0
        same = _block_alone(cfg, head, drafter, batch, changed_after, 0, 1)
        changed_before = feats.clone()
        changed_before[:, a - 1] += 5.0
        other = _block_alone(cfg, head, drafter, batch, changed_before, 0, 1)
    torch.testing.assert_close(base, same)
    assert (base - other).abs().max() > 1e-3  # KV injection: the context reaches every block token
    mask = dense_block_mask(batch.anchors, batch.block_valid, 50, cfg.block_size)[0, 0]
    q = cfg.block_size * 1 + 3  # a query of block 1
    assert mask[q, :a].all() and not mask[q, a:50].any()
    own = torch.zeros(mask.shape[1] - 50, dtype=torch.bool)
    own[cfg.block_size:2 * cfg.block_size] = True
    assert torch.equal(mask[q, 50:], own)


def test_context_cache_matches_full_context(parts):
    cfg, head, drafter, _ = parts
    batch, feats, a, full = _one_sequence_block(parts, 2)
    with torch.no_grad():
        noise = torch.full((1, cfg.block_size), cfg.mask_token_id)
        noise[0, 0] = batch.input_ids[0, a]
        cache = ContextCache(len(drafter.layers))
        pos = torch.arange(a, a + cfg.block_size)[None]
        drafter(head.embed(noise), feats[:, :a - 4], torch.arange(a - 4)[None], pos, cache=cache)
        incremental = drafter(head.embed(noise), feats[:, a - 4:a], torch.arange(a - 4, a)[None], pos, cache=cache)
    torch.testing.assert_close(full, incremental, atol=2e-5, rtol=1e-4)


def test_loss_same_position_labels_and_decay(parts):
    cfg, head, drafter, target = parts
    batch, feats = _batch(cfg, target, lengths=(40, 30), prompt=10, anchors=50)
    out = block_loss(drafter, head, batch, feats, gamma=7.0)
    assert out.count[0] == 0  # the anchor position is never scored
    # every scored label lies inside its sequence and is supervised: count per position from the anchors
    expect = torch.zeros(cfg.block_size)
    for b in range(2):
        n = int(batch.lengths[b])
        for a in batch.anchors[b][batch.block_valid[b]].tolist():
            for k in range(1, cfg.block_size):
                if a + k < n and batch.loss_mask[b, a + k] > 0:
                    expect[k] += 1
    torch.testing.assert_close(out.count, expect)
    w = decay_weights(8, 7.0)
    assert w[0] == 0 and w[1] == 1 and abs(float(w[2]) - float(np.exp(-1 / 7))) < 1e-6
    # anchors: supervised positions whose next token is supervised too (4 ends a turn: its block would score
    # nothing), at most num_anchors, sorted
    mask = np.array([0, 0, 1, 1, 1, 0, 1, 1], np.uint8)
    a = sample_anchors(mask, 10, torch.Generator().manual_seed(0)).tolist()
    assert a == [2, 3, 6]
    assert len(sample_anchors(mask, 2, torch.Generator().manual_seed(0))) == 2
    out.loss.backward()
    assert drafter.fc.weight.grad is not None and head.embed.weight.grad is None
    drafter.zero_grad()


def test_holdout_split_and_epoch_order_are_deterministic():
    ids = [f"s{i}" for i in range(2000)]
    held = [i for i in ids if is_holdout(i, 0.1)]
    assert 120 < len(held) < 280 and held == [i for i in ids if is_holdout(i, 0.1)]

    class Src:
        def __len__(self):
            return 50

        def shard(self, i):
            return i // 10

    a, b, c = epoch_order(Src(), 0, 0), epoch_order(Src(), 0, 0), epoch_order(Src(), 0, 1)
    assert a == b and a != c and sorted(a) == list(range(50))


class _PositionOracle(torch.nn.Module):
    """Returns, for each block token at position p, the LM-head row of the sequence's token at p + shift."""

    def __init__(self, cfg, head, input_ids, shift):
        super().__init__()
        self.config, self.head, self.ids, self.shift = cfg, head, input_ids, shift

    def forward(self, noise_embedding, features, ctx_positions, block_positions, mask=None, cache=None):
        pos = (block_positions + self.shift).clamp(max=self.ids.shape[1] - 1)
        return self.head.lm_head.weight[self.ids.gather(1, pos)] * 50.0


def test_training_labels_are_same_position_not_shifted(parts):
    """A drafter that outputs token anchor+k at block position k is scored 100% right; one shifted by a
    position (the known bug that collapses acceptance) is scored wrong."""
    cfg, head, _, target = parts
    batch, feats = _batch(cfg, target, lengths=(60, 45), prompt=10, anchors=20, seed=3)
    right = block_loss(_PositionOracle(cfg, head, batch.input_ids, 0), head, batch, feats, gamma=7.0)
    assert torch.equal(right.correct, right.count) and right.count.sum() > 0
    shifted = block_loss(_PositionOracle(cfg, head, batch.input_ids, 1), head, batch, feats, gamma=7.0)
    assert float(shifted.correct.sum()) < 0.1 * float(shifted.count.sum())
    assert float(shifted.loss) > float(right.loss) + 1.0


def _tile_sets(m):
    """Per (batch, query tile): the sorted partial and full key tiles of a BlockMask."""
    out = []
    for bi in range(m.kv_num_blocks.shape[0]):
        for qi in range(m.kv_num_blocks.shape[2]):
            k, f = int(m.kv_num_blocks[bi, 0, qi]), int(m.full_kv_num_blocks[bi, 0, qi])
            out.append((sorted(m.kv_indices[bi, 0, qi, :k].tolist()), sorted(m.full_kv_indices[bi, 0, qi, :f].tolist())))
    return out


@pytest.mark.parametrize("b,n,s,bs", [(2, 24, 300, 16), (2, 16, 256, 16), (1, 40, 1000, 8), (3, 16, 400, 16)])
def test_tile_block_mask_equals_create_block_mask(b, n, s, bs):
    """The BlockMask counted per tile (the training default) has exactly the tiles create_block_mask finds by
    evaluating every (query, key) pair: same skipped, partial and full tiles, also at ragged edges."""
    from dflash_pipeline.drafter.masks import flex_block_mask, tile_block_mask

    g = torch.Generator().manual_seed(s)
    anchors = torch.sort(torch.randint(s // 2, s, (b, n), generator=g), dim=1).values
    valid = torch.arange(n).expand(b, n) < n - 3  # the last blocks are padding
    ref, new = flex_block_mask(anchors, valid, s, bs), tile_block_mask(anchors, valid, s, bs)
    assert _tile_sets(new) == _tile_sets(ref)
    assert new.seq_lengths == ref.seq_lengths
    assert any(p for p, _ in _tile_sets(new)) and any(f for _, f in _tile_sets(new))  # both kinds occur


def test_chunked_head_cross_entropy_equals_the_plain_path(parts):
    """Chunked LM head + CE (gradient computed in the forward) gives the plain path's loss, gradients and
    per-position accuracy, with chunks that do not divide the token count."""
    cfg, head, drafter, target = parts
    batch, feats = _batch(cfg, target)
    res = {}
    for chunk in (0, 7, 4096):
        drafter.zero_grad()
        out = block_loss(drafter, head, batch, feats, 7.0, head_chunk=chunk)
        out.loss.backward()
        res[chunk] = (out, torch.cat([p.grad.flatten() for p in drafter.parameters()]))
    plain, grad0 = res[0]
    for chunk in (7, 4096):
        out, grad = res[chunk]
        assert abs(float(out.loss) - float(plain.loss)) < 1e-6 * float(plain.loss)
        assert float((grad - grad0).norm() / grad0.norm()) < 1e-5
        assert torch.equal(out.correct, plain.correct) and torch.equal(out.count, plain.count)
        assert torch.allclose(out.ce_sum, plain.ce_sum, rtol=1e-5)


def test_loss_weightings_decay_dpace_none(parts):
    """dpace = decay x (per block: sum over scored j >= k of prod_{i<=j} ((1-a) q_i + a)), computed here by
    loops from the per-token CE; at gamma 0 the D-PACE weight alone (the peers' dpace); none = uniform weights;
    the three give three different losses."""
    import math

    from dflash_pipeline.drafter.batch import scored_mask
    from dflash_pipeline.drafter.loss import draft_all_blocks, scored_labels

    cfg, head, drafter, target = parts
    batch, feats = _batch(cfg, target, lengths=(30, 26), prompt=10, anchors=5)
    bs, alpha, gamma = cfg.block_size, 0.3, 4.0
    with torch.no_grad():
        out = {w: block_loss(drafter, head, batch, feats, gamma, weighting=w, dpace_alpha=alpha)
               for w in ("decay", "dpace", "none")}
        alone = block_loss(drafter, head, batch, feats, 0.0, weighting="dpace", dpace_alpha=alpha)
        hidden = draft_all_blocks(drafter, head, batch, feats, "sdpa", None)
        y, w_decay, pos_k, index = scored_labels(batch, batch.input_ids, bs, gamma)
        sel = scored_mask(batch, bs)
        assert torch.equal(index, sel.nonzero().squeeze(1))
        ce = torch.nn.functional.cross_entropy(head.lm_head(hidden.reshape(-1, hidden.shape[-1])[sel]), y,
                                               reduction="none")
    flat_ce = torch.zeros(sel.shape[0])
    flat_ce[sel] = ce
    ref_num = ref_den = alone_num = alone_den = 0.0
    for blk in range(sel.shape[0] // bs):
        idx = range(blk * bs, (blk + 1) * bs)
        for k in idx:
            if not sel[k]:
                continue
            w = 0.0
            for j in idx:
                if j >= k and sel[j]:
                    w += math.prod((1 - alpha) * math.exp(-float(flat_ce[i])) + alpha for i in idx if i <= j and sel[i])
            alone_num, alone_den = alone_num + w * float(flat_ce[k]), alone_den + w
            w *= math.exp(-(k - blk * bs - 1) / gamma)
            ref_num += w * float(flat_ce[k])
            ref_den += w
    assert abs(float(out["dpace"].loss) - ref_num / ref_den) < 1e-5
    assert abs(float(alone.loss) - alone_num / alone_den) < 1e-5
    assert abs(float(alone.loss) - float(out["dpace"].loss)) > 1e-4
    assert abs(float(out["none"].loss) - float(ce.mean())) < 1e-5
    assert abs(float(out["decay"].loss) - float((ce * w_decay).sum() / w_decay.sum())) < 1e-5
    losses = sorted(float(o.loss) for o in out.values())
    assert losses[1] - losses[0] > 1e-4 and losses[2] - losses[1] > 1e-4


def test_loss_normalized_by_samples_is_the_weighted_sum_over_the_batchs_samples(parts):
    """`loss_normalization: samples` (SpecForge's D-PACE): the weighted CE sum over the micro-batch's samples, so
    its gradient is the weighted mean's times weight_sum / samples: the same direction, another scale."""
    cfg, head, drafter, target = parts
    batch, feats = _batch(cfg, target, lengths=(30, 26, 33), prompt=10, anchors=5)
    assert batch.num_samples == 3

    def loss_and_grad(normalization):
        drafter.zero_grad(set_to_none=True)
        out = block_loss(drafter, head, batch, feats, 4.0, weighting="dpace", normalization=normalization)
        out.loss.backward()
        return out, torch.cat([p.grad.flatten() for p in drafter.parameters() if p.grad is not None])

    mean, g_mean = loss_and_grad("weights")
    per_sample, g_sum = loss_and_grad("samples")
    drafter.zero_grad(set_to_none=True)
    scale = float(mean.weight_sum) / 3
    assert scale > 2  # the two differ: a test of the scale, not of 1 == 1
    assert abs(per_sample.loss.item() - mean.loss.item() * scale) < 1e-4 * per_sample.loss.item()
    assert torch.allclose(g_sum, g_mean * scale, rtol=1e-3, atol=1e-7)
    with pytest.raises(ValueError, match="loss normalization 'tokens'"):
        block_loss(drafter, head, batch, feats, 4.0, normalization="tokens")


def test_dpace_under_soft_labels_weighs_by_the_drafters_probability_of_the_targets_greedy_token(parts):
    """labels: distill with D-PACE: q_j is the drafter's probability of the target's argmax, so the weights are
    those of hard labels equal to that argmax (the same weight sum), not of exp(-soft CE), which also falls with
    the target's own entropy."""
    cfg, head, drafter, target = parts
    batch, feats = _batch(cfg, target, lengths=(30, 26), prompt=10, anchors=5)
    g = torch.Generator().manual_seed(1)
    soft = torch.randn(*batch.input_ids.shape, cfg.hidden_size, generator=g) * 3.0
    with torch.no_grad():
        greedy = head.lm_head(soft).argmax(-1)
        kw = dict(weighting="dpace", dpace_alpha=0.3)
        soft_loss = block_loss(drafter, head, batch, feats, 4.0, soft=soft, **kw)
        hard_loss = block_loss(drafter, head, batch, feats, 4.0, labels=greedy, **kw)
        decay = block_loss(drafter, head, batch, feats, 4.0, soft=soft, weighting="decay")
    assert abs(float(soft_loss.weight_sum) - float(hard_loss.weight_sum)) < 1e-4 * float(hard_loss.weight_sum)
    assert abs(float(soft_loss.loss) - float(hard_loss.loss)) > 1e-3  # the soft CE is scored, not the hard one
    assert abs(float(soft_loss.weight_sum) - float(decay.weight_sum)) > 1e-3


def test_heldout_acceptance_is_the_leading_run_of_greedy_matches(parts):
    """block_acceptance against a per-block reference: each block drafted alone, its argmax compared with
    the data position by position until the first miss (or an unsupervised / out-of-range label)."""
    from dflash_pipeline.drafter.heldout import block_acceptance

    cfg, head, drafter, target = parts
    batch, feats = _batch(cfg, target, lengths=(40, 31), prompt=8, anchors=9, seed=5)
    # make some drafts right: the data continuation of a few blocks is the drafter's own greedy output
    for b, j in ((0, 1), (1, 2), (1, 4)):
        a = int(batch.anchors[b, j])
        pred = head.lm_head(_block_alone(cfg, head, drafter, batch, feats, b, j)[0]).argmax(-1)
        n = int(batch.lengths[b])
        for k in range(1, min(cfg.block_size, n - a)):
            batch.input_ids[b, a + k] = pred[k] if k < 5 else (pred[k] + 1) % head.vocab_rows
    feats = target_features(target, batch.input_ids, batch.lengths, cfg.target_layer_ids)
    with torch.no_grad():
        blocks, accepted, reach = block_acceptance(drafter, head, batch, feats, "sdpa", None)
        ref_len, ref_reach = [], torch.zeros(cfg.block_size)
        for b in range(2):
            for j in range(int(batch.block_valid[b].sum())):
                a, n = int(batch.anchors[b, j]), int(batch.lengths[b])
                pred = head.lm_head(_block_alone(cfg, head, drafter, batch, feats, b, j)[0]).argmax(-1)
                run = 0
                for k in range(1, cfg.block_size):
                    if a + k >= n or batch.loss_mask[b, a + k] == 0 or pred[k] != batch.input_ids[b, a + k]:
                        break
                    run += 1
                ref_len.append(1 + run)
                ref_reach[: run + 1] += 1
    assert blocks == len(ref_len) and abs(accepted - sum(ref_len)) < 1e-9
    assert torch.equal(reach, ref_reach) and max(ref_len) >= 5  # the planted blocks reach position 4


def test_acceptance_stopped_improving_verdict():
    from dflash_pipeline.drafter.heldout import stalled

    rising = [(10, 1.0), (20, 1.5), (30, 2.0)]
    assert not stalled(rising, 2)["stopped_improving"]
    flat = rising + [(40, 2.005), (50, 1.9)]  # +0.005 is below MIN_GAIN
    v = stalled(flat, 2)
    assert v["stopped_improving"] and v["best_step"] == 40 and v["measurements_since_gain"] == 2
    assert not stalled(flat, 3)["stopped_improving"] and not stalled(flat, 0)["stopped_improving"]
