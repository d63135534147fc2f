"""Which target layers feed the drafter (DFlash `target_layer_ids`), shared by extraction and training.

An id is a decoder-layer index of the target; its feature is that layer's *output*, which is
`hidden_states[id + 1]` of a transformers forward with `output_hidden_states=True`.
"""

from __future__ import annotations

from dflash_pipeline.errors import PipelineError


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """n ids spread evenly from layer 1 to layer L-3 (Qwen3-8B, 36 layers, 5: [1, 9, 17, 25, 33];
    64 layers, 5: [1, 16, 31, 46, 61]); one drafter layer takes the middle layer L // 2."""
    L, n = int(num_target_layers), int(num_draft_layers)
    if n < 1:
        raise PipelineError(f"the drafter needs at least one layer, got {n}")
    if n == 1:
        return [L // 2]
    first, last = 1, L - 3
    if last - first + 1 < n:
        raise PipelineError(
            f"a target with {L} layers has only {max(0, last - first + 1)} layers between 1 and L-3 for "
            f"{n} drafter layers; set drafter.target_layer_ids explicitly")
    return [int(round(first + i * (last - first) / (n - 1))) for i in range(n)]


def validate_target_layer_ids(ids, num_target_layers: int) -> list[int]:
    """Ids as ints, each in [0, L), strictly increasing; a clear error otherwise."""
    try:
        ids = [int(i) for i in ids]
    except (TypeError, ValueError):
        raise PipelineError(f"target_layer_ids must be a list of integers, got {ids!r}") from None
    if not ids:
        raise PipelineError("target_layer_ids is empty")
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise PipelineError(
            f"target_layer_ids {ids}: {bad} out of range for a target with {num_target_layers} decoder layers "
            f"(valid ids 0..{num_target_layers - 1}; id k means the output of layer k = hidden_states[k + 1])")
    if sorted(set(ids)) != ids:
        raise PipelineError(f"target_layer_ids {ids} must be strictly increasing without repeats")
    return ids


def resolve_target_layer_ids(drafter_config: dict | None, num_target_layers: int,
                             default_draft_layers: int = 5) -> list[int]:
    """From the config's `drafter:` section: explicit `target_layer_ids`, else the default for
    `num_layers` (else `default_draft_layers`), validated against the target."""
    cfg = drafter_config or {}
    ids = cfg.get("target_layer_ids")
    if ids:
        return validate_target_layer_ids(ids, num_target_layers)
    n = cfg.get("num_layers") or default_draft_layers
    return validate_target_layer_ids(default_target_layer_ids(num_target_layers, n), num_target_layers)
