"""The packed training layout (all samples of a micro-batch in one row) and the FLOP count behind the logged MFU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_pipeline.drafter.batch import collate, collate_packed, sample_anchors, scored_mask, with_scored_index
from dflash_pipeline.drafter.config import DrafterConfig
from dflash_pipeline.drafter.distributed import Dist
from dflash_pipeline.drafter.features import target_features
from dflash_pipeline.drafter.flops import StepCounts, batch_counts, peak_basis, step_flops
from dflash_pipeline.drafter.loss import block_loss
from dflash_pipeline.drafter.metrics import StepMetrics
from dflash_pipeline.drafter.model import DFlashDrafter
from dflash_pipeline.drafter.target_head import load_target_head, resolve_mask_token_id
from dflash_pipeline.target import read_config as read_target_config
from dflash_pipeline.target_layers import default_target_layer_ids


@pytest.fixture(scope="module")
def parts(tiny_target):
    from transformers import AutoModelForCausalLM

    tc = read_target_config(tiny_target)
    head = load_target_head(tiny_target)
    ids = default_target_layer_ids(tc["num_hidden_layers"], 2)
    cfg = DrafterConfig.from_target(tc, 2, ids, 8, resolve_mask_token_id(tiny_target, None, head.vocab_rows),
                                    head.vocab_rows)
    target = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    return cfg, head, target


def _samples(cfg, target, lengths=(40, 57, 23), prompt=10, anchors=7):
    """Samples with their stored features (as the offline source gives them) and their anchors."""
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    samples, anc = [], []
    for n in lengths:
        mask = np.zeros(n, np.uint8)
        mask[prompt:] = 1
        ids = rng.integers(0, 1000, n)
        feats = target_features(target, torch.as_tensor(ids)[None], torch.tensor([n]), cfg.target_layer_ids)[0]
        samples.append({"input_ids": ids, "loss_mask": mask, "features": feats})
        anc.append(sample_anchors(mask, anchors, g))
    return samples, anc


def _loss_and_grads(cfg, head, batch):
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    out = block_loss(drafter, head, batch, batch.features, 7.0, head_chunk=16)
    out.loss.backward()
    return out, torch.cat([p.grad.flatten() for p in drafter.parameters()])


@pytest.mark.parametrize("weighting", ["decay", "dpace", "none"])
def test_host_scored_index_gives_the_same_loss_and_gradients(parts, weighting):
    """The training step's batches carry their scored positions as an index computed on the host
    (with_scored_index), so the loss selects without a device synchronisation; the loss, gradients and counts are
    exactly those of a batch without it (the loss then finds them itself), in both layouts."""
    cfg, head, target = parts
    samples, anc = _samples(cfg, target)
    for batch in (collate(samples, anc, num_blocks=9), collate_packed(samples, anc, token_multiple=64)):
        indexed = with_scored_index(batch, cfg.block_size)
        mask = scored_mask(batch, cfg.block_size)
        assert indexed.scored_index.dtype == torch.long and int(mask.sum()) == len(indexed.scored_index) > 0
        assert not mask.view(-1, cfg.block_size)[:, 0].any()  # the anchor itself is never scored
        outs = []
        for b in (batch, indexed):
            torch.manual_seed(0)
            drafter = DFlashDrafter(cfg)
            out = block_loss(drafter, head, b, b.features, 7.0, head_chunk=16, weighting=weighting)
            out.loss.backward()
            outs.append((out, torch.cat([p.grad.flatten() for p in drafter.parameters()])))
        (a, ga), (b, gb) = outs
        assert torch.equal(a.loss, b.loss) and torch.equal(ga, gb) and torch.equal(a.weight_sum, b.weight_sum)
        assert torch.equal(a.count, b.count) and a.scored_tokens == b.scored_tokens == len(indexed.scored_index)


@pytest.mark.parametrize("chunk", [0, 16])
def test_soft_labels_read_once_per_position_give_the_same_loss_and_gradients(parts, chunk):
    """With soft labels the host index also lists the positions whose target distribution the scored tokens read,
    each once (with_scored_index(soft_chunk=)): up to block_size - 1 blocks score one position, and the loss,
    its D-PACE weights and the gradients are those of one target row per scored token, in both layouts."""
    cfg, head, target = parts
    samples, anc = _samples(cfg, target, anchors=30)  # dense anchors: overlapping blocks
    for batch in (collate(samples, anc, num_blocks=32), collate_packed(samples, anc, token_multiple=64)):
        soft = torch.randn(*batch.input_ids.shape, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
        plain, once = with_scored_index(batch, cfg.block_size), with_scored_index(batch, cfg.block_size, chunk)
        assert torch.equal(plain.scored_index, once.scored_index) and plain.soft_rows is None
        assert len(once.soft_rows) < len(once.scored_index) / 3  # the reuse the dedupe exists for
        assert torch.equal(torch.unique(once.soft_rows), once.soft_rows)
        outs = []
        for b in (plain, once):
            torch.manual_seed(0)
            drafter = DFlashDrafter(cfg)
            out = block_loss(drafter, head, b, b.features, 4.0, head_chunk=chunk, weighting="dpace",
                             dpace_alpha=0.2, soft=soft)
            out.loss.backward()
            outs.append((out, torch.cat([p.grad.flatten() for p in drafter.parameters()])))
        (a, ga), (b, gb) = outs
        assert torch.allclose(a.loss, b.loss, rtol=1e-6) and torch.allclose(ga, gb, rtol=1e-5, atol=1e-7)
        assert torch.allclose(a.weight_sum, b.weight_sum) and torch.equal(a.correct, b.correct)
        assert torch.equal(a.count, b.count) and a.scored_tokens == b.scored_tokens
        moved = once.to("cpu")  # the host-side spans travel with the batch's tensors
        assert moved.soft_spans == once.soft_spans and moved.max_sample == once.max_sample


def test_packed_row_gives_the_padded_loss_gradients_and_counts(parts):
    """Three samples end to end in one row (positions restarting, blocks seeing their own sample only, tail
    padding) train exactly as one padded row per sample: same loss, gradients, per-position counts."""
    cfg, head, target = parts
    samples, anc = _samples(cfg, target)
    padded = collate(samples, anc, num_blocks=9)  # padding blocks too, as on a GPU
    packed = collate_packed(samples, anc, token_multiple=64, block_multiple=8)
    assert packed.input_ids.shape == (1, 128) and packed.anchors.shape == (1, 24)
    assert int(packed.block_valid.sum()) == sum(len(a) for a in anc) == 21
    a, ga = _loss_and_grads(cfg, head, padded)
    b, gb = _loss_and_grads(cfg, head, packed)
    assert torch.equal(a.count, b.count) and torch.equal(a.correct, b.correct)
    assert a.scored_tokens == b.scored_tokens
    assert abs(float(a.loss.detach()) - float(b.loss.detach())) < 1e-5 * float(a.loss.detach())
    assert float((ga - gb).norm() / ga.norm()) < 1e-5
    assert batch_counts(padded, cfg.block_size) == batch_counts(packed, cfg.block_size)


def _tile_sets(m):
    return [(sorted(m.kv_indices[0, 0, qi, :int(m.kv_num_blocks[0, 0, qi])].tolist()),
             sorted(m.full_kv_indices[0, 0, qi, :int(m.full_kv_num_blocks[0, 0, qi])].tolist()))
            for qi in range(m.kv_num_blocks.shape[2])]


@pytest.mark.parametrize("lengths,tile_multiple,has_full", [((300, 520, 77, 410), 128, True), ((130, 90), 1, False)])
def test_packed_tile_block_mask_equals_create_block_mask(lengths, tile_multiple, has_full):
    """The GPU's BlockMask of a packed row, counted per tile from the anchors and each block's sample start,
    has exactly the tiles torch's create_block_mask finds by evaluating every (query, key) pair."""
    from dflash_pipeline.drafter.masks import flex_block_mask, tile_block_mask

    g = torch.Generator().manual_seed(1)
    samples, anc = [], []
    for n in lengths:
        mask = np.ones(n, np.uint8)
        mask[: n // 3] = 0
        samples.append({"input_ids": np.zeros(n, np.int64), "loss_mask": mask})
        anc.append(sample_anchors(mask, 40, g))
    bt = collate_packed(samples, anc, token_multiple=tile_multiple, block_multiple=tile_multiple)
    s, bs = bt.input_ids.shape[1], 16
    ref = flex_block_mask(bt.anchors, bt.block_valid, s, bs, bt.block_start)
    new = tile_block_mask(bt.anchors, bt.block_valid, s, bs, bt.block_start)
    assert _tile_sets(new) == _tile_sets(ref) and new.seq_lengths == ref.seq_lengths
    assert any(p for p, _ in _tile_sets(new)) and any(f for _, f in _tile_sets(new)) == has_full


def _tiny_config():
    return DrafterConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=4, num_hidden_layers=1, num_target_layers=4, target_layer_ids=[1, 2],
                         block_size=4, mask_token_id=0, vocab_size=10)


