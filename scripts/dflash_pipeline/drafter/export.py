"""`dflash-pipeline export`: the trained drafter as a checkpoint that SGLang and vLLM load as a DFlash draft.

Writes `config.json` and `model.safetensors` into `--out` (atomically, one rename):

- config.json: the target's layer shapes (hidden size, heads, head_dim, intermediate size, rope, eps, vocab)
  with `"architectures": ["DFlashDraftModel"]`, the target's `model_type`, `num_hidden_layers` = drafter
  layers, top-level `block_size`, `num_target_layers`, and
  `"dflash_config": {"mask_token_id": ..., "target_layer_ids": [...]}` (plus `mask_token`, its text, when the
  mask is an existing token of the target's tokenizer: SGLang also resolves the mask by text); the layer ids are always written
  explicitly (an engine that guesses them loads fine and then accepts nothing).
- model.safetensors: `layers.*`, `fc.weight`, `hidden_norm.weight`, `norm.weight`; no embedding and no LM
  head (the engines take the target's).

RoPE: `rope_parameters` says exactly what the drafter was trained with: `rope_theta`, and `rope_dim` (the
rotated width) with `partial_rotary_factor` = rope_dim / head_dim; the target's M-RoPE keys are dropped (the
drafter sees text positions only). vLLM 0.34's `get_rope` takes `rope_dim` first and builds M-RoPE only when
`mrope_section` is present; SGLang 0.5.23's DFlash attention takes `rope_dim` as the trained width and drops
`partial_rotary_factor`/`mrope_*`. Both therefore rotate exactly the drafter's `rotary_dim` dims, neox style.

A drafter is exported only for the target it was trained for: its shapes (hidden size, heads, head dims,
layers, vocabulary, rope) must equal the target's, and its weights must have the shapes its config implies.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from dflash_pipeline import settings, storage
from dflash_pipeline.drafter.config import DRAFTER_FILES, MROPE_KEYS, DrafterConfig, target_shapes
from dflash_pipeline.drafter.runtime import make_readable
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.target import read_config, text_config
from dflash_pipeline.write_checks import check_output_dirs, named_write_errors

log = logging.getLogger("dflash_pipeline.drafter.export")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DROP_KEYS = {"architectures", "auto_map", "quantization_config", "layer_types", "text_config", "vision_config",
              "transformers_version", "torch_dtype", "dtype", "_name_or_path", "use_cache",
              "rope_parameters", "rope_scaling", "partial_rotary_factor", *MROPE_KEYS}
# What the engines' released sources say about serving a drafter for this target architecture (README: Real target)
ENGINE_NOTES = {
    "llama": "Llama target: SGLang 0.5.23 loads this draft (models/dflash.py, any model_type) and captures a Llama "
             "target's layers (LlamaForCausalLM.set_dflash_layers_to_capture); vLLM maps DFlashDraftModel to "
             "qwen3_dflash (Qwen3-style layers whatever the model_type) and its LlamaForCausalLM captures them "
             "(SupportsEagle3). Neither engine was run here.",
}
REQUIRED_WEIGHTS = ("fc.weight", "hidden_norm.weight", "norm.weight")
# fields that identify the target a drafter was trained for (rotary_dim is the drafter's own: see rope_parameters)
TARGET_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "num_target_layers", "rope_theta", "rope_scaling", "rms_norm_eps", "hidden_act", "attention_bias",
                 "target_model_type")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True, help="the train stage's output directory")
    p.add_argument("--model", required=True, help="target model directory (its config.json is the base)")
    p.add_argument("--out", required=True, help="export directory (config.json + model.safetensors)")
    p.add_argument("--dtype", choices=sorted(DTYPES))
    p.add_argument("--trust-remote-code", action="store_true", default=None,
                   help="target.trust_remote_code; export reads only the target's config.json and safetensors "
                        "headers, so no target code runs either way")


def rope_parameters(dcfg: DrafterConfig) -> dict:
    """The drafter's RoPE as both engines read it: plain (1-D positions), `rope_dim` rotated dims."""
    scaling = dict(dcfg.rope_scaling or {})
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    params = {"rope_type": kind, **scaling, "rope_theta": dcfg.rope_theta}
    params["partial_rotary_factor"] = dcfg.rotary_dim / dcfg.head_dim
    params["rope_dim"] = dcfg.rotary_dim
    return params


