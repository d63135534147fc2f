"""`train.layer_init`: the drafter's layers start as the target's first or last decoder layers (tensor for tensor,
with what the target lacks left fresh), and a target without a dense layer is refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_pipeline.drafter.config import DrafterConfig
from dflash_pipeline.drafter.layer_init import init_from_target
from dflash_pipeline.drafter.model import DFlashDrafter
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.target import read_config, text_config
from token_fixtures import train_two_steps, write_greedy_token_shard


def drafter_for(target, n_layers: int) -> tuple[DFlashDrafter, int]:
    cfg = read_config(target)
    n_target = int(text_config(cfg)["num_hidden_layers"])
    dcfg = DrafterConfig.from_target(cfg, n_layers, [0, n_target - 1], 8, 0, int(text_config(cfg)["vocab_size"]))
    torch.manual_seed(0)
    return DFlashDrafter(dcfg), n_target


def target_tensors(target) -> dict[str, torch.Tensor]:
    return load_file(str(target / "model.safetensors"))


@pytest.mark.parametrize("kind", ["target-first", "target-last"])
def test_drafter_layers_start_as_the_targets_layers(tiny_target, kind):
    drafter, n_target = drafter_for(tiny_target, 2)
    fresh = {k: v.clone() for k, v in drafter.state_dict().items()}
    info = init_from_target(drafter, tiny_target, kind)
    src = [0, 1] if kind == "target-first" else [n_target - 2, n_target - 1]
    assert info["source_layers"] == src and info["kept"] == []  # a Qwen3 target has every tensor, q/k norms too
    t, d = target_tensors(tiny_target), drafter.state_dict()
    layer_keys = [k.removeprefix("layers.0.") for k in d if k.startswith("layers.0.")]
    assert "self_attn.q_norm.weight" in layer_keys and "mlp.down_proj.weight" in layer_keys
    for i, s in enumerate(src):
        for k in layer_keys:
            assert torch.equal(d[f"layers.{i}.{k}"], t[f"model.layers.{s}.{k}"]), (i, k)
    # the final norm feeds the target's LM head: the target's own for target-last
    assert torch.equal(d["norm.weight"], t["model.norm.weight"] if kind == "target-last" else fresh["norm.weight"])
    # the context fusion has no counterpart in the target
    assert torch.equal(d["fc.weight"], fresh["fc.weight"]) and torch.equal(d["hidden_norm.weight"],
                                                                             fresh["hidden_norm.weight"])
    assert info["tensors"] == 2 * len(layer_keys) + (kind == "target-last")


def test_what_a_llama_target_lacks_stays_fresh_and_a_moe_target_is_refused(tiny_target, tmp_path):
    t = target_tensors(tiny_target)
    llama = tmp_path / "no-qk-norm"
    shutil.copytree(tiny_target, llama)
    save_file({k: v for k, v in t.items() if "q_norm" not in k and "k_norm" not in k}, str(llama / "model.safetensors"))
    drafter, n_target = drafter_for(llama, 2)
    info = init_from_target(drafter, llama, "target-last")
    assert info["kept"] == ["self_attn.k_norm.weight", "self_attn.q_norm.weight"]
    assert torch.equal(drafter.state_dict()["layers.0.self_attn.q_norm.weight"],
                       torch.ones_like(drafter.state_dict()["layers.0.self_attn.q_norm.weight"]))
    moe = tmp_path / "moe"
    shutil.copytree(tiny_target, moe)
    save_file({k: v for k, v in t.items() if ".mlp.gate_proj." not in k}, str(moe / "model.safetensors"))
    with pytest.raises(PipelineError, match=r"has no mlp.gate_proj.weight for layer 0 .*layer_init: random"):
        init_from_target(drafter_for(moe, 2)[0], moe, "target-first")
    with pytest.raises(PipelineError, match=f"{n_target + 1} drafter layers but the target has {n_target}"):
        init_from_target(drafter_for(tiny_target, n_target + 1)[0], tiny_target, "target-first")


def test_a_run_with_layer_init_trains_and_does_not_resume_a_random_init_checkpoint(tiny_target, tmp_path, caplog):
    shard = tmp_path / "greedy-00000.parquet"
    write_greedy_token_shard(str(tiny_target), str(shard), 16, prompt_len=12, new_tokens=16, seed=0, prefix="g")

    def train(out, *extra):
        return train_two_steps(tiny_target, shard, tmp_path / out, tmp_path / "ckpt", *extra)

    assert train("random") == 0
    caplog.set_level("INFO")
    assert train("last", "--layer-init", "target-last") == 0
    assert "start as the target's layers" in caplog.text
    summary = json.loads((tmp_path / "last" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 0  # the random-init run's checkpoints are set aside, not resumed
    assert list((tmp_path / "ckpt").glob("stale-*/step-*.pt"))
