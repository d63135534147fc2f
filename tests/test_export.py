"""The export stage: the engines' config.json / model.safetensors layout, and a load-back with identical logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_pipeline import storage
from dflash_pipeline.cli import main as cli_main
from dflash_pipeline.drafter.config import DrafterConfig
from dflash_pipeline.drafter.model import DFlashDrafter, save_drafter
from dflash_pipeline.drafter.target_head import load_target_head
from dflash_pipeline.target import read_config as read_target_config
from dflash_pipeline.drafter.export import load_exported


@pytest.fixture(scope="module")
def trained_dir(tiny_target, tmp_path_factory):
    """A train-stage output directory holding a drafter with random (non-default) weights."""
    tc = read_target_config(tiny_target)
    # the mask token is the embedding's last spare row (past the tokenizer's vocabulary), as the plan picks it
    cfg = DrafterConfig.from_target(tc, 2, [1, 4, 6], 16, tc["vocab_size"] - 1, tc["vocab_size"])
    torch.manual_seed(3)
    model = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = tmp_path_factory.mktemp("train") / "drafter"
    out.mkdir()
    save_drafter(out, model)
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
    mask = read_target_config(tiny_target)["vocab_size"] - 1
    assert cfg["dflash_config"] == {"mask_token_id": mask, "target_layer_ids": [1, 4, 6]}
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
    assert back.config.target_layer_ids == [1, 4, 6] and back.config.mask_token_id == mask
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


# ---------------------------------------------------------------------------------------------------------
# RoPE contract with the engines, on a Qwen3.5-shaped target (partial rotary 0.25 + M-RoPE)
# ---------------------------------------------------------------------------------------------------------

QWEN35_TEXT = {
    "model_type": "qwen3_5_text", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512, "rms_norm_eps": 1e-6,
    "full_attention_interval": 4, "attn_output_gate": True, "linear_num_key_heads": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
                        "mrope_section": [3, 3, 2], "mrope_interleaved": True},
}


def _vllm_rotary_dim(raw: dict) -> int:
    """vLLM 0.34: the draft config is parsed by transformers (AutoConfig by model_type); qwen3_dflash calls
    get_rope(head_dim, rope_parameters=config.rope_parameters), which takes `rope_dim` if set, else
    head_dim * partial_rotary_factor (M-RoPE only with `mrope_section`; with the 1-D positions a drafter gets,
    M-RoPE is plain RoPE over the same width)."""
    cfg = _parsed(raw)
    params = cfg.rope_parameters
    return int(params.get("rope_dim") or cfg.head_dim * params.get("partial_rotary_factor", 1.0))


# SGLang 0.5.23 parses these model types with its own config classes (configs/qwen3_5.py on qwen3_next.py):
# rope_parameters kept as written, `partial_rotary_factor` an attribute that defaults to 0.25.
SGLANG_QWEN_NEXT_TYPES = {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"}


def _sglang_rotary_dim(raw: dict) -> int:
    """SGLang 0.5.23 DFlashAttention: rotary_dim = head_dim times the config *attribute* partial_rotary_factor;
    an explicit rope_parameters["rope_dim"] wins (the trained width) and drops the partial/M-RoPE keys."""
    if raw["model_type"] in SGLANG_QWEN_NEXT_TYPES:
        params, partial = raw.get("rope_parameters") or {}, raw.get("partial_rotary_factor", 0.25)
    else:
        cfg = _parsed(raw)
        params, partial = cfg.rope_parameters or {}, getattr(cfg, "partial_rotary_factor", 1.0)
    if "rope_dim" in params:
        return int(params["rope_dim"])
    return int(raw["head_dim"] * partial) if partial < 1.0 else raw["head_dim"]


def _parsed(raw: dict):
    """The config object transformers makes of a config.json (what vLLM reads)."""
    import tempfile

    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as d:
        storage.write_json(f"{d}/config.json", raw)
        return AutoConfig.from_pretrained(d)


def _engine_attention(attn, x, ctx, pos_blk, pos_ctx, rotary_dim: int, theta: float):
    """A drafter layer's attention as an engine computes it: neox RoPE on the first `rotary_dim` dims (fp64
    frequencies), keys/values of [context | block], queries of the block, no mask (one block)."""
    def rope(t, pos):  # t [L, heads, D]
        half = rotary_dim // 2
        inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        f = pos.double()[:, None] * inv
        cos, sin = f.cos().float()[:, None], f.sin().float()[:, None]
        r1, r2, rest = t[..., :half], t[..., half:rotary_dim], t[..., rotary_dim:]
        return torch.cat([r1 * cos - r2 * sin, r2 * cos + r1 * sin, rest], dim=-1)

    d, hq, hk = attn.head_dim, attn.heads, attn.kv_heads
    q = rope(attn.q_norm(attn.q_proj(x).view(-1, hq, d)), pos_blk)
    kv_in, kv_pos = torch.cat([ctx, x]), torch.cat([pos_ctx, pos_blk])
    k = rope(attn.k_norm(attn.k_proj(kv_in).view(-1, hk, d)), kv_pos)
    v = attn.v_proj(kv_in).view(-1, hk, d)
    k, v = k.repeat_interleave(hq // hk, dim=1), v.repeat_interleave(hq // hk, dim=1)
    w = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * d**-0.5, dim=-1)
    return attn.o_proj(torch.einsum("hqk,khd->qhd", w, v).reshape(len(x), hq * d))


@pytest.fixture(scope="module")
def qwen35_export(tmp_path_factory):
    """A tiny Qwen3.5-shaped target (config + embedding/LM head) and a drafter for it, exported by the CLI."""
    root = tmp_path_factory.mktemp("qwen35")
    target = root / "target"
    target.mkdir()
    storage.write_json(target / "config.json", {"model_type": "qwen3_5", "architectures": [
        "Qwen3_5ForConditionalGeneration"], "text_config": QWEN35_TEXT, "vision_config": {"depth": 2}})
    save_file({"model.language_model.embed_tokens.weight": torch.randn(512, 128),
               "lm_head.weight": torch.randn(512, 128)}, str(target / "model.safetensors"))
    cfg = DrafterConfig.from_target(read_target_config(target), 1, [3], 16, 511, 512)
    torch.manual_seed(5)
    model = DFlashDrafter(cfg)
    drafter = root / "drafter"
    drafter.mkdir()
    save_drafter(drafter, model)
    out = root / "export"
    assert cli_main(["export", "--drafter", str(drafter), "--model", str(target), "--out", str(out),
                     "--dtype", "float32"]) == 0
    return target, drafter, out, model


def _layer_attention(model, x, ctx, pos_ctx, pos_blk):
    with torch.no_grad():
        rope_ctx, rope_blk = model.rotary(pos_ctx[None], torch.float32), model.rotary(pos_blk[None], torch.float32)
        return model.layers[0].self_attn(x[None], ctx[None], rope_ctx, rope_blk, None, None, 0)[0]


def test_qwen35_partial_rotary_is_what_both_engines_apply(qwen35_export):
    _, _, out, model = qwen35_export
    assert model.config.rotary_dim == 16  # head_dim 64 x partial_rotary_factor 0.25: trained as the target rotates
    exported = json.loads((out / "config.json").read_text())
    assert exported["rope_parameters"]["rope_dim"] == 16
    assert not {"mrope_section", "mrope_interleaved"} & set(exported["rope_parameters"])
    assert _vllm_rotary_dim(exported) == _sglang_rotary_dim(exported) == 16

    g = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(16, 128, generator=g), torch.randn(20, 128, generator=g)
    pos_ctx, pos_blk = torch.arange(20) + 3000, torch.arange(20, 36) + 3000
    attn, theta = model.layers[0].self_attn, float(exported["rope_parameters"]["rope_theta"])
    ours = _layer_attention(model, x, ctx, pos_ctx, pos_blk)
    with torch.no_grad():
        for reader in (_vllm_rotary_dim, _sglang_rotary_dim):
            engine = _engine_attention(attn, x, ctx, pos_blk, pos_ctx, reader(exported), theta)
            torch.testing.assert_close(ours, engine, atol=1e-5, rtol=1e-4)

    # before: the drafter rotated the whole head while the target's rope was copied as is; both engines then
    # rotate 16 dims, and the attention they compute is not the one the drafter was trained with
    old_export = dict(exported, rope_parameters=QWEN35_TEXT["rope_parameters"])
    assert _vllm_rotary_dim(old_export) == _sglang_rotary_dim(old_export) == 16
    old = DFlashDrafter(DrafterConfig.from_dict(dict(model.config.to_dict(), rotary_dim=64)))
    old.load_state_dict(model.state_dict())
    trained_with = _layer_attention(old, x, ctx, pos_ctx, pos_blk)
    with torch.no_grad():
        engine = _engine_attention(old.layers[0].self_attn, x, ctx, pos_blk, pos_ctx, 16, theta)
    assert (trained_with - engine).abs().max() > 1e-2


def test_qwen35_export_loads_back_with_identical_logits(qwen35_export):
    target, _, out, model = qwen35_export
    head = load_target_head(target)
    back = load_exported(out)
    assert back.config.rotary_dim == 16 and back.config.rope_theta == 10_000_000
    assert torch.equal(_logits(model.eval(), head, model.config), _logits(back, head, back.config))


def test_export_refuses_a_drafter_trained_for_another_target(tiny_target, tmp_path, capsys):
    """A drafter of a target with half the layers, twice the hidden size and half the vocabulary: rc 2, every
    mismatch named, nothing written (it would load and then accept nothing, or fail inside the engine)."""
    tc = read_target_config(tiny_target)
    other = dict(tc, num_hidden_layers=4, hidden_size=2 * tc["hidden_size"], vocab_size=tc["vocab_size"] // 2)
    cfg = DrafterConfig.from_target(other, 1, [2], 8, 100, other["vocab_size"])
    src = tmp_path / "other"
    src.mkdir()
    save_drafter(src, DFlashDrafter(cfg))
    out = tmp_path / "o"
    assert cli_main(["export", "--drafter", str(src), "--model", str(tiny_target), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "trained for another target" in err
    assert f"num_target_layers: drafter 4, target {tc['num_hidden_layers']}" in err
    assert f"hidden_size: drafter {2 * tc['hidden_size']}, target {tc['hidden_size']}" in err
    assert f"vocabulary: drafter {tc['vocab_size'] // 2}, target embedding" in err
    assert not out.exists()


def test_export_refuses_weights_that_do_not_match_their_config(tiny_target, trained_dir, tmp_path, capsys):
    src, _ = trained_dir
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "drafter.safetensors").write_bytes((src / "drafter.safetensors").read_bytes())
    cfg = json.loads((src / "drafter_config.json").read_text())
    storage.write_json(bad / "drafter_config.json", dict(cfg, intermediate_size=2 * cfg["intermediate_size"]))
    assert cli_main(["export", "--drafter", str(bad), "--model", str(tiny_target), "--out", str(tmp_path / "o")]) == 2
    assert "layers.0.mlp.gate_proj.weight" in capsys.readouterr().err
    (bad / "drafter.safetensors").write_bytes((src / "drafter.safetensors").read_bytes()[:5000])  # truncated
    storage.write_json(bad / "drafter_config.json", cfg)
    assert cli_main(["export", "--drafter", str(bad), "--model", str(tiny_target), "--out", str(tmp_path / "o")]) == 2
    assert f"{bad}/drafter.safetensors: unreadable" in capsys.readouterr().err
    storage.write_json(bad / "drafter_config.json", {"hidden": 1})
    assert cli_main(["export", "--drafter", str(bad), "--model", str(tiny_target), "--out", str(tmp_path / "o")]) == 2
    assert "drafter_config.json: not a drafter config" in capsys.readouterr().err