def engine_config(target_config: dict, dcfg: DrafterConfig, dtype: str) -> dict:
    """The draft model's config.json: the target's text config, re-labelled as a DFlash drafter."""
    cfg = {k: v for k, v in text_config(target_config).items() if k not in _DROP_KEYS}
    cfg.update({
        "architectures": ["DFlashDraftModel"],
        "model_type": dcfg.target_model_type,
        "hidden_size": dcfg.hidden_size,
        "intermediate_size": dcfg.intermediate_size,
        "num_attention_heads": dcfg.num_attention_heads,
        "num_key_value_heads": dcfg.num_key_value_heads,
        "head_dim": dcfg.head_dim,
        "rms_norm_eps": dcfg.rms_norm_eps,
        "vocab_size": dcfg.vocab_size,
        "hidden_act": dcfg.hidden_act,
        "attention_bias": dcfg.attention_bias,
        "max_position_embeddings": dcfg.max_position_embeddings,
        "num_hidden_layers": dcfg.num_hidden_layers,
        "layer_types": ["full_attention"] * dcfg.num_hidden_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": dcfg.num_hidden_layers,
        "tie_word_embeddings": False,
        "rope_theta": dcfg.rope_theta,
        "rope_parameters": rope_parameters(dcfg),
        "block_size": dcfg.block_size,
        "num_target_layers": dcfg.num_target_layers,
        "dflash_config": {"mask_token_id": dcfg.mask_token_id, "target_layer_ids": list(dcfg.target_layer_ids)},
        "torch_dtype": dtype,
    })
    return cfg


