"""Online features: the target runs beside the drafter and gives the outputs of its decoder layers
`target_layer_ids` (target_layers.LayerOutputs: the same tensors extraction stores and evaluation uses) and,
for `--labels target`, its own greedy predictions."""

from __future__ import annotations

import torch

from dflash_pipeline.target_layers import LayerOutputs


def _padding_mask(input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    s = input_ids.shape[1]
    return (torch.arange(s, device=input_ids.device)[None, :] < lengths[:, None]).long()


def target_features(target, input_ids: torch.Tensor, lengths: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """Concatenated outputs of the target's decoder layers `layer_ids` ([B, S, n*H]).

    Runs the target's decoder only (no LM head), under no_grad, with right padding masked out.
    """
    base = getattr(target, "model", None) or target.base_model
    with torch.no_grad(), LayerOutputs(target, layer_ids) as cap:
        base(input_ids=input_ids, attention_mask=_padding_mask(input_ids, lengths), use_cache=False)
        return cap.features()


def target_features_and_predictions(target, input_ids, lengths, layer_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Features as `target_features`, plus the target's own greedy token for every position [B, S]:
    predictions[t] = argmax of the target's logits at t - 1 (position 0 keeps the data token)."""
    with torch.no_grad(), LayerOutputs(target, layer_ids) as cap:
        out = target(input_ids=input_ids, attention_mask=_padding_mask(input_ids, lengths), use_cache=False)
        pred = input_ids.clone()
        pred[:, 1:] = out.logits[:, :-1].argmax(-1)
        return cap.features(), pred


def target_outputs(target, input_ids, lengths, layer_ids, predictions: bool):
    """(features, the target's greedy tokens with `predictions` else None) of a padded batch."""
    if predictions:
        return target_features_and_predictions(target, input_ids, lengths, layer_ids)
    return target_features(target, input_ids, lengths, layer_ids), None


def packed_target_features(target, batch, layer_ids, predictions: bool = False, pad_multiple: int = 1):
    """Online features of a packed row (`collate_packed`: samples end to end in [1, T]): the target runs on the
    samples as a padded batch [samples, S] (each from position 0, alone, as in the padded layout) and its outputs
    go back to the packed positions. Returns (features [1, T, n*H], labels [1, T] or None): with `predictions`,
    the target's greedy token per position as `target_features_and_predictions` gives it (each sample's first
    token keeps its data token; the row's padding keeps its ids)."""
    offsets, sizes = batch.sample_spans[:, 0], batch.sample_spans[:, 1]
    width = -(-batch.max_sample // pad_multiple) * pad_multiple
    cols = torch.arange(width, device=offsets.device)
    real = cols[None, :] < sizes[:, None]
    where = (offsets[:, None] + cols[None, :]).masked_fill(~real, 0)  # packed position of each padded slot
    ids = batch.input_ids[0][where].masked_fill(~real, 0)
    feats, pred = target_outputs(target, ids, sizes, layer_ids, predictions)
    # every slot is copied, the padded ones to a spare row T that is dropped: no boolean selection, whose size
    # the host would have to wait for
    t = batch.input_ids.shape[1]
    dest = where.masked_fill(~real, t).view(-1)
    packed = feats.new_zeros(t + 1, feats.shape[-1]).index_copy_(0, dest, feats.reshape(-1, feats.shape[-1]))
    if pred is None:
        return packed[None, :t], None
    labels = torch.cat([batch.input_ids[0], batch.input_ids.new_zeros(1)]).index_copy_(0, dest, pred.reshape(-1))
    return packed[None, :t], labels[None, :t]