def test_step_flops_equal_a_hand_count():
    """H 8, I 16, 2 query heads and 1 kv head of 4, 1 layer, 2 target layers, vocab 10, blocks of 4; one
    sample of 6 tokens, anchors 1 and 3, 5 scored positions."""
    cfg = _tiny_config()
    mask = np.ones(6, np.uint8)
    batch = collate([{"input_ids": np.arange(6), "loss_mask": mask}], [torch.tensor([1, 3])], num_blocks=3)
    counts = batch_counts(batch, cfg.block_size)
    # positions: 2 valid blocks x 4 (the padding block is not counted); keys: (1 + 4) x 4 + (3 + 4) x 4
    assert counts == StepCounts(positions=8, attended=48, context=6, scored=5)
    assert batch_counts(with_scored_index(batch, cfg.block_size), cfg.block_size) == counts
    # per position: q 2*8*8 + k 2*8*4 + v 2*8*4 + o 2*8*8 = 384, MLP 3 * 2*8*16 = 768 -> 1152
    # layers: 3 (fwd + bwd) x (8 positions x 1152 + attention 4 x 8 (q dim) x 48 keys = 1536) = 32256
    # context: 6 tokens x (fc 2*16*8 fwd + the same for its weight gradient = 512, k/v 3 x 2*8*8 = 384) = 5376
    # head: 5 scored x (2*8*10 forward + 2*8*10 input gradient) = 1600
    assert step_flops(cfg, StepCounts(8, 48, 6, scored=5)) == 32256 + 5376 + 1600
    # soft labels (distill): the head's forward on the target's hidden state too, 5 x 2*8*10 more
    assert step_flops(cfg, StepCounts(8, 48, 6, scored=5), soft_labels=True) == 32256 + 5376 + 1600 + 800


