"""The DFlash drafter: a few Qwen3-style decoder layers conditioned on the target's hidden states.

Structure (weight names are the ones SGLang and vLLM load, see `export.py`):

- `fc` (Linear(len(target_layer_ids) * H, H, no bias)) + `hidden_norm` (RMSNorm) fuse the concatenated
  target features of every context token into one H-vector (the "context").
- `layers.{i}`: Qwen3 decoder layers (pre-norm attention with per-head q/k RMSNorm, SwiGLU MLP) whose
  attention uses **KV injection**: queries come from the block tokens only; keys and values are computed
  with the layer's own k/v projections from the fused context *and* from the block tokens, concatenated.
  Attention is non-causal: a block sees the context before its anchor and all of its own tokens.
- `norm`: final RMSNorm; logits come from the target's LM head (frozen, not part of the drafter).
- RoPE positions continue the sequence: context token t has position t, block token k of a block anchored
  at position p has position p + k. RoPE rotates the first `rotary_dim` dimensions of each head (the
  target's partial rotary, see config.py) and passes the rest through.

The target's embedding and LM head live in `target_head.TargetHead` (frozen, never saved with the drafter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_pipeline.drafter.config import DRAFTER_FILES, DrafterConfig
from dflash_pipeline.drafter.split_attention import SplitMask, compiled_flex_attention, split_attend
from dflash_pipeline.errors import PipelineError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)  # stays in the input dtype (bf16 under autocast)


class RotaryEmbedding(nn.Module):
    """Plain RoPE (rotate-half / neox style, as Qwen3) over `rotary_dim` dims with optional linear scaling."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        dim = cfg.rotary_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        scaling = cfg.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif kind not in ("default", None):
            raise PipelineError(f"rope scaling {kind!r} is not supported by the drafter yet")
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, L, D]; cos/sin [B, L, R] with R <= D: the first R dims rotate, the rest pass through."""
    cos, sin = cos[:, None], sin[:, None]
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float) -> torch.Tensor:
    """q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D]; mask: None, bool [B, 1, Lq, Lk] (True = visible) or BlockMask."""
    gqa = q.shape[1] != k.shape[1]
    if mask is not None and not isinstance(mask, torch.Tensor):  # flex attention BlockMask
        return compiled_flex_attention()(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


class ContextCache:
    """Per-layer keys/values of the context tokens seen so far (inference): only new context is projected."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer] is not None:
            k = torch.cat([self.k[layer], k], dim=2)
            v = torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, ctx, rope_ctx, rope_blk, mask, cache: ContextCache | None, layer: int):
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, *rope_blk)
        k_blk, v_blk = self._kv(x, *rope_blk)
        if ctx is not None and ctx.shape[1] > 0:
            k_ctx, v_ctx = self._kv(ctx, *rope_ctx)
        else:
            k_ctx = v_ctx = x.new_zeros(b, self.kv_heads, 0, self.head_dim)
        if cache is not None:
            k_ctx, v_ctx = cache.extend(layer, k_ctx, v_ctx)
        if isinstance(mask, SplitMask):  # training: context and own block attended apart (split_attention.py)
            out = split_attend(q, k_ctx, v_ctx, k_blk, v_blk, mask, self.scale)
        else:
            out = attend(q, torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2), mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise PipelineError(f"drafter MLP supports silu only, target uses {cfg.hidden_act!r}")
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg)

    def forward(self, h, ctx, rope_ctx, rope_blk, mask, cache, layer):
        h = h + self.self_attn(self.input_layernorm(h), ctx, rope_ctx, rope_blk, mask, cache, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList([DrafterLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated target features [B, T, n*H] -> fused context [B, T, H]."""
        return self.hidden_norm(self.fc(features))

    def forward(
        self,
        noise_embedding: torch.Tensor,
        features: torch.Tensor | None,
        ctx_positions: torch.Tensor,
        block_positions: torch.Tensor,
        mask=None,
        cache: ContextCache | None = None,
    ) -> torch.Tensor:
        """Hidden states of the block tokens [B, Lq, H] (before the LM head).

        noise_embedding: target embedding of the block tokens [B, Lq, H] (anchor, then mask tokens);
        features: new context features [B, Lc, n*H] (with a cache, only those not seen before);
        ctx_positions [B, Lc], block_positions [B, Lq]; mask: key visibility over [context | block] keys.
        """
        dtype = noise_embedding.dtype
        ctx = self.fuse(features.to(dtype)) if features is not None and features.shape[1] > 0 else None
        rope_ctx = self.rotary(ctx_positions, dtype)
        rope_blk = self.rotary(block_positions, dtype)
        h = noise_embedding
        for i, layer in enumerate(self.layers):
            h = layer(h, ctx, rope_ctx, rope_blk, mask, cache, i)
        if cache is not None and features is not None:
            cache.length += features.shape[1]
        return self.norm(h)

    def engine_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under the names the engines load (`layers.*`, `fc.weight`, `hidden_norm.weight`, `norm.weight`)."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith("rotary.")}


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def save_drafter(directory, drafter: DFlashDrafter) -> None:
    """A drafter's two files (DRAFTER_FILES) in `directory`: the weights under the engines' names, and its config."""
    import os

    from safetensors.torch import save_file

    from dflash_pipeline import storage

    weights, config = (os.path.join(str(directory), name) for name in DRAFTER_FILES)
    save_file(drafter.engine_state_dict(), weights)
    storage.write_json(config, drafter.config.to_dict())
