"""Speculative decoding (acceptance, bonus token, cache crops) is lossless: greedy token for token, sampled in
distribution (chi-square against the target's exact distribution); the gate fails an untrained drafter."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch import nn

from dflash_pipeline.cli import main as cli_main
from dflash_pipeline.drafter.config import DrafterConfig
from dflash_pipeline.drafter.model import DFlashDrafter, save_drafter
from dflash_pipeline.drafter.target_head import load_target_head
from dflash_pipeline.target import read_config as read_target_config
from dflash_pipeline.drafter.batched_rules import BatchedSampling
from dflash_pipeline.drafter.decode_sets import decode_all
from dflash_pipeline.drafter.speculative import SpeculativeSampling, greedy_generate, speculative_generate


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Decoding is many tiny ops: one intra-op thread (as the evaluate CLI uses on CPU) avoids OpenMP spin
    contention on a shared CPU, which made these tests 20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    save_drafter(train_dir, DFlashDrafter(cfg))
    export = tmp_path / "export"
    assert cli_main(["export", "--drafter", str(train_dir), "--model", str(tiny_target), "--out", str(export),
                     "--dtype", "float32"]) == 0
    report, plot = tmp_path / "report.json", tmp_path / "acc.png"
    questions = tmp_path / "question.jsonl"  # MT-Bench's format: the first turn is asked
    questions.write_text("".join(json.dumps({"question_id": 81 + i, "category": cat, "turns": [q, "And then?"]}) + "\n"
                                 for i, (cat, q) in enumerate([("writing", "Write a line about rain."),
                                                               ("math", "What is 3 plus 4?"),
                                                               ("math", "Double 21.")])))
    assert cli_main(["evaluate", "--drafter", str(export), "--model", str(tiny_target), "--tokens", str(tokens),
                     "--holdout-fraction", "0.2", "--num-prompts", "3", "--max-new-tokens", "12", "--temperatures",
                     "0", "0.7", "--prompts-file", str(questions),
                     "--device", "cpu", "--out", str(report), "--plot", str(plot)]) == 0
    r = json.loads(report.read_text())
    f = r["prompts_file"]  # tau per category and pooled, greedy and sampled, beside the held-out split
    assert f["count"] == 3 and f["categories"] == {"writing": 1, "math": 2} and set(f["tau"]) == {"0", "0.7"}
    for t, by in f["tau"].items():
        for name in ("trained", "untrained"):
            run = f["greedy"][name] if t == "0" else f["sampled"][t][name]
            cats = run["by_category"]
            assert set(cats) == {"writing", "math"} and by[name]["pooled"] == run["tau"]
            # pooled tau is the forward-weighted mean of the categories' (every forward belongs to one category)
            forwards = sum(c["target_forwards"] for c in cats.values())
            assert forwards == run["target_forwards"]
            assert abs(sum(c["tau"] * c["target_forwards"] for c in cats.values()) / forwards - run["tau"]) < 1e-9
            assert len(run["acceptance_per_position"]) == 8
    for name in ("trained", "untrained"):  # the file's greedy outputs are checked lossless too
        assert f["greedy"][name]["identical_outputs"] + f["greedy"][name]["numerical_ties"] == 3
    assert r["prompts"]["count"] == 3
    for name in ("trained", "untrained"):
        assert r[name]["identical_outputs"] + r[name]["numerical_ties"] == 3 and not r[name]["lossless_failures"]
        assert r[name]["tau"] < 1.5
        assert r[name]["acceptance_per_position"][0] is None and len(r[name]["acceptance_per_position"]) == 8
    assert not r["passed"] and "not clearly better" in r["reasons"][0]
    assert set(r["temperatures"]) == {"0", "0.7"} and r["temperatures"]["0"]["trained"] == r["trained"]["tau"]
    for name in ("trained", "untrained"):  # sampled runs: tau and a curve, no token-for-token comparison
        sampled = r["sampled"]["0.7"][name]
        # (a random target and drafter share one LM head: both near uniform, so sampled drafts are often kept)
        assert sampled["tau"] == r["temperatures"]["0.7"][name] and 1.0 <= sampled["tau"] <= 8.0
        assert sampled["target_forwards"] > 0 and len(sampled["acceptance_per_position"]) == 8
    assert plot.stat().st_size > 1000
    assert cli_main(["evaluate-gate", "--report", str(report), "--out", str(tmp_path / "gate.ok")]) == 2
    assert "not clearly better" in capsys.readouterr().err
    assert not (tmp_path / "gate.ok").exists()


# ------------------------------------------------------------------------------------------------------------
# Speculative sampling (temperature > 0): the output is distributed exactly as the target's own sampling
# ------------------------------------------------------------------------------------------------------------
VOCAB, HORIZON, TEMPERATURE, SAMPLES = 4, 3, 1.0, 1000
PROMPT = [0, 1, 2, 1]


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A 4-token target with a sharpened (untied) LM head, so p is peaked but not deterministic, a random
    1-layer drafter of block 3 (drafts disagree with the target often: both acceptance and rejection happen),
    and the target's exact distribution of the first HORIZON tokens, enumerated."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model_dir = tmp_path_factory.mktemp("vocab4")
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
                      max_position_embeddings=64)
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(30.0)
    target.save_pretrained(model_dir)
    head = load_target_head(model_dir)
    torch.manual_seed(1)
    drafter = DFlashDrafter(DrafterConfig.from_target(read_target_config(model_dir), 1, [0, 1], 3, VOCAB - 1,
                                                      head.vocab_rows)).eval()
    prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=HORIZON - 1)))
    with torch.no_grad():
        ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], 1)
        logp = torch.log_softmax(target(input_ids=ids).logits[:, len(PROMPT) - 1:].double() / TEMPERATURE, -1)
    exact = {}
    for row, prefix in enumerate(prefixes.tolist()):
        for last in range(VOCAB):
            seq = prefix + [last]
            exact[tuple(seq)] = float(sum(logp[row, k, t] for k, t in enumerate(seq)).exp())
    assert abs(sum(exact.values()) - 1) < 1e-9
    return target, drafter, head, exact


def _chi_square_p(counts: dict, exact: dict, n: int) -> float:
    """Pearson chi-square p-value, cells sorted by probability and pooled until each expects >= 5."""
    pooled, e_acc, o_acc = [], 0.0, 0.0
    for cell in sorted(exact, key=exact.get):
        e_acc, o_acc = e_acc + exact[cell] * n, o_acc + counts.get(cell, 0)
        if e_acc >= 5:
            pooled.append((e_acc, o_acc))
            e_acc = o_acc = 0.0
    if e_acc:
        pooled[-1] = (pooled[-1][0] + e_acc, pooled[-1][1] + o_acc)
    chi = sum((o - e) ** 2 / e for e, o in pooled)
    df = torch.tensor((len(pooled) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(chi / 2, dtype=torch.float64)))


def _sampled_counts(small_vocab, rule_cls) -> tuple[dict, list[int]]:
    target, drafter, head, _ = small_vocab
    rule = rule_cls(TEMPERATURE, torch.Generator().manual_seed(5))
    counts, kept = {}, []
    for _ in range(SAMPLES):
        out, acc = speculative_generate(target, drafter, head, PROMPT, HORIZON, set(), "cpu", rule)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
        kept += acc
    return counts, kept


class ResampleFromTarget(SpeculativeSampling):
    """The classic bug: on rejection, sample from p instead of norm(max(0, p - q)) (over-weights q's picks)."""

    @staticmethod
    def residual(p, q):
        return p


def test_speculative_sampling_has_the_target_distribution(small_vocab):
    counts, kept = _sampled_counts(small_vocab, SpeculativeSampling)
    assert 0 in kept and 2 in kept and 1 in kept  # rejections, partial and full acceptance (bonus) all occur
    p_value = _chi_square_p(counts, small_vocab[3], SAMPLES)
    assert p_value > 1e-3, f"speculative sampling differs from the target's distribution (p = {p_value:.2e})"


def test_a_wrong_rejection_rule_fails_the_distribution_check(small_vocab):
    counts, _ = _sampled_counts(small_vocab, ResampleFromTarget)
    p_value = _chi_square_p(counts, small_vocab[3], SAMPLES)
    assert p_value < 1e-6, f"the check cannot tell a biased sampler (p = {p_value:.2e})"


class BatchedResampleFromTarget(BatchedSampling):
    @staticmethod
    def residual(p, q):
        return p


def _batched_counts(small_vocab, rule) -> tuple[dict, list[int]]:
    """SAMPLES rows of the same prompt in one batch of the batched decoder (each row its own random stream)."""
    target, drafter, head, _ = small_vocab
    rows, _ = decode_all(target, [PROMPT] * SAMPLES, HORIZON, set(), drafter=drafter, head=head, rule=rule, seed=5,
                         batch_size=SAMPLES)
    counts: dict = {}
    for r in rows:
        counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
    return counts, [a for r in rows for a in r.accepted]


def test_batched_speculative_sampling_has_the_target_distribution(small_vocab):
    counts, kept = _batched_counts(small_vocab, BatchedSampling(TEMPERATURE))
    assert 0 in kept and 2 in kept and 1 in kept
    p_value = _chi_square_p(counts, small_vocab[3], SAMPLES)
    assert p_value > 1e-3, f"batched speculative sampling differs from the target's distribution (p = {p_value:.2e})"
    wrong, _ = _batched_counts(small_vocab, BatchedResampleFromTarget(TEMPERATURE))
    p_wrong = _chi_square_p(wrong, small_vocab[3], SAMPLES)
    assert p_wrong < 1e-6, f"the check cannot tell a biased batched sampler (p = {p_wrong:.2e})"
