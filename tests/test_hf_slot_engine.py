"""The hf slot engine (generation/slot_engine, slot_pool, slot_decode) with the tiny target on CPU: greedy tokens
equal plain `generate`'s while slots are refilled, compacted and long requests go to the wide pool; sampled
answers depend on the seed only; end tokens and budgets; exactly-once through the journal."""

from __future__ import annotations

import asyncio
import functools
import json
import random

import pytest

from conftest import run_cli
from generation_helpers import read_completions, read_summary, write_shard

FAST = ["--backoff-base", "0.02", "--backoff-max", "0.2", "--progress-interval", "0.5"]


@functools.lru_cache(maxsize=1)
def _reference(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return model, AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("<|im_end|>")


def generate_greedy(model_dir, prompt_ids: list[int], budget: int) -> list[int]:
    """Plain transformers `generate` greedy (its own model, its own attention), through the end token."""
    import torch

    model, end = _reference(str(model_dir))
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=budget, do_sample=False, eos_token_id=end, pad_token_id=end)
    new = out[0, len(prompt_ids):].tolist()
    return new[: new.index(end) + 1] if end in new else new


def run_engine(model_dir, prompts, params, budgets, **kw):
    from dflash_pipeline.generation.slot_engine import SlotEngine

    async def go():
        engine = SlotEngine(str(model_dir), threads=1, **kw)
        await engine.start()
        try:
            return engine, await asyncio.gather(*(engine.complete(m, p, b) for m, p, b in zip(prompts, params, budgets)))
        finally:
            await engine.close()

    return asyncio.run(go())


def _prompts(n: int):
    return [[{"role": "user", "content": "why " * (1 + 7 * i % 23) + f"question {i}?"}] for i in range(n)]


def test_greedy_equals_plain_generate_with_refills_compaction_and_the_wide_pool(tiny_target):
    from dflash_pipeline.generation.client import SamplingParams

    prompts = _prompts(9)
    budgets = [3, 40, 12, 1, 33, 25, 8, 40, 17]
    greedy = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0)
    # 3 slots of 80 columns (prompts of 18-81 tokens): rows are refilled and the cache compacted; prompt +
    # budget > 80 goes to the wide pool
    engine, got = run_engine(tiny_target, prompts, [greedy] * 9, budgets, batch_size=3, width=80)
    pool, wide = engine.scheduler.main, engine.scheduler.wide
    assert pool.step_count > max(budgets) and pool.shifts > 0 and wide is not None and wide.step_count > 0
    for messages, budget, completion in zip(prompts, budgets, got):
        ids = engine.render(messages, True)
        assert completion.prompt_ids == ids
        assert completion.output_ids == generate_greedy(tiny_target, ids, budget)
        assert completion.completion_tokens == len(completion.output_ids) <= budget
        stopped = completion.output_ids[-1] in engine.eos_ids
        assert completion.finish_reason == ("stop" if stopped else "length")
        assert stopped or len(completion.output_ids) == budget


def test_sampled_answers_depend_on_the_seed_only(tiny_target):
    """Same completions per seed whatever the slots, the cache width, the arrival order or the refill mode;
    different seeds give different answers."""
    from dflash_pipeline.generation.client import SamplingParams

    prompts = _prompts(8)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=100 + i) for i in range(8)]
    budgets = [20, 5, 30, 12, 1, 25, 9, 16]
    _, wide = run_engine(tiny_target, prompts, params, budgets, batch_size=8)
    order = list(range(8))
    random.Random(3).shuffle(order)
    _, narrow = run_engine(tiny_target, [prompts[i] for i in order], [params[i] for i in order],
                           [budgets[i] for i in order], batch_size=3, width=80)
    _, batches = run_engine(tiny_target, prompts, params, budgets, batch_size=2, refill=False)
    narrow = [narrow[order.index(i)] for i in range(8)]
    assert [c.output_ids for c in wide] == [c.output_ids for c in narrow] == [c.output_ids for c in batches]
    assert [c.content for c in wide] == [c.content for c in narrow]
    assert len({tuple(c.output_ids) for c in wide}) == 8
    reseeded = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7 + i) for i in range(8)]
    _, other = run_engine(tiny_target, prompts, reseeded, budgets, batch_size=8)
    assert sum(a.output_ids != b.output_ids for a, b in zip(wide, other)) >= 6


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (20, 1.0), (20, 0.9), (0, 0.8)])
def test_device_sampler_draws_the_warped_distribution(top_k, top_p):
    """sample_rows over 4,000 seeds for one row of logits: nothing outside top-k / top-p, frequencies of the
    tempered, renormalized distribution (chi-square far inside its 99.9% quantile); temperature 0 is argmax."""
    import torch

    from dflash_pipeline.generation.slot_decode import NO_TOP_P, sample_rows

    n, vocab, temp = 4000, 50, 0.7
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 2
    rows = logits.expand(n, vocab)
    kk = torch.full((n,), top_k or 1 << 62)
    pp = torch.full((n,), top_p if top_p < 1 else NO_TOP_P)
    got = sample_rows(rows, torch.arange(n), torch.full((n,), 5), torch.full((n,), temp), kk, pp, top_k > 0 or top_p < 1)
    probs = torch.softmax(logits / temp, -1).double()
    order = probs.argsort(descending=True)
    q = probs[order][: top_k or vocab]
    q = q / q.sum()
    keep = (q.cumsum(0) - q) < top_p
    want = torch.zeros(vocab, dtype=torch.float64)
    want[order[: len(q)][keep]] = q[keep] / q[keep].sum()
    counts = torch.bincount(got, minlength=vocab).double()
    assert counts[want == 0].sum() == 0
    sel = want > 0
    chi2 = float((((counts[sel] - n * want[sel]) ** 2) / (n * want[sel])).sum())
    df = int(sel.sum()) - 1
    assert chi2 < df + 4.5 * (2 * df) ** 0.5
    greedy = sample_rows(rows[:3], torch.arange(3), torch.zeros(3, dtype=torch.long), torch.zeros(3), kk[:3], pp[:3], True)
    assert greedy.tolist() == [int(logits.argmax())] * 3


