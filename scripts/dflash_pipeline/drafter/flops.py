"""Model FLOPs of a training step, counted over what is trained (not over padding), and the MFU they give.

Counted (matmuls and attention only; norms, RoPE, softmax and the optimizer are left out, as MFU counts go):
- every position of every valid block (anchor + block_size - 1 mask tokens: `block_size` computed positions
  per anchor), in each of the L drafter layers: q/k/v/o projections 2*H*(2*Hq*D + 2*Hkv*D) and the SwiGLU
  MLP 2*3*H*I, plus attention 4*Hq*D per key it sees (the context before its anchor, from its own sample's
  first token, and the block's own block_size keys); times 3 for forward + backward (input and weight
  gradients);
- every context token (the sample's own tokens, whose target features the drafter reads): the fc fusion
  2*(n*H)*H forward + the same for its weight gradient (the features need no gradient), and its k/v
  projection in every layer 2*H*2*Hkv*D, times 3;
- every scored position (a block position k >= 1 whose label is supervised and inside the sample): the
  frozen LM head's forward 2*H*V and its input gradient 2*H*V (no weight gradient: the head is frozen); with
  `labels: distill` one more forward 2*H*V, the target's distribution from its own hidden state.
At the SmolLM2-135M drafter shape (5 layers, H 576, 9/3 heads of 64, I 1536, V 49,152) that is 106.2 MFLOP
per computed block position, 34.6 KFLOP per attended key, 113.2 MFLOP per scored position and 13.3 MFLOP
per context token: ~230 MFLOP per trained position at ~200 context keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# measured bf16 dense matmul rate (8192^3, benchmarks/gpu_rates.py): the ceiling MFU is set against
MEASURED_BF16 = {"H200": 790e12}
# where none is measured: the vendor's dense bf16 peak (SXM parts), which no kernel reaches; an MFU against it
# reads lower than one against a measured rate (H200: 790 measured of 989)
SPEC_BF16_DENSE = {"H100": 989e12, "H100 PCIe": 756e12, "H200": 989e12, "H20": 148e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}


@dataclass(frozen=True)
class StepCounts:
    positions: int    # trained positions: block_size per valid block (anchor), the scored ones among them
    attended: int     # keys attended, summed over those positions
    context: int      # context (data) tokens
    scored: int = 0   # scored positions (through the LM head)

    def __add__(self, other: "StepCounts") -> "StepCounts":
        return StepCounts(*(a + b for a, b in zip(vars(self).values(), vars(other).values())))


def batch_counts(batch, block_size: int) -> StepCounts:
    """Blocks, attended keys, context tokens and scored positions of a batch (padded or packed layout; any
    device: the training step counts its batches on the host, before they go to the GPU)."""
    from dflash_pipeline.drafter.batch import scored_mask

    valid = batch.block_valid
    start = torch.zeros_like(batch.anchors) if batch.block_start is None else batch.block_start
    seen = ((batch.anchors - start).clamp(min=0) + block_size) * valid        # keys per position of each block
    scored = (int(batch.scored_index.numel()) if batch.scored_index is not None
              else int(scored_mask(batch, block_size).sum()))
    return StepCounts(int(valid.sum()) * block_size, int(seen.sum()) * block_size, int(batch.lengths.sum()), scored)


def step_flops(cfg, counts: StepCounts, soft_labels: bool = False) -> float:
    """Model FLOPs (forward + backward) of a step with these counts, for a drafter config (see the docstring);
    `soft_labels` (`labels: distill`): the head also runs forward on the target's hidden state at every scored
    position (its distribution, no gradient)."""
    h, i, v, n_layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_position = 2 * h * (2 * q_dim + 2 * kv_dim) + 2 * 3 * h * i
    layers = 3 * n_layers * (counts.positions * per_position + 4 * q_dim * counts.attended)
    fc = 2 * 2 * len(cfg.target_layer_ids) * h * h
    context = counts.context * (fc + 3 * n_layers * 2 * h * 2 * kv_dim)
    head = counts.scored * (3 if soft_labels else 2) * 2 * h * v
    return float(layers + context + head)


def peak_basis(device: torch.device, override_tflops: float = 0.0, name: str | None = None
               ) -> tuple[float | None, str]:
    """(FLOP/s, what it is): `override_tflops` if given, else the measured matmul rate of a known GPU, else its
    spec sheet's dense bf16 peak, else None (CPU, an unknown GPU: MFU is not reported). `name`: the device's
    name (default: asked of CUDA)."""
    if override_tflops > 0:
        return override_tflops * 1e12, "the configured peak"
    if device.type != "cuda":
        return None, "no peak on CPU"
    name = name or torch.cuda.get_device_name(device)
    # the longest matching key: "H200" before "H20"
    for table, what in ((MEASURED_BF16, "measured bf16 matmul rate"), (SPEC_BF16_DENSE, "spec-sheet dense bf16 peak")):
        key = max((k for k in table if k in name), key=len, default=None)
        if key:
            return table[key], f"{what} of the {key}"
    return None, f"no known peak for {name}"
