"""Online features: the target runs beside the drafter and gives the hidden states of its layers
`target_layer_ids` (and, for `--labels target`, its own greedy predictions)."""

from __future__ import annotations

import torch


def concat_layers(hidden_states, layer_ids: list[int]) -> torch.Tensor:
    """Outputs of the target layers `layer_ids`, concatenated: hidden_states[id + 1] ([B, S, n*H])."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def _padding_mask(input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    s = input_ids.shape[1]
    return (torch.arange(s, device=input_ids.device)[None, :] < lengths[:, None]).long()


def target_features(target, input_ids: torch.Tensor, lengths: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """Concatenated outputs of the target layers `layer_ids` ([B, S, n*H]), i.e. hidden_states[id + 1].

    Runs the target's decoder only (no LM head), under no_grad, with right padding masked out.
    """
    base = getattr(target, "model", None) or target.base_model
    with torch.no_grad():
        out = base(input_ids=input_ids, attention_mask=_padding_mask(input_ids, lengths),
                   output_hidden_states=True, use_cache=False)
        return concat_layers(out.hidden_states, layer_ids)


def target_features_and_predictions(target, input_ids, lengths, layer_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Features as `target_features`, plus the target's own greedy token for every position [B, S]:
    predictions[t] = argmax of the target's logits at t - 1 (position 0 keeps the data token)."""
    with torch.no_grad():
        out = target(input_ids=input_ids, attention_mask=_padding_mask(input_ids, lengths),
                     output_hidden_states=True, use_cache=False)
        pred = input_ids.clone()
        pred[:, 1:] = out.logits[:, :-1].argmax(-1)
    return concat_layers(out.hidden_states, layer_ids), pred