def test_the_peak_mfu_is_set_against_is_named():
    """A measured matmul rate where one exists, else the spec sheet's dense peak, the longest name matching (an
    H20 is not an H200, a PCIe H100 not an SXM one); none on CPU or for an unknown GPU; a configured one wins."""
    gpu = torch.device("cuda")
    assert peak_basis(gpu, name="NVIDIA H200") == (790e12, "measured bf16 matmul rate of the H200")
    assert peak_basis(gpu, name="NVIDIA H100 80GB HBM3") == (989e12, "spec-sheet dense bf16 peak of the H100")
    assert peak_basis(gpu, name="NVIDIA H100 PCIe")[0] == 756e12 and peak_basis(gpu, name="NVIDIA H20")[0] == 148e12
    assert peak_basis(gpu, name="Tesla T4")[0] is None and peak_basis(torch.device("cpu"))[0] is None
    assert peak_basis(torch.device("cpu"), 312.0) == (312e12, "the configured peak")


def test_metrics_record_positions_tflops_and_mfu(parts):
    """The logged record carries trained positions/s, model TFLOP/s and MFU (against the given peak)."""
    cfg, head, target = parts
    samples, anc = _samples(cfg, target)
    batch = collate_packed(samples, anc)
    out, _ = _loss_and_grads(cfg, head, batch)
    counts = batch_counts(batch, cfg.block_size)
    assert counts.scored == out.scored_tokens  # counted on the host as the loss scores them
    flops = step_flops(cfg, counts)
    metrics = StepMetrics(cfg.block_size, torch.device("cpu"), peak_flops=1e9)
    metrics.add(out, counts.context, counts.positions, flops)
    rec = metrics.record(Dist("cpu"), 1, 0.1, 1e-3, torch.tensor(1.0))
    assert rec["positions_per_s"] > 0 and rec["tokens_per_s"] > 0
    assert rec["positions_per_s"] / rec["tokens_per_s"] == pytest.approx(counts.positions / counts.context, rel=1e-5)
    assert rec["mfu"] == pytest.approx(rec["tflops"] * 1e12 / 1e9)
    assert StepMetrics(cfg.block_size, torch.device("cpu")).record(Dist("cpu"), 1, 0.1, 0.0, 0.0)["mfu"] is None