def config_from_engine(cfg: dict, source: str = "config.json") -> DrafterConfig:
    """DrafterConfig from an exported config.json (ours or any DFlash checkpoint of the same layout)."""
    dc = cfg.get("dflash_config") or {}
    try:
        ids, mask_id = dc["target_layer_ids"], int(dc["mask_token_id"])
        base = dict(cfg, num_hidden_layers=int(cfg["num_target_layers"]))  # target_shapes reads the target's count
        block = int(settings.value(cfg, "drafter.block_size"))
        return DrafterConfig.from_target(base, int(cfg["num_hidden_layers"]), ids, block, mask_id, int(cfg["vocab_size"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise PipelineError(f"{source}: not a DFlash drafter config (missing or bad {exc})") from None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PipelineError(f"{path}: unreadable ({exc})") from None


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for damaged files
        raise PipelineError(f"{path}: unreadable safetensors file ({exc})") from None


def check_weights(state: dict[str, torch.Tensor], dcfg: DrafterConfig, source: str) -> None:
    """Exactly the tensors a drafter of `dcfg` has, with its shapes (built on the meta device: no memory).
    The layer count is checked against the weights first: a config claiming 1,000,000 layers is refused in
    microseconds instead of building them."""
    from dflash_pipeline.drafter.model import DFlashDrafter

    stored = {int(k.split(".")[1]) for k in state if k.startswith("layers.") and k.split(".")[1].isdigit()}
    if dcfg.num_hidden_layers != len(stored) or stored != set(range(len(stored))):
        raise PipelineError(f"{source}: the config says num_hidden_layers {dcfg.num_hidden_layers}, the weights "
                            f"hold {len(stored)} layers ({sorted(stored)[:8]}...): config and weights do not match")
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in DFlashDrafter(dcfg).engine_state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise PipelineError(f"{source}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]} "
                            f"for a {dcfg.num_hidden_layers}-layer drafter")
    wrong = [f"{k} {tuple(state[k].shape)} (config implies {shape})" for k, shape in expected.items()
             if tuple(state[k].shape) != shape]
    if wrong:
        raise PipelineError(f"{source}: tensor shapes do not match its config: {'; '.join(wrong[:3])}")


def load_exported(path: str | Path, device="cpu", dtype: torch.dtype = torch.float32):
    """An exported drafter as a DFlashDrafter (what an engine loads, read back for evaluation and tests)."""
    from dflash_pipeline.drafter.model import DFlashDrafter

    path = Path(path)
    cfg = _read_json(path / "config.json")
    if cfg.get("architectures") != ["DFlashDraftModel"]:
        raise PipelineError(f"{path}/config.json is not a DFlashDraftModel config")
    dcfg = config_from_engine(cfg, f"{path}/config.json")
    state = _read_weights(path / "model.safetensors")
    check_weights(state, dcfg, f"{path}/model.safetensors")
    model = DFlashDrafter(dcfg)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return model.to(device=device, dtype=dtype).eval()


def mask_token_text(model_dir: str | Path, mask_token_id: int, trust_remote_code: bool = False) -> str | None:
    """The mask token's text when it is a token of the target's tokenizer (an existing special token: SmolLM2's
    <empty_output>), None for a spare embedding row past the tokenizer (the Qwen3 case) or without a tokenizer."""
    from dflash_pipeline.target import load_tokenizer

    try:
        tok = load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
    except PipelineError:
        return None
    if not 0 <= mask_token_id < len(tok):
        return None
    text = tok.convert_ids_to_tokens(int(mask_token_id))
    return text if isinstance(text, str) and text else None


def check_same_target(dcfg: DrafterConfig, model_dir: str | Path, source: str) -> None:
    """Refuse a drafter trained for another target, naming every field that differs."""
    from dflash_pipeline.drafter.target_head import target_vocab_rows

    target = target_shapes(read_config(model_dir))
    diffs = [f"{k}: drafter {getattr(dcfg, k)!r}, target {target[k]!r}" for k in TARGET_FIELDS
             if getattr(dcfg, k) != target[k]]
    vocab = target_vocab_rows(model_dir)
    if dcfg.vocab_size != vocab:
        diffs.append(f"vocabulary: drafter {dcfg.vocab_size}, target embedding {vocab} rows")
    if diffs:
        raise PipelineError(f"{source} was trained for another target than {model_dir}: {'; '.join(diffs)}")


def run(args) -> int:
    from safetensors.torch import save_file

    check_output_dirs("export", out=args.out)
    weights, config = (Path(args.drafter) / name for name in DRAFTER_FILES)
    dcfg = DrafterConfig.from_dict(_read_json(config), str(config))
    state = _read_weights(weights)
    check_weights(state, dcfg, str(weights))
    check_same_target(dcfg, args.model, str(Path(args.drafter)))
    dtype = DTYPES[args.dtype]
    cfg = engine_config(read_config(args.model), dcfg, args.dtype)
    mask_text = mask_token_text(args.model, dcfg.mask_token_id, args.trust_remote_code)
    if mask_text is not None:  # SGLang resolves the mask by its text too (default "<|MASK|>"): name the real one
        cfg["dflash_config"]["mask_token"] = mask_text
    with named_write_errors("export", args.out), storage.atomic_dir(args.out) as tmp:  # a full disk: one line
        save_file({k: v.to(dtype).contiguous() for k, v in sorted(state.items())}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        storage.write_json(tmp / "config.json", cfg)
        make_readable(tmp)
    log.info("exported %d tensors (%s) with target_layer_ids %s, mask token %d, block size %d to %s",
             len(state), args.dtype, dcfg.target_layer_ids, dcfg.mask_token_id, dcfg.block_size, args.out)
    print(f"exported DFlash drafter to {args.out}: {dcfg.num_hidden_layers} layers, target layers "
          f"{dcfg.target_layer_ids}, block size {dcfg.block_size}, mask token {dcfg.mask_token_id}"
          + (f" {mask_text!r}" if mask_text is not None else " (a spare embedding row)"))
    if dcfg.target_model_type in ENGINE_NOTES:
        print(ENGINE_NOTES[dcfg.target_model_type])
    return 0
