"""Online features: the target runs beside the drafter and gives the outputs of its decoder layers
`target_layer_ids` (the same tensors extraction stores and evaluation uses: target_layers.py) and,
for `--labels target`, its own greedy predictions; for `--labels distill`, its final hidden state (after the
final norm), whose logits through the head are its next-token distribution (head_loss.py)."""

from __future__ import annotations

import torch

from dflash_pipeline.hidden_states.capture import LayerCapture
from dflash_pipeline.target_layers import LayerOutputs


def _padding_mask(input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    s = input_ids.shape[1]
    return (torch.arange(s, device=input_ids.device)[None, :] < lengths[:, None]).long()


def target_features(target, input_ids: torch.Tensor, lengths: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """Concatenated outputs of the target's decoder layers `layer_ids` ([B, S, n*H]).

    Runs the target's decoder up to the last of them only, as extraction does (hidden_states/capture.py: no later
    layers, no final norm, no LM head: SmolLM2 with layers up to 27 of 30 skips a tenth of its forward), under
    no_grad, with right padding masked out.
    """
    cap = LayerCapture(target, layer_ids)
    try:
        with torch.no_grad():
            return cap.run(input_ids, attention_mask=_padding_mask(input_ids, lengths)).flatten(2)
    finally:
        cap.remove()


def target_features_and_predictions(target, input_ids, lengths, layer_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Features as `target_features`, plus the target's own greedy token for every position [B, S]:
    predictions[t] = argmax of the target's logits at t - 1 (position 0 keeps the data token)."""
    with torch.no_grad(), LayerOutputs(target, layer_ids) as cap:
        out = target(input_ids=input_ids, attention_mask=_padding_mask(input_ids, lengths), use_cache=False)
        pred = input_ids.clone()
        pred[:, 1:] = out.logits[:, :-1].argmax(-1)
        return cap.features(), pred


def target_features_and_next_hidden(target, input_ids, lengths, layer_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Features as `target_features`, plus for every position t the target's final hidden state at t - 1
    [B, S, H] (the one its head reads to predict token t; position 0: zeros, never scored)."""
    base = getattr(target, "model", None) or target.base_model
    with torch.no_grad(), LayerOutputs(target, layer_ids) as cap:
        out = base(input_ids=input_ids, attention_mask=_padding_mask(input_ids, lengths), use_cache=False)
        last = out.last_hidden_state
        return cap.features(), torch.cat([torch.zeros_like(last[:, :1]), last[:, :-1]], dim=1)


LABELS = ("data", "target", "distill")


def target_outputs(target, input_ids, lengths, layer_ids, labels: str = "data"):
    """(features, labels) of a padded batch: labels None (`data`: the batch's own tokens), the target's greedy
    tokens [B, S] (`target`) or its final hidden states for each position's token [B, S, H] (`distill`)."""
    if labels == "target":
        return target_features_and_predictions(target, input_ids, lengths, layer_ids)
    if labels == "distill":
        return target_features_and_next_hidden(target, input_ids, lengths, layer_ids)
    if labels != "data":
        raise ValueError(f"labels {labels!r} is not one of {LABELS}")
    return target_features(target, input_ids, lengths, layer_ids), None


def packed_target_features(target, batch, layer_ids, labels: str = "data", pad_multiple: int = 1):
    """Online features of a packed row (`collate_packed`: samples end to end in [1, T]): the target runs on the
    samples as a padded batch [samples, S] (each from position 0, alone, as in the padded layout) and its outputs
    go back to the packed positions. Returns (features [1, T, n*H], labels): None for `data`; for `target` [1, T],
    the target's greedy token per position as `target_features_and_predictions` gives it (each sample's first
    token keeps its data token; the row's padding keeps its ids); for `distill` [1, T, H], the hidden states of
    `target_features_and_next_hidden` (zeros at each sample's first position and the padding)."""
    offsets, sizes = batch.sample_spans[:, 0], batch.sample_spans[:, 1]
    width = -(-batch.max_sample // pad_multiple) * pad_multiple
    cols = torch.arange(width, device=offsets.device)
    real = cols[None, :] < sizes[:, None]
    where = (offsets[:, None] + cols[None, :]).masked_fill(~real, 0)  # packed position of each padded slot
    ids = batch.input_ids[0][where].masked_fill(~real, 0)
    feats, pred = target_outputs(target, ids, sizes, layer_ids, labels)
    # every slot is copied, the padded ones to a spare row T that is dropped: no boolean selection, whose size
    # the host would have to wait for
    t = batch.input_ids.shape[1]
    dest = where.masked_fill(~real, t).view(-1)
    packed = feats.new_zeros(t + 1, feats.shape[-1]).index_copy_(0, dest, feats.reshape(-1, feats.shape[-1]))
    if pred is None:
        return packed[None, :t], None
    if labels == "distill":  # hidden states, copied like the features
        hidden = pred.new_zeros(t + 1, pred.shape[-1]).index_copy_(0, dest, pred.reshape(-1, pred.shape[-1]))
        return packed[None, :t], hidden[None, :t]
    tokens = torch.cat([batch.input_ids[0], batch.input_ids.new_zeros(1)]).index_copy_(0, dest, pred.reshape(-1))
    return packed[None, :t], tokens[None, :t]