def test_online_packed_features_are_each_samples_own_and_train_as_padded(parts):
    """Online, a packed row gets from the target what each sample gets alone (features, and with target labels
    its greedy tokens, the first token kept), zeros on the row's padding; the loss and gradients equal the
    padded online batch's (the target run on [B, S] with right padding)."""
    from dflash_pipeline.drafter.features import packed_target_features, target_features_and_predictions

    cfg, head, target = parts
    samples, anc = _samples(cfg, target)
    for x in samples:
        del x["features"]  # online: the source gives ids only
    packed = collate_packed(samples, anc, token_multiple=64, block_multiple=8, sample_multiple=4)
    feats, labels = packed_target_features(target, packed, cfg.target_layer_ids, labels="target", pad_multiple=16)
    covered = torch.zeros(packed.input_ids.shape[1], dtype=torch.bool)
    for x, (off, t) in zip(samples, packed.sample_spans.tolist()):
        f, p = target_features_and_predictions(target, torch.as_tensor(x["input_ids"])[None], torch.tensor([t]),
                                               cfg.target_layer_ids)
        assert torch.allclose(feats[0, off:off + t], f[0], atol=1e-5)
        assert torch.equal(labels[0, off:off + t], p[0]) and int(labels[0, off]) == int(x["input_ids"][0])
        covered[off:off + t] = True
    assert covered.sum() < covered.numel()  # gaps between samples (sample_multiple) and the tail padding
    assert not feats[0, ~covered].any() and torch.equal(labels[0, ~covered], packed.input_ids[0, ~covered])
    padded = collate(samples, anc, num_blocks=9)
    pf = target_features(target, padded.input_ids, padded.lengths, cfg.target_layer_ids)
    torch.manual_seed(0)
    a = block_loss(DFlashDrafter(cfg), head, padded, pf, 7.0, head_chunk=16)
    torch.manual_seed(0)
    b = block_loss(DFlashDrafter(cfg), head, packed, feats, 7.0, head_chunk=16)
    la, lb = float(a.loss.detach()), float(b.loss.detach())
    assert torch.equal(a.count, b.count) and abs(la - lb) < 1e-5 * la


def test_a_run_normalized_by_samples_trains_clipped_and_does_not_resume_a_weighted_mean_checkpoint(tiny_target,
                                                                                                   tmp_path):
    """`--loss-normalization samples` through the train command: the loss minimized is the weighted sum over the
    samples (its gradient far larger), the log still reports the weighted mean, and a checkpoint of the default
    normalization is set aside, not resumed (the setting is in the fingerprint only when set)."""
    import json

    from token_fixtures import train_two_steps, write_greedy_token_shard

    shard = tmp_path / "greedy-00000.parquet"
    write_greedy_token_shard(str(tiny_target), str(shard), 16, prompt_len=12, new_tokens=16, seed=0, prefix="g")

    def train(out, *extra):  # at SpecForge's D-PACE smoothing 0.5: the weights of an untrained drafter sum to
        # several times the samples (at the default 0.2 to barely more), so the gradients' ratio shows
        assert train_two_steps(tiny_target, shard, tmp_path / out, tmp_path / "ckpt", "--dpace-alpha", "0.5",
                               *extra) == 0
        summary = json.loads((tmp_path / out / "summary.json").read_text())
        records = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
        return summary, records[-2:]

    _, mean = train("weights")
    summary, per_sample = train("samples", "--loss-normalization", "samples")
    assert summary["resumed_from_step"] == 0 and list((tmp_path / "ckpt").glob("stale-*/step-*.pt"))
    # step 1 (same seed: the same weights, samples and anchors): the log reports the weighted mean CE either way,
    # and the gradient (its norm logged before clipping) is scaled by weight_sum / samples, several times here
    assert abs(per_sample[0]["loss"] - mean[0]["loss"]) < 1e-5 * mean[0]["loss"]
    assert per_sample[0]["grad_norm"] > 3 * mean[0]["grad_norm"]
