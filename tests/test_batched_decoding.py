"""The batched evaluator decodes like the one-prompt path (same tokens, same drafts kept at every step), its
sampling draws per row (batch N = batch 1 per seed), and the lossless check tells a numerical tie from a real
divergence (fp32, tiny real models on CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dflash_pipeline.drafter.batched_decoding import BatchDecoder, supports_batched
from dflash_pipeline.drafter.batched_rules import BatchedGreedy, BatchedSampling, uniforms
from dflash_pipeline.drafter.config import DrafterConfig
from dflash_pipeline.drafter.decode_sets import decode_all
from dflash_pipeline.drafter.evaluate import context_room, fit_prompts
from dflash_pipeline.drafter.lossless import NOISE_CAP_ULPS, classify, lossless_report, tie_tolerance, ulp
from dflash_pipeline.drafter.model import DFlashDrafter
from dflash_pipeline.drafter.speculative import greedy_generate, speculative_generate
from dflash_pipeline.drafter.target_head import TargetHead
from dflash_pipeline.errors import PipelineError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decode_step_kernels  # noqa: E402

VOCAB, BLOCK, MAX_NEW = 8, 4, 30


@pytest.fixture(autouse=True)
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _target(seed: int, tied: bool = True, init: float = 0.3):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=tied,
                      max_position_embeddings=128, initializer_range=init)  # 0.3: varied outputs (0.02 repeats)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def small():
    """An 8-token target and a random 2-layer drafter (block 4) whose drafts the target sometimes keeps: seed 1
    gives steps keeping 0, 1, 2 and 3 drafts, so the per-step comparison means something."""
    target = _target(1)
    head = TargetHead(target.model.embed_tokens.weight.detach().clone(), None)
    drafter = DFlashDrafter(DrafterConfig.from_target(target.config.to_dict(), 2, [0, 1], BLOCK, VOCAB - 1,
                                                      VOCAB)).eval()
    drafter.reset_parameters(std=0.3)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7)]
    return target, drafter, head, prompts


@pytest.mark.parametrize("stop_ids", [set(), {3}])
def test_batched_greedy_equals_the_one_prompt_path(small, stop_ids):
    target, drafter, head, prompts = small
    assert supports_batched(target)
    ref = [speculative_generate(target, drafter, head, p, MAX_NEW, stop_ids, "cpu") for p in prompts]
    rows = BatchDecoder(target, prompts, MAX_NEW, stop_ids, drafter=drafter, head=head).run().rows
    for (tokens, accepted), row in zip(ref, rows):
        assert row.tokens == tokens and row.accepted == accepted  # same drafts kept at every step
    kept = {a for _, acc in ref for a in acc}
    assert {0, 1, 3} <= kept  # rows accept different lengths in the same batch
    if stop_ids:
        assert any(t[-1] in stop_ids and 1 < len(t) < MAX_NEW for t, _ in ref)  # a row stopped inside a block
    plain = [greedy_generate(target, p, MAX_NEW, stop_ids, "cpu") for p in prompts]
    prow, _ = decode_all(target, prompts, MAX_NEW, stop_ids, batch_size=2)  # batched plain greedy, 3 batches
    for (tokens, gaps), row in zip(plain, prow):
        assert row.tokens == tokens and max(abs(a - b) for a, b in zip(gaps, row.gap)) < 1e-4


def test_batch_n_equals_batch_1_under_sampling(small):
    target, drafter, head, prompts = small
    rule = BatchedSampling(0.9)
    many, _ = decode_all(target, prompts, MAX_NEW, set(), drafter=drafter, head=head, rule=rule, seed=4, batch_size=5)
    ones, _ = decode_all(target, prompts, MAX_NEW, set(), drafter=drafter, head=head, rule=rule, seed=4, batch_size=1)
    other, _ = decode_all(target, prompts, MAX_NEW, set(), drafter=drafter, head=head, rule=rule, seed=5, batch_size=5)
    assert [r.tokens for r in many] == [r.tokens for r in ones]  # a row's draws do not depend on its batch
    assert [r.accepted for r in many] == [r.accepted for r in ones]
    assert [r.tokens for r in many] != [r.tokens for r in other]  # the seed matters


def test_counter_uniforms_are_uniform_and_independent():
    uid = torch.arange(4000)
    u = uniforms(0, uid, torch.zeros_like(uid), 3)
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert abs(float(torch.corrcoef(u.T)[0, 1])) < 0.05  # slots of a row
    assert not torch.equal(u, uniforms(1, uid, torch.zeros_like(uid), 3))
    assert torch.equal(u[7:9], uniforms(0, uid[7:9], torch.zeros(2, dtype=torch.long), 3))


# ------------------------------------------------------------------------------------------------------------
# Lossless check: a numerical tie vs a real divergence
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def twin_rows():
    """A target whose LM head has two identical rows A < B (untied), so their logits tie exactly: the batched
    verification emits A (argmax takes the first); a plain reference whose one-token forward rounds B up by
    `delta` emits B. That is what bf16 does to close logits, constructed in fp32."""
    target = _target(2, tied=False)
    prompt = [1, 6, 2, 7, 3]
    ref, _ = decode_all(target, [prompt], MAX_NEW, set())
    a = next(t for t in ref[0].tokens[3:] if t < VOCAB - 1)
    with torch.no_grad():
        target.lm_head.weight[VOCAB - 1] = target.lm_head.weight[a]
    head = TargetHead(target.model.embed_tokens.weight.detach().clone(), target.lm_head.weight.detach().clone())
    drafter = DFlashDrafter(DrafterConfig.from_target(target.config.to_dict(), 1, [0, 1], BLOCK, 0, VOCAB)).eval()
    return target, head, drafter, prompt, a


def _with_b_shifted(target, prompt, delta, noise=None, **speculative):
    """One decoding of `prompt` (plain greedy, or speculative given drafter= and head=) with the target's logit
    for B = VOCAB-1 moved by `delta` (and every logit by `noise`, a vector over the vocabulary, when given)."""
    b = VOCAB - 1
    shift = delta * (torch.arange(VOCAB) == b) + (0 if noise is None else noise)
    hook = target.lm_head.register_forward_hook(lambda m, i, out: out + shift)
    try:
        rows, _ = decode_all(target, [prompt], MAX_NEW, set(), **speculative)
    finally:
        hook.remove()
    return rows[0]


def test_a_tie_within_the_dtype_resolution_is_a_tie(twin_rows):
    target, head, drafter, prompt, a = twin_rows
    spec = decode_all(target, [prompt], MAX_NEW, set(), drafter=drafter, head=head)[0][0]
    i = spec.tokens.index(a)  # the first place the twins tie at the top
    delta = tie_tolerance("float32", spec.top1[i], 0.0) / 2  # 2 ulps of fp32 at that logit
    plain = _with_b_shifted(target, prompt, delta)
    found = classify(spec, plain, "float32", 0.0)
    assert found["position"] == i and found["tie"]
    assert (found["greedy_token"], found["speculative_token"]) == (VOCAB - 1, a)
    assert found["verify_gap"] == 0.0 and 0 < found["plain_gap"] <= found["tolerance"]
    report = lossless_report([spec], [plain], ["s0"], "float32", 0.0)
    assert report["numerical_ties"] == 1 and not report["lossless_failures"]
    assert report["ties"]["positions"][0]["position"] == i and report["ties"]["gap_max"] == found["plain_gap"]


def test_a_gap_beyond_the_dtype_resolution_is_a_failure(twin_rows):
    target, head, drafter, prompt, a = twin_rows
    spec = decode_all(target, [prompt], MAX_NEW, set(), drafter=drafter, head=head)[0][0]
    plain = _with_b_shifted(target, prompt, 1.0)  # the reference prefers B by a whole logit
    report = lossless_report([spec], [plain], ["s0"], "float32", 1e-3)
    assert report["numerical_ties"] == 0 and len(report["lossless_failures"]) == 1
    # the same gap in bf16 terms: 1.0 is 8 ulps at |logit| 16-32, still a divergence; 0.25 is a tie there
    assert tie_tolerance("bfloat16", 20.0, 1e-3) == 0.5 and tie_tolerance("float32", 20.0, 1e-3) == 1e-3


def test_a_three_way_tie_within_the_resolution_is_a_tie(twin_rows):
    """Three LM-head rows alike (A, C = VOCAB-2, B = VOCAB-1). The verification lowers B by a quarter of the
    resolution: A and C level at its top, B just behind; the reference raises B as much and emits it, A and C
    level behind. The verification's runner-up is C, not B (no swap of the same two tokens: the older rule
    failed it, as it failed H100 bf16 runs), yet each forward ranks the other's token within the resolution: a
    tie. B a whole logit ahead in the reference is still a failure."""
    import copy

    target, head, drafter, prompt, a = twin_rows
    triple = copy.deepcopy(target)
    with torch.no_grad():
        triple.lm_head.weight[VOCAB - 2] = triple.lm_head.weight[a]
    level = decode_all(triple, [prompt], MAX_NEW, set(), drafter=drafter, head=head)[0][0]
    i = level.tokens.index(a)
    assert a < VOCAB - 2 and sorted(level.near_ids[i][:3]) == [a, VOCAB - 2, VOCAB - 1]
    delta = tie_tolerance("float32", level.top1[i], 0.0) / 4
    spec = _with_b_shifted(triple, prompt, -delta, drafter=drafter, head=head)
    plain = _with_b_shifted(triple, prompt, delta)
    assert sorted(spec.near_ids[i][:2]) == [a, VOCAB - 2] and spec.gap[i] == 0.0  # B is not the runner-up
    found = classify(spec, plain, "float32", 0.0)
    assert found["tie"] and found["position"] == i
    assert (found["greedy_token"], found["speculative_token"]) == (VOCAB - 1, a)
    assert 0 < found["verify_gap"] <= found["tolerance"] and 0 < found["plain_gap"] <= found["tolerance"]
    far = _with_b_shifted(triple, prompt, 1.0)
    lost = lossless_report([spec], [far], ["s0"], "float32", 1e-3)
    assert lost["numerical_ties"] == 0 and len(lost["lossless_failures"]) == 1
    failure = lost["lossless_failures"][0]
    assert failure["plain_gap"] is None or failure["plain_gap"] > failure["tolerance"]


def test_a_flip_beyond_the_ulps_is_a_tie_only_within_the_positions_own_noise(twin_rows):
    """The H100 case: the pair's margin moved beyond the 4-ulp tolerance while the other tokens' logits moved
    between the two forwards about as far (the flip within 2x their spread): a tie. In float32 on this CPU the
    two forwards' own rounding already spreads the others by ~14 ulps, so the flip here is 50 ulps and the added
    noise +-20 ulps. The same flip with no added noise is a failure, and so is a large flip within a spread that
    is no longer rounding (+-100 ulps: over the 64-ulp cap)."""
    target, head, drafter, prompt, a = twin_rows
    spec = decode_all(target, [prompt], MAX_NEW, set(), drafter=drafter, head=head)[0][0]
    i = spec.tokens.index(a)
    u = ulp("float32", spec.top1[i])
    sign = torch.where(torch.arange(VOCAB) % 2 == 0, 1.0, -1.0)
    sign[[a, VOCAB - 1]] = 0.0  # the pair in question moves by delta alone

    def found(delta_ulps, noise_ulps):
        plain = _with_b_shifted(target, prompt, delta_ulps * u, noise=noise_ulps * u * sign)
        return classify(spec, plain, "float32", 0.0)

    noisy = found(50, 20)
    assert noisy["position"] == i and noisy["plain_gap"] > noisy["tolerance"]  # the ulp rule alone fails it
    assert 25 * u <= noisy["drift_range"] <= NOISE_CAP_ULPS * u and noisy["tie"]
    still = found(50, 0)
    assert still["position"] == i and still["drift_range"] < 25 * u and not still["tie"]
    wild = found(400, 100)
    assert wild["position"] == i and wild["drift_range"] > NOISE_CAP_ULPS * u and not wild["tie"]


class KeepsOneRejectedDraft(BatchedGreedy):
    """A verification bug: the first rejected draft is kept as well (emitted instead of the target's token)."""

    def accept(self, draft, q, logits, u):
        kept, post = super().accept(draft, q, logits, u)
        kept = (kept + 1).clamp_max(draft.shape[1])
        emitted = torch.cat([draft, post[:, -1:]], 1)
        return kept, emitted


def test_a_verification_bug_is_a_real_divergence_not_a_tie(small):
    target, drafter, head, prompts = small
    plain, _ = decode_all(target, prompts, MAX_NEW, set())
    buggy, _ = decode_all(target, prompts, MAX_NEW, set(), drafter=drafter, head=head, rule=KeepsOneRejectedDraft())
    report = lossless_report(buggy, plain, list(range(len(prompts))), "float32", 1e-3)
    assert report["lossless_failures"] and report["numerical_ties"] == 0
    good, _ = decode_all(target, prompts, MAX_NEW, set(), drafter=drafter, head=head)
    assert lossless_report(good, plain, list(range(len(prompts))), "float32", 1e-3)["identical_outputs"] == 5


def test_prompts_longer_than_the_context_are_skipped_or_refused(small, capsys):
    target = small[0]
    room = context_room(target, 100, BLOCK)
    assert room == 128 - 100 - BLOCK
    prompts = [{"sample_id": i, "prompt": [1] * n} for i, n in enumerate((10, 24, 25, 400))]
    kept, skipped = fit_prompts(prompts, room, "held-out prompts")
    assert [p["sample_id"] for p in kept] == [0, 1] and skipped["count"] == 2 and skipped["sample_ids"] == [2, 3]
    assert "skipped 2 of 4 prompts longer than the target's room of 24 tokens" in capsys.readouterr().out
    with pytest.raises(PipelineError, match="all 2 prompts are longer"):
        fit_prompts(prompts[2:], room, "held-out prompts")


def test_a_greedy_step_draws_no_uniforms_and_a_sampling_step_does(small):
    """Greedy verification needs no randomness: its speculative step dispatches none of the counter hashing that a
    sampling step runs (72 kernels a step at batch 1; benchmarks/decode_step_kernels.py counts them by part)."""
    target, drafter, head, prompts = small
    hashing = {"bitwise_xor", "__rshift__", "__lshift__"}
    parts = {"target forward": target, "drafter forward": drafter}
    for rule, draws in ((BatchedGreedy(), False), (BatchedSampling(0.9), True)):
        decoder = BatchDecoder(target, prompts[:1], MAX_NEW, set(), drafter=drafter, head=head, rule=rule, graphs=False)
        counts = decode_step_kernels.step_counts(decoder, parts)
        assert bool(hashing & set(counts["rest"])) is draws
        assert counts["drafter forward"]["mm"] >= 2 * 7  # the parts are attributed: 2 layers of 7+ projections


def test_the_kernel_count_benchmark_prints_its_table(capsys):
    """benchmarks/decode_step_kernels.py --tiny: the parts add up to each step's total, and the speculative step
    dispatches more kernels than the plain one (the drafter's forward on top of a wider verification)."""
    res = decode_step_kernels.main(["--tiny", "--prompt", "40"])
    out = capsys.readouterr().out
    for kind in ("plain", "spec"):
        assert sum(sum(c.values()) for c in res[kind].values()) == res["total"][kind] > 0
    assert res["total"]["spec"] > res["total"]["plain"] and "drafter forward" in res["spec"]
    assert f"| {res['total']['spec']:>6} |" in out
