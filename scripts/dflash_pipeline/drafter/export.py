"""`dflash-pipeline export`: the trained drafter as a checkpoint that SGLang and vLLM load as a DFlash draft.

Writes `config.json` and `model.safetensors` into `--out` (atomically, one rename):

- config.json: the target's layer shapes (hidden size, heads, head_dim, intermediate size, rope, eps, vocab)
  with `"architectures": ["DFlashDraftModel"]`, the target's `model_type`, `num_hidden_layers` = drafter
  layers, top-level `block_size`, `num_target_layers`, and
  `"dflash_config": {"mask_token_id": ..., "target_layer_ids": [...]}`; the layer ids are always written
  explicitly (an engine that guesses them loads fine and then accepts nothing).
- model.safetensors: `layers.*`, `fc.weight`, `hidden_norm.weight`, `norm.weight`; no embedding and no LM
  head (the engines take the target's).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from dflash_pipeline import storage
from dflash_pipeline.errors import PipelineError

log = logging.getLogger("dflash_pipeline.drafter.export")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DROP_KEYS = {"architectures", "auto_map", "quantization_config", "layer_types", "text_config", "vision_config",
              "transformers_version", "torch_dtype", "dtype", "_name_or_path", "use_cache"}
REQUIRED_WEIGHTS = ("fc.weight", "hidden_norm.weight", "norm.weight")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True, help="the train stage's output directory")
    p.add_argument("--model", required=True, help="target model directory (its config.json is the base)")
    p.add_argument("--out", required=True, help="export directory (config.json + model.safetensors)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")


def engine_config(target_config: dict, dcfg, dtype: str) -> dict:
    """The draft model's config.json: the target's text config, re-labelled as a DFlash drafter."""
    tc = dict(target_config.get("text_config") or target_config)
    cfg = {k: v for k, v in tc.items() if k not in _DROP_KEYS}
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
        "block_size": dcfg.block_size,
        "num_target_layers": dcfg.num_target_layers,
        "dflash_config": {"mask_token_id": dcfg.mask_token_id, "target_layer_ids": list(dcfg.target_layer_ids)},
        "torch_dtype": dtype,
    })
    if "rope_theta" not in cfg and "rope_parameters" not in cfg:
        cfg["rope_theta"] = dcfg.rope_theta
    return cfg


def config_from_engine(cfg: dict):
    """DrafterConfig from an exported config.json (ours or any DFlash checkpoint of the same layout)."""
    from dflash_pipeline.drafter.model import DrafterConfig

    dc = cfg.get("dflash_config") or {}
    ids = dc.get("target_layer_ids")
    if not ids:
        raise PipelineError("config.json has no dflash_config.target_layer_ids")
    base = dict(cfg)
    base["num_hidden_layers"] = int(cfg["num_target_layers"])  # from_target reads the *target's* layer count
    d = DrafterConfig.from_target(base, int(cfg["num_hidden_layers"]), ids, int(cfg.get("block_size", 16)),
                                  int(dc["mask_token_id"]), int(cfg["vocab_size"]))
    return d


def load_exported(path: str | Path, device="cpu", dtype: torch.dtype = torch.float32):
    """An exported drafter as a DFlashDrafter (what an engine loads, read back for evaluation and tests)."""
    from safetensors.torch import load_file

    from dflash_pipeline.drafter.model import DFlashDrafter

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("architectures") != ["DFlashDraftModel"]:
        raise PipelineError(f"{path}/config.json is not a DFlashDraftModel config")
    dcfg = config_from_engine(cfg)
    model = DFlashDrafter(dcfg)
    state = load_file(str(path / "model.safetensors"))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = [m for m in missing if not m.startswith("rotary.")]
    if missing or unexpected:
        raise PipelineError(f"{path}/model.safetensors: missing {missing}, unexpected {unexpected}")
    return model.to(device=device, dtype=dtype).eval()


def run(args) -> int:
    from safetensors.torch import load_file, save_file

    from dflash_pipeline.drafter.model import DrafterConfig, make_readable, read_target_config

    drafter_dir = Path(args.drafter)
    dcfg = DrafterConfig.from_dict(json.loads((drafter_dir / "drafter_config.json").read_text()))
    state = load_file(str(drafter_dir / "drafter.safetensors"))
    for name in REQUIRED_WEIGHTS:
        if name not in state:
            raise PipelineError(f"{drafter_dir}/drafter.safetensors has no {name}")
    bad = [k for k in state if not (k.startswith("layers.") or k in REQUIRED_WEIGHTS)]
    if bad:
        raise PipelineError(f"unexpected tensors in the drafter: {bad[:5]}")
    n_layers = len({k.split(".")[1] for k in state if k.startswith("layers.")})
    if n_layers != dcfg.num_hidden_layers:
        raise PipelineError(f"drafter has {n_layers} layers, its config says {dcfg.num_hidden_layers}")
    dtype = DTYPES[args.dtype]
    cfg = engine_config(read_target_config(args.model), dcfg, args.dtype)
    with storage.atomic_dir(args.out) as tmp:
        save_file({k: v.to(dtype).contiguous() for k, v in sorted(state.items())}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        storage.write_json(tmp / "config.json", cfg)
        make_readable(tmp)
    log.info("exported %d tensors (%s) with target_layer_ids %s, mask token %d, block size %d to %s",
             len(state), args.dtype, dcfg.target_layer_ids, dcfg.mask_token_id, dcfg.block_size, args.out)
    print(f"exported DFlash drafter to {args.out}: {dcfg.num_hidden_layers} layers, target layers "
          f"{dcfg.target_layer_ids}, block size {dcfg.block_size}, mask token {dcfg.mask_token_id}")
    return 0
