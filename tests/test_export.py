"""The export stage: the engines' config.json / model.safetensors layout, and a load-back with identical logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_pipeline import storage
from dflash_pipeline.cli import main as cli_main
from dflash_pipeline.drafter.model import DFlashDrafter, DrafterConfig, load_target_head, read_target_config
from dflash_pipeline.drafter.export import load_exported


@pytest.fixture(scope="module")
def trained_dir(tiny_target, tmp_path_factory):
    """A train-stage output directory holding a drafter with random (non-default) weights."""
    tc = read_target_config(tiny_target)
    cfg = DrafterConfig.from_target(tc, 2, [1, 4, 6], 16, 1343, 1344)
    torch.manual_seed(3)
    model = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = tmp_path_factory.mktemp("train") / "drafter"
    out.mkdir()
    save_file(model.engine_state_dict(), str(out / "drafter.safetensors"))
    storage.write_json(out / "drafter_config.json", cfg.to_dict())
    return out, model


def _logits(model, head, cfg):
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 30, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    noise = torch.full((1, cfg.block_size), cfg.mask_token_id)
    noise[0, 0] = 17
    with torch.no_grad():
        h = model(head.embed(noise), feats, torch.arange(30)[None], torch.arange(30, 30 + cfg.block_size)[None])
        return head.lm_head(h)


def test_export_layout_and_identical_logits(tiny_target, trained_dir, tmp_path):
    src, model = trained_dir
    out = tmp_path / "export"
    assert cli_main(["export", "--drafter", str(src), "--model", str(tiny_target), "--out", str(out),
                     "--dtype", "float32"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["num_hidden_layers"] == 2 and cfg["block_size"] == 16 and cfg["num_target_layers"] == 8
    assert cfg["dflash_config"] == {"mask_token_id": 1343, "target_layer_ids": [1, 4, 6]}
    assert cfg["hidden_size"] == 128 and cfg["head_dim"] == 32 and cfg["num_key_value_heads"] == 2
    assert cfg["layer_types"] == ["full_attention"] * 2
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        names = set(fh.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert "layers.1.self_attn.k_norm.weight" in names and "layers.0.mlp.gate_proj.weight" in names
    assert not any("embed" in n or "lm_head" in n or "rotary" in n for n in names)
    assert all(n.startswith("layers.") or n in ("fc.weight", "hidden_norm.weight", "norm.weight") for n in names)

    head = load_target_head(tiny_target)
    back = load_exported(out)
    assert back.config.target_layer_ids == [1, 4, 6] and back.config.mask_token_id == 1343
    assert torch.equal(_logits(model.eval(), head, model.config), _logits(back, head, back.config))

    # the default bf16 export: same weights rounded, logits close
    out16 = tmp_path / "export16"
    assert cli_main(["export", "--drafter", str(src), "--model", str(tiny_target), "--out", str(out16)]) == 0
    assert json.loads((out16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(out16 / "model.safetensors"), framework="pt") as fh:
        assert fh.get_tensor("fc.weight").dtype == torch.bfloat16
    a, b = _logits(model, head, model.config), _logits(load_exported(out16), head, model.config)
    assert float((a - b).norm() / a.norm()) < 2e-2


def test_export_refuses_incomplete_drafter(tiny_target, trained_dir, tmp_path, capsys):
    src, model = trained_dir
    bad = tmp_path / "bad"
    bad.mkdir()
    state = model.engine_state_dict()
    del state["hidden_norm.weight"]
    save_file(state, str(bad / "drafter.safetensors"))
    (bad / "drafter_config.json").write_text((src / "drafter_config.json").read_text())
    assert cli_main(["export", "--drafter", str(bad), "--model", str(tiny_target), "--out", str(tmp_path / "o")]) == 2
    assert "hidden_norm.weight" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
