"""Static KV caches indexed by sequence position, one row per prompt, for batched decoding.

Column c of a row holds the keys/values of that row's token at position c, so rows that accept different
numbers of drafts need no bookkeeping beyond their own positions: a forward writes its tokens at their
positions (`scatter_`), and a query at position p sees columns <= p (target, causal) or < the block's anchor
(drafter context). Columns past a row's accepted tokens hold stale entries (rejected drafts, prompt padding);
they are never visible: the causal mask hides them until the block that covers them rewrites them.
Shapes never change during decoding, so a step can be captured as a CUDA graph.
"""

from __future__ import annotations

import torch

from dflash_pipeline.target import text_config


class PositionKVCache:
    """The target's cache; duck-types the `update` of a transformers Cache (full-attention layers only).

    `positions` [B, L] must be set to the positions of the tokens of the next forward before it runs.
    """

    is_compileable = False

    def __init__(self, model_config, batch: int, length: int, dtype: torch.dtype, device):
        tc = text_config(model_config)
        heads = tc.num_attention_heads
        kv_heads = getattr(tc, "num_key_value_heads", None) or heads
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
        shape = (batch, kv_heads, length, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(tc.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(tc.num_hidden_layers)]
        self.length = length
        self.columns = torch.arange(length, device=device)
        self.positions: torch.Tensor | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        idx = self.positions[:, None, :, None].expand(-1, key_states.shape[1], -1, key_states.shape[3])
        self.k[layer_idx].scatter_(2, idx, key_states.to(self.k[layer_idx].dtype))
        self.v[layer_idx].scatter_(2, idx, value_states.to(self.v[layer_idx].dtype))
        return self.k[layer_idx], self.v[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given explicitly

    def causal_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, 1, L, C] bool, True where the query at `positions` may see the column."""
        return self.columns[None, None, None, :] <= positions[:, None, :, None]


class PositionContextCache:
    """The drafter's context keys/values; duck-types `model.ContextCache.extend` for `DrafterAttention`.

    `positions` [B, Lc]: the positions of the context features of the next drafter call.
    """

    def __init__(self, cfg, batch: int, length: int, dtype: torch.dtype, device):
        shape = (batch, cfg.num_key_value_heads, length, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.columns = torch.arange(length, device=device)
        self.positions: torch.Tensor | None = None
        self.length = 0  # DFlashDrafter counts context here; unused

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.k[layer].scatter_(2, idx, k.to(self.k[layer].dtype))
        self.v[layer].scatter_(2, idx, v.to(self.v[layer].dtype))
        return self.k[layer], self.v[layer]

    def block_mask(self, anchor: torch.Tensor, block: int) -> torch.Tensor:
        """[B, 1, block, C + block] bool: context before each row's anchor, and the whole block."""
        ctx = self.columns[None, :] < anchor[:, None]
        seen = torch.cat([ctx, ctx.new_ones(ctx.shape[0], block)], dim=1)
        return seen[:, None, None, :].expand(-1, 1, block, -1)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the additive float mask that transformers' eager attention adds to its scores."""
    return torch.where(mask, 0.0, torch.finfo(dtype).min).to(dtype)
