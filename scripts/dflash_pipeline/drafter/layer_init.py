"""The drafter's decoder layers started from the target's own layers instead of random weights (`train.layer_init`).

The drafter's layers have the target's shapes (config.py copies hidden, heads, head_dim, intermediate size), so
a target decoder layer's attention and MLP projections and its two RMSNorms fit one drafter layer as they are.
`target-first` copies the target's first N layers (their input, like the drafter's block tokens, starts as token
embeddings); `target-last` its last N layers and its final norm (the drafter's output goes through the target's
LM head, which those layers feed). What the target lacks keeps its fresh value: the fusion `fc` and
`hidden_norm`, and the per-head q/k norms of a target without them (Llama: ones, so attention logits are
normalised where the target's were not). At 3 layers out of 30 this is a starting point, not a copy of the
target's function: the context comes in through the injected keys and values, which the target never saw.
Random init (`random`) is the paper's; the others are a recipe variant measured by MT-Bench tau.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from torch import nn

from dflash_pipeline.drafter.target_head import safetensor_files
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.target import read_config, text_config

log = logging.getLogger(__name__)

LAYER_INITS = ("random", "target-first", "target-last")
# drafter parameter names inside a layer; a target may lack the optional ones (q/k norms, biases)
_REQUIRED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
             "input_layernorm.weight", "post_attention_layernorm.weight")


def source_layers(kind: str, n_drafter: int, n_target: int) -> list[int]:
    """The target layer each drafter layer starts from."""
    if n_drafter > n_target:
        raise PipelineError(f"train.layer_init {kind}: {n_drafter} drafter layers but the target has {n_target}")
    return list(range(n_drafter)) if kind == "target-first" else list(range(n_target - n_drafter, n_target))


def _tensor_names(files: dict[str, Path], layer: int) -> dict[str, str]:
    """suffix inside the layer -> the target's tensor name (`model.layers.3.mlp.up_proj.weight`, or under a
    multimodal prefix); the shortest name wins where several match (a vision tower's layers are longer)."""
    pat = re.compile(rf"(?:^|\.)layers\.{layer}\.(.+)$")
    out: dict[str, str] = {}
    for name in sorted(files, key=len):
        m = pat.search(name)
        if m and "vision" not in name and m.group(1) not in out:
            out[m.group(1)] = name
    return out


def init_from_target(drafter: nn.Module, model_dir: str | Path, kind: str) -> dict:
    """Copy the target's layers into `drafter` (in place) for `kind` in LAYER_INITS; returns what was copied."""
    if kind == "random":
        return {}
    if kind not in LAYER_INITS:
        raise PipelineError(f"train.layer_init {kind!r}: one of {', '.join(LAYER_INITS)}")
    from safetensors import safe_open

    model_dir = Path(model_dir)
    files = safetensor_files(model_dir)
    n_target = int(text_config(read_config(model_dir))["num_hidden_layers"])
    sources = source_layers(kind, len(drafter.layers), n_target)
    params = dict(drafter.named_parameters())
    copied, kept = [], set()

    def load(name: str) -> torch.Tensor:
        with safe_open(str(files[name]), framework="pt") as fh:
            return fh.get_tensor(name)

    def put(dest: str, src: str) -> None:
        value, p = load(src), params[dest]
        if tuple(value.shape) != tuple(p.shape):
            raise PipelineError(f"train.layer_init {kind}: {model_dir} tensor {src} has shape {tuple(value.shape)}, "
                                f"the drafter's {dest} {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(value.to(p.dtype))
        copied.append(dest)

    for i, t in enumerate(sources):
        names = _tensor_names(files, t)
        missing = [k for k in _REQUIRED if k not in names]
        if missing:
            raise PipelineError(f"train.layer_init {kind}: {model_dir} has no {missing[0]} for layer {t} (a dense "
                                "decoder layer is needed; use layer_init: random)")
        for dest in (n for n in params if n.startswith(f"layers.{i}.")):
            suffix = dest.removeprefix(f"layers.{i}.")
            if suffix in names:
                put(dest, names[suffix])
            else:
                kept.add(suffix)
    if kind == "target-last":
        final = [n for n in files if re.search(r"(?:^|\.)model\.norm\.weight$|^norm\.weight$", n) and "vision" not in n]
        if final:
            put("norm.weight", sorted(final, key=len)[0])
    log.info("drafter layers 0-%d start as the target's layers %d-%d (%d tensors; kept fresh: fc, hidden_norm%s)",
             len(sources) - 1, sources[0], sources[-1], len(copied),
             "".join(f", {k}" for k in sorted(kept)))
    return {"source_layers": sources, "tensors": len(copied), "kept": sorted(kept)}
