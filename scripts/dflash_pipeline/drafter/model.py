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
  at position p has position p + k.

The target's embedding and LM head live in `TargetHead` (frozen, loaded from the target model directory,
never saved with the drafter).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash_pipeline.errors import PipelineError


@dataclass
class DrafterConfig:
    """Everything that shapes the drafter; the layer shapes are copied from the target's config."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    num_target_layers: int
    target_layer_ids: list[int]
    block_size: int
    mask_token_id: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    hidden_act: str = "silu"
    target_model_type: str = "qwen3"
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        return cls(**d)

    @classmethod
    def from_target(
        cls,
        target_config: dict,
        num_layers: int,
        target_layer_ids: list[int],
        block_size: int,
        mask_token_id: int,
        vocab_rows: int | None = None,
    ) -> "DrafterConfig":
        """Drafter shapes from the target's `config.json` (a dict); text_config of multimodal configs too."""
        tc = target_config.get("text_config") or target_config
        hidden = int(tc["hidden_size"])
        heads = int(tc["num_attention_heads"])
        rope_params = tc.get("rope_parameters") or {}
        rope_theta = float(tc.get("rope_theta", rope_params.get("rope_theta", 1_000_000.0)))
        rope_scaling = tc.get("rope_scaling")
        if rope_scaling is None and rope_params and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        n_target = int(tc["num_hidden_layers"])
        ids = [int(i) for i in target_layer_ids]
        if not ids or any(i < 0 or i >= n_target for i in ids):
            raise PipelineError(f"target_layer_ids {ids} out of range for a target with {n_target} layers")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(tc["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(tc.get("num_key_value_heads") or heads),
            head_dim=int(tc.get("head_dim") or hidden // heads),
            num_hidden_layers=int(num_layers),
            num_target_layers=n_target,
            target_layer_ids=ids,
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            vocab_size=int(vocab_rows or tc["vocab_size"]),
            rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(tc.get("max_position_embeddings", 40960)),
            attention_bias=bool(tc.get("attention_bias", False)),
            hidden_act=str(tc.get("hidden_act", "silu")),
            target_model_type=str(tc.get("model_type", target_config.get("model_type", "qwen3"))),
        )


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
    """Plain RoPE (rotate-half / neox style, as Qwen3) with optional linear scaling; cos/sin per position."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        dim = cfg.head_dim
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
    """x [B, heads, L, D]; cos/sin [B, L, D]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


_FLEX = None


def _flex_attention():
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float) -> torch.Tensor:
    """q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D]; mask: None, bool [B, 1, Lq, Lk] (True = visible) or BlockMask."""
    gqa = q.shape[1] != k.shape[1]
    if mask is not None and not isinstance(mask, torch.Tensor):  # flex attention BlockMask
        return _flex_attention()(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
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
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        out = attend(q, k, v, mask, self.scale)
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


# ---------------------------------------------------------------------------------------------------------
# The target's frozen embedding and LM head
# ---------------------------------------------------------------------------------------------------------


class TargetHead(nn.Module):
    """The target's token embedding and LM head, frozen (requires_grad False), never saved with the drafter."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None):
        super().__init__()
        self.embed = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        tied = lm_head_weight is None
        self.lm_head = nn.Linear(embed_weight.shape[1], embed_weight.shape[0], bias=False)
        self.lm_head.weight = self.embed.weight if tied else nn.Parameter(lm_head_weight, requires_grad=False)
        self.lm_head.weight.requires_grad_(False)

    @property
    def vocab_rows(self) -> int:
        return self.embed.weight.shape[0]

    def check_mask_token(self, mask_token_id: int) -> None:
        if not 0 <= int(mask_token_id) < self.vocab_rows:
            raise PipelineError(
                f"mask_token_id {mask_token_id} is not a row of the target's embedding (0..{self.vocab_rows - 1})"
            )


def read_target_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise PipelineError(f"{path}: target config.json not found")
    return json.loads(path.read_text())


def _safetensor_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> file, for single-file and sharded (index.json) checkpoints."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise PipelineError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as fh:
        return {name: single for name in fh.keys()}


def load_target_head(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> TargetHead:
    """Read only the embedding and LM head tensors from the target's safetensors (not the whole model)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    cfg = read_target_config(model_dir)
    tc = cfg.get("text_config") or cfg
    files = _safetensor_files(model_dir)
    embed_names = [n for n in files if n.endswith("embed_tokens.weight")]
    if not embed_names:
        raise PipelineError(f"{model_dir}: no *embed_tokens.weight tensor in the checkpoint")
    embed_name = sorted(embed_names, key=len)[0]
    head_names = [n for n in files if n.endswith("lm_head.weight")]
    tied = bool(cfg.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))) or not head_names

    def load(name):
        with safe_open(str(files[name]), framework="pt") as fh:
            return fh.get_tensor(name).to(dtype)

    embed = load(embed_name)
    head = None if tied else load(sorted(head_names, key=len)[0])
    return TargetHead(embed, head)


def resolve_mask_token_id(model_dir: str | Path, configured: int | None, vocab_rows: int) -> int:
    """The configured id; else `demo_target.json`'s; else the first embedding row past the tokenizer."""
    model_dir = Path(model_dir)
    if configured is not None:
        return int(configured)
    demo = model_dir / "demo_target.json"
    if demo.exists():
        return int(json.loads(demo.read_text())["mask_token_id"])
    try:
        from transformers import AutoTokenizer

        n_tok = len(AutoTokenizer.from_pretrained(str(model_dir)))
    except Exception as exc:  # noqa: BLE001 - the message below says what to do
        raise PipelineError(f"drafter.mask_token_id is not set and the tokenizer could not be read: {exc}")
    if n_tok >= vocab_rows:
        raise PipelineError(
            f"drafter.mask_token_id is not set and the embedding has no spare row past the tokenizer "
            f"({n_tok} tokens, {vocab_rows} rows): set drafter.mask_token_id to a token id the drafter may use"
        )
    return n_tok


def decay_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block positions k >= 1; position 0 (the anchor) has weight 0."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1).clamp(min=0) / float(gamma)) if gamma and gamma > 0 else torch.ones_like(k)
    w[0] = 0.0
    return w


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())



def make_readable(directory: str | Path) -> None:
    """Give a directory made by `atomic_dir` (mkdtemp: 0700) and its files the usual umask permissions."""
    import os

    mask = os.umask(0)
    os.umask(mask)
    directory = Path(directory)
    os.chmod(directory, 0o777 & ~mask)
    for f in directory.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~mask)
