"""Which target layers feed the drafter (DFlash `target_layer_ids`) and what their features are, one
definition shared by extraction, online training and evaluation.

An id k is a decoder-layer index of the target; its feature is that decoder layer's *output* (the residual
stream after layer k, before the final norm), captured by a forward hook on the layer: what SGLang and vLLM
capture when they serve the drafter. For k < L-1 that is `hidden_states[k + 1]` of `output_hidden_states`,
but not for k = L-1: transformers (4.x and 5.x) puts the final norm's output there.
"""

from __future__ import annotations

from dflash_pipeline import settings
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.target import text_config


def find_decoder_layers(model):
    """The target's decoder layer list (dense, MoE, hybrid GDN, or the language model of a VL wrapper)."""
    import torch

    n = text_config(model.config).num_hidden_layers
    candidates = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.split(".")[-1] == "layers" and len(module) == n:
            if any(part in name for part in ("visual", "vision", "audio", "mtp")):
                continue
            candidates.append((name.count("."), name, module))
    if not candidates:
        raise PipelineError(f"cannot find the {n} decoder layers of {type(model).__name__}")
    return sorted(candidates)[0][2]


class LayerOutputs:
    """Forward hooks on the decoder layers `layer_ids` of `model`; `features()` concatenates what they output
    in the last forward ([B, S, n*H], id order). A context manager: the hooks go with it."""

    def __init__(self, model, layer_ids):
        layers = find_decoder_layers(model)
        self.ids = validate_target_layer_ids(layer_ids, len(layers))
        self._out: dict[int, object] = {}
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in self.ids]

    def _hook(self, i):
        def hook(module, args, output):
            self._out[i] = output[0] if isinstance(output, (tuple, list)) else output

        return hook

    def features(self):
        import torch

        missing = [i for i in self.ids if i not in self._out]
        if missing:
            raise PipelineError(f"target layers {missing} produced no output in the forward pass")
        out = torch.cat([self._out[i] for i in self.ids], dim=-1)
        self._out.clear()
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


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
            f"(valid ids 0..{num_target_layers - 1}; id k means the output of decoder layer k)")
    if sorted(set(ids)) != ids:
        raise PipelineError(f"target_layer_ids {ids} must be strictly increasing without repeats")
    return ids


def resolve_target_layer_ids(ids, num_layers: int | None, num_target_layers: int) -> list[int]:
    """The drafter settings `target_layer_ids` when given, else the default spread for `num_layers` drafter layers
    (else the schema's drafter.num_layers), validated against the target. The plan resolves them once for the
    workflow; a stage run by hand without them resolves them the same way."""
    if ids:
        return validate_target_layer_ids(ids, num_target_layers)
    n = num_layers or settings.default("drafter.num_layers")
    return validate_target_layer_ids(default_target_layer_ids(num_target_layers, n), num_target_layers)
