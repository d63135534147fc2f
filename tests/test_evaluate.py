"""Speculative decoding (acceptance, bonus token, cache crops) is lossless; the gate fails an untrained drafter."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from dflash_pipeline import storage
from dflash_pipeline.cli import main as cli_main
from dflash_pipeline.drafter.config import DrafterConfig
from dflash_pipeline.drafter.model import DFlashDrafter
from dflash_pipeline.drafter.target_head import load_target_head
from dflash_pipeline.target import read_config as read_target_config
from dflash_pipeline.drafter.evaluate import greedy_generate, speculative_generate


class OracleDrafter(nn.Module):
    """Drafts the target's true greedy continuation (known in advance) except at chosen block positions.

    Its hidden states are the LM head rows of the wanted tokens, so the frozen tied head's argmax picks
    them; it checks that it is called with the anchor it expects at the position it expects.
    """

    def __init__(self, cfg, head, sequence: list[int], wrong_at):
        super().__init__()
        self.config, self.head, self.sequence, self.wrong_at = cfg, head, sequence, wrong_at
        self.layers = nn.ModuleList()
        self.dummy = nn.Parameter(torch.zeros(1))
        self.seen_context = 0

    def forward(self, noise_embedding, features, ctx_positions, block_positions, mask=None, cache=None):
        start = int(block_positions[0, 0])
        assert int(ctx_positions[0, 0]) == self.seen_context  # context arrives in order, exactly once
        self.seen_context = int(ctx_positions[0, -1]) + 1
        assert self.seen_context == start  # the block sees all context before its anchor
        anchor_row = self.head.embed.weight[self.sequence[start]]
        assert torch.equal(noise_embedding[0, 0], anchor_row)
        bs = self.config.block_size
        wanted = [self.sequence[min(start + k, len(self.sequence) - 1)] for k in range(bs)]
        k_bad = self.wrong_at(start)
        if k_bad is not None:
            wanted[k_bad] = (wanted[k_bad] + 1) % 1000
        return self.head.lm_head.weight[torch.tensor(wanted)][None] * 50.0


@pytest.fixture(scope="module")
def setup(tiny_target):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    head = load_target_head(tiny_target)
    cfg = DrafterConfig.from_target(read_target_config(tiny_target), 1, [4], 8, 1343, head.vocab_rows)
    return target, head, cfg


@pytest.mark.parametrize("pattern", ["all", "k3", "mixed"])
def test_speculative_decoding_accepts_and_is_lossless(setup, pattern):
    target, head, cfg = setup
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 1000, (20,), generator=g).tolist()
    ref, _ = greedy_generate(target, prompt, 40, set(), "cpu")
    wrong = {"all": lambda s: None, "k3": lambda s: 3, "mixed": lambda s: [None, 1, 6, 2][s % 4]}[pattern]
    oracle = OracleDrafter(cfg, head, prompt + ref, wrong)
    out, accepted = speculative_generate(target, oracle, head, prompt, 40, set(), "cpu")
    assert out == ref  # lossless: token for token the target's greedy output
    if pattern == "all":
        assert accepted[:-1] == [cfg.block_size - 1] * (len(accepted) - 1)  # every draft accepted
    if pattern == "k3":
        assert set(accepted[:-1]) == {2}  # drafts 1, 2 accepted, draft 3 wrong: 2 + bonus per forward
    assert sum(a + 1 for a in accepted) >= len(ref) - 1


def test_untrained_drafter_is_lossless_and_fails_the_gate(tiny_target, setup, tmp_path, capsys):
    """An exported untrained drafter: decoding stays lossless, tau ~ 1, and the evaluation gate fails."""
    from token_fixtures import write_greedy_token_shard

    target, head, _ = setup
    tokens = tmp_path / "tok-00000.parquet"
    write_greedy_token_shard(str(tiny_target), str(tokens), 40, prompt_len=12, new_tokens=16, seed=3)
    cfg = DrafterConfig.from_target(read_target_config(tiny_target), 1, [4], 8, 1343, head.vocab_rows)
    torch.manual_seed(1)
    train_dir = tmp_path / "train"
    train_dir.mkdir()
    save_file(DFlashDrafter(cfg).engine_state_dict(), str(train_dir / "drafter.safetensors"))
    storage.write_json(train_dir / "drafter_config.json", cfg.to_dict())
    export = tmp_path / "export"
    assert cli_main(["export", "--drafter", str(train_dir), "--model", str(tiny_target), "--out", str(export),
                     "--dtype", "float32"]) == 0
    report, plot = tmp_path / "report.json", tmp_path / "acc.png"
    assert cli_main(["evaluate", "--drafter", str(export), "--model", str(tiny_target), "--tokens", str(tokens),
                     "--holdout-fraction", "0.2", "--num-prompts", "3", "--max-new-tokens", "12",
                     "--device", "cpu", "--out", str(report), "--plot", str(plot)]) == 0
    r = json.loads(report.read_text())
    assert r["prompts"]["count"] == 3
    for name in ("trained", "untrained"):
        assert r[name]["identical_outputs"] + r[name]["numerical_ties"] == 3 and not r[name]["lossless_failures"]
        assert r[name]["tau"] < 1.5
        assert r[name]["acceptance_per_position"][0] is None and len(r[name]["acceptance_per_position"]) == 8
    assert not r["passed"] and "not clearly better" in r["reasons"][0]
    assert plot.stat().st_size > 1000
    assert cli_main(["evaluate-gate", "--report", str(report), "--out", str(tmp_path / "gate.ok")]) == 2
    assert "not clearly better" in capsys.readouterr().err
    assert not (tmp_path / "gate.ok").exists()
