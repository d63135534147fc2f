"""What shapes the drafter (`DrafterConfig`), derived from the target's `config.json`.

Rotary embedding: the drafter rotates the first `rotary_dim` dimensions of each head, as the target's full
attention layers do. Qwen3 rotates the whole head; Qwen3.5/3.6 (and Qwen3-Next) rotate a quarter
(`partial_rotary_factor` 0.25) with an M-RoPE whose sections all get the same position for text. The drafter
only ever sees text positions, where M-RoPE equals plain RoPE over `rotary_dim`, so it is trained as plain
RoPE over `rotary_dim` and exported with an explicit `rope_dim` that SGLang and vLLM both read (export.py).
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.target import text_config

DRAFTER_FILES = ("drafter.safetensors", "drafter_config.json")  # a trained drafter: train writes, export reads


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
    rotary_dim: int | None = None  # None: the whole head (drafters written before partial rotary existed)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.rotary_dim is None:
            self.rotary_dim = self.head_dim
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise PipelineError(f"rotary_dim {self.rotary_dim}: must be even and in 1..head_dim {self.head_dim}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str = "drafter config") -> "DrafterConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        missing = sorted(f.name for f in fields(cls) if _required(f) and f.name not in d)
        if unknown or missing:
            raise PipelineError(f"{source}: not a drafter config (unknown keys {unknown}, missing keys {missing})")
        return cls(**d)

    @classmethod
    def from_target(cls, target_config: dict, num_layers: int, target_layer_ids: list[int], block_size: int,
                    mask_token_id: int, vocab_rows: int | None = None) -> "DrafterConfig":
        """Drafter shapes from the target's `config.json` (a dict); text_config of multimodal configs too."""
        shapes = target_shapes(target_config)
        n_target = shapes["num_target_layers"]
        ids = [int(i) for i in target_layer_ids]
        if not ids or any(i < 0 or i >= n_target for i in ids):
            raise PipelineError(f"target_layer_ids {ids} out of range for a target with {n_target} layers")
        shapes["vocab_size"] = int(vocab_rows or shapes["vocab_size"])
        return cls(**shapes, num_hidden_layers=int(num_layers), target_layer_ids=ids, block_size=int(block_size),
                   mask_token_id=int(mask_token_id))


def target_shapes(target_config: dict) -> dict:
    """The DrafterConfig fields that come from the target's config (a dict, multimodal or not)."""
    tc = text_config(target_config)
    try:
        hidden, heads = int(tc["hidden_size"]), int(tc["num_attention_heads"])
        head_dim = int(tc.get("head_dim") or hidden // heads)
        theta, scaling, rotary_dim = rope_of(tc, head_dim)
        return dict(
            hidden_size=hidden, intermediate_size=int(tc["intermediate_size"]), num_attention_heads=heads,
            num_key_value_heads=int(tc.get("num_key_value_heads") or heads), head_dim=head_dim,
            num_target_layers=int(tc["num_hidden_layers"]), vocab_size=int(tc["vocab_size"]),
            rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            rotary_dim=rotary_dim, max_position_embeddings=int(tc.get("max_position_embeddings", 40960)),
            attention_bias=bool(tc.get("attention_bias", False)), hidden_act=str(tc.get("hidden_act", "silu")),
            target_model_type=str(tc.get("model_type", target_config.get("model_type", "qwen3"))),
        )
    except KeyError as exc:
        raise PipelineError(f"target config has no {exc.args[0]!r}: not a decoder LM config") from None


def _required(f) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


# Keys of a rope description that only say how positions are laid out for images/video (M-RoPE): with text
# positions every section gets the same position, i.e. plain RoPE, so the drafter ignores them.
MROPE_KEYS = ("mrope_section", "mrope_interleaved", "mrope_interleaved_glm")


def rope_of(tc: dict, head_dim: int) -> tuple[float, dict | None, int]:
    """(rope_theta, scaling or None, rotary_dim) of a text config, transformers v4 or v5 style."""
    params = dict(tc.get("rope_parameters") or {})
    theta = float(tc.get("rope_theta", params.get("rope_theta", 1_000_000.0)))
    if params.get("rope_dim"):
        rotary_dim = int(params["rope_dim"])
    else:
        factor = float(params.get("partial_rotary_factor", tc.get("partial_rotary_factor", 1.0)))
        rotary_dim = int(head_dim * factor)
    scaling = tc.get("rope_scaling")
    if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
        drop = {"rope_theta", "partial_rotary_factor", "rope_dim", *MROPE_KEYS}
        scaling = {k: v for k, v in params.items() if k not in drop}
    return theta, scaling, rotary_dim