def test_row_noise_is_a_function_of_seed_and_step():
    import torch

    from dflash_pipeline.generation.slot_decode import row_uniform

    seeds, steps = torch.tensor([7, 1, 2 ** 62, 7]), torch.tensor([3, 3, 3, 4])
    u = row_uniform(seeds, steps)
    assert u[0] == row_uniform(torch.tensor([7]), torch.tensor([3]))[0] and u[0] != u[3] and u[0] != u[1]
    many = row_uniform(torch.arange(20000), torch.zeros(20000, dtype=torch.long)).double()
    assert 0 < float(many.min()) and float(many.max()) < 1
    ks = (many.sort().values - torch.linspace(0, 1, many.numel(), dtype=torch.float64)).abs().max()
    assert float(ks) < 1.95 / many.numel() ** 0.5 * 1.5


def test_end_tokens_and_budgets_at_the_scheduler(tiny_target):
    """A row stops at its end token (kept, last) or its budget; an end token as the first token, or a budget of
    one, is answered at admission without taking a slot."""
    import torch

    from dflash_pipeline.generation.slot_decode import Request, use_slot_attention
    from dflash_pipeline.generation.slot_pool import SlotScheduler
    from dflash_pipeline.target import load_model

    model = load_model(str(tiny_target), "cpu", "float32")
    use_slot_attention(model)
    prompt = [5, 17, 300, 42, 8]
    plain = generate_greedy(tiny_target, prompt, 12)
    with torch.inference_mode():
        def run(eos, budget):
            sched = SlotScheduler(model, eos, rows=2, width=64, context=512)
            done = sched.run([Request(prompt=prompt, budget=budget), Request(prompt=prompt[:3], budget=budget)])
            return done[[r.prompt for r in done].index(prompt)].tokens, sched

        assert run(set(), 12)[0] == plain[:12]
        stop = plain[4]
        tokens, _ = run({stop}, 12)
        assert tokens == plain[: plain.index(stop) + 1]
        tokens, sched = run({plain[0]}, 12)
        assert tokens == [plain[0]]
        assert run(set(), 1)[0] == plain[:1]


def test_exactly_once_through_the_journal_with_the_slot_engine(tmp_path, tiny_target):
    """A run with the slot engine, then its journal cut to 7 records (a crash) and the shard deleted: the rerun
    resumes those 7, generates exactly the others, one row per sample, and (sampling is a function of the seed)
    regenerates the same answers as the first run."""
    rows = write_shard(tmp_path / "in.parquet", 20, seed=4)
    out = tmp_path / "s-00000.parquet"
    journal = tmp_path / "journal" / "s-00000.jsonl"
    args = ["generate", "--input", tmp_path / "in.parquet", "--out", out, *FAST, "--backend", "hf", "--model",
            tiny_target, "--engine", "slots", "--batch-size", "4", "--threads", "1", "--max-new-tokens", "24",
            "--temperature", "0.7", "--seed", "5"]
    run_cli(*args)
    first = read_completions(out)
    assert [r["sample_id"] for r in first] == [r["sample_id"] for r in rows]
    assert all(r["status"] == "ok" for r in first)
    lines = journal.read_bytes().split(b"\n")
    records = [l for l in lines[1:] if l.strip()]
    assert len({json.loads(l)["sample_id"] for l in records}) == 20
    journal.write_bytes(b"\n".join([lines[0]] + records[:7]) + b"\n")
    out.unlink()
    run_cli(*args)
    again = read_completions(out)
    summary = read_summary(out)
    assert summary["resumed_from_journal"] == 7 and summary["this_run"]["requests"] == 13
    assert [r["sample_id"] for r in again] == [r["sample_id"] for r in rows]
    assert [r["output_ids"] for r in again] == [r["output_ids"] for r in first]
    assert [r["messages"] for r in again] == [r["messages"] for r in first]


def test_the_engine_counts_its_saturated_rounds(tiny_target):
    """More requests than slots: the rounds run while requests waited for a slot are counted (the calibration's
    steady-state figure): each decoded a full pool (3 rows), and the drain at the end, rows idle, is left out."""
    from dflash_pipeline.generation.client import SamplingParams

    greedy = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0)
    budgets = [24, 6, 30, 12, 18, 9, 27, 15, 21, 3, 30, 12]
    engine, got = run_engine(tiny_target, _prompts(12), [greedy] * 12, budgets, batch_size=3, width=128)
    tokens, seconds = engine.saturated()
    total = sum(c.completion_tokens for c in got)
    assert 0 < tokens < total and 0 < seconds < engine.generate_seconds
    pool = engine.scheduler.main
    assert tokens % 3 == 0 and tokens >= 3 * max(budgets)  # full-pool steps only, and many of them
    assert pool.row_steps - tokens >= 3  # the drain: the last rows ran unsaturated
