"""Capturing the target's hidden states at chosen decoder layers with forward hooks, stopping the forward
right after the last wanted layer (no later layers, no final norm, no LM head)."""

from __future__ import annotations

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.target_layers import find_decoder_layers, validate_target_layer_ids


class _StopForward(Exception):
    """Raised by the hook of the last wanted layer: nothing after it is needed."""


class LayerCapture:
    """Forward hooks on the wanted layers; `run(input_ids)` returns their outputs [B, S, n, H].

    An id k captures the output of decoder layer k (target_layers.py: the one feature definition).
    """

    def __init__(self, model, layer_ids):
        self.model = model
        self.layers = find_decoder_layers(model)
        self.ids = validate_target_layer_ids(layer_ids, len(self.layers))
        self._caps: dict[int, object] = {}
        self._active = False
        self._handles = []
        last = self.ids[-1]
        for i in self.ids:
            self._handles.append(self.layers[i].register_forward_hook(self._hook(i, i == last)))

    def _hook(self, i, stop):
        def hook(module, args, output):
            if not self._active:  # other forwards of the model are left alone
                return None
            self._caps[i] = output[0] if isinstance(output, (tuple, list)) else output
            if stop:
                raise _StopForward

        return hook

    def run(self, input_ids, **kwargs):
        import torch

        self._caps.clear()
        self._active = True
        try:
            self.model(input_ids=input_ids, use_cache=False, **kwargs)
        except _StopForward:
            pass
        finally:
            self._active = False
        missing = [i for i in self.ids if i not in self._caps]
        if missing:
            raise PipelineError(f"layers {missing} produced no output in the forward pass")
        out = torch.stack([self._caps[i] for i in self.ids], dim=2)
        self._caps.clear()
        return out

    def compile(self):
        """torch.compile each needed layer's forward (the hooks stay outside the compiled code); fuses the
        norms, rotary and activation kernels around the matmuls. Layers after the last wanted one never run."""
        import torch

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        for layer in self.layers[: self.ids[-1] + 1]:
            layer.forward = torch.compile(layer.forward, dynamic=None)

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles.clear()
