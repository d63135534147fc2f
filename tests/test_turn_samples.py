"""`tokenize.turn_samples: every`: a regenerated multi-turn conversation becomes one training sample per generated
turn, each the exact ids the engine fed and emitted for that turn (the hf backend on the tiny target, greedy, so
the target's own greedy continuation of each stored prompt must give back that turn's ids); the held-out split
keeps a conversation's turns together."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from dflash_pipeline.data.generated_tokens import token_id_columns, turn_rows
from dflash_pipeline.drafter.sources import is_holdout
from dflash_pipeline.sample_ids import conversation_id
from generation_helpers import read_completions, write_shard
from test_generation import gen, greedy_continuation


@pytest.fixture(scope="module")
def completions(tmp_path_factory, tiny_target):
    tmp = tmp_path_factory.mktemp("turns")
    rows = write_shard(tmp / "in.parquet", 10, seed=4)
    out = tmp / "completions.parquet"
    gen(tmp / "in.parquet", out, "--backend", "hf", "--model", tiny_target, "--max-new-tokens", "6",
        "--temperature", "0", "--threads", "1", "--batch-size", "4", "--turns", "all")
    return tmp, rows, out


def _tokenize(tmp, tiny_target, out, mode):
    from conftest import run_cli

    run_cli("tokenize", "--input", out, "--model", tiny_target, "--out", tmp / f"{mode}.parquet",
            "--audit", tmp / f"{mode}.audit.json", "--max-length", "512", "--turn-samples", mode)
    return (pq.read_table(tmp / f"{mode}.parquet").to_pylist(),
            json.loads((tmp / f"{mode}.audit.json").read_text()))


def test_every_generated_turn_is_a_sample_of_its_exact_stream(completions, tiny_target):
    tmp, rows, out = completions
    got = [r for r in read_completions(out) if r["status"] == "ok"]
    multi = [r for r in got if r["generated_turns"] > 1]
    assert len(multi) >= 3  # the shard has multi-turn conversations to cut
    for r in got:  # what the engine fed each turn: its greedy continuation is the stored output
        assert len(r["turn_prompt_ids"]) == r["generated_turns"] and r["turn_prompt_ids"][-1] == r["prompt_ids"]
        for prompt, output in zip(r["turn_prompt_ids"], r["output_ids"]):
            assert greedy_continuation(tiny_target, prompt, 6) == output
    every, audit = _tokenize(tmp, tiny_target, out, "every")
    last, last_audit = _tokenize(tmp, tiny_target, out, "last")
    by_id = {s["sample_id"]: s for s in every}
    assert len(every) == sum(r["generated_turns"] for r in got) and len(last) == len(got)
    assert audit["counts"]["earlier_turn_samples"] == len(every) - len(got) == \
        sum(r["generated_turns"] - 1 for r in got)
    assert audit["samples"] == len(every) and last_audit["counts"]["earlier_turn_samples"] == 0
    for r in got:
        k_last = r["generated_turns"] - 1
        for k, (prompt, output) in enumerate(zip(r["turn_prompt_ids"], r["output_ids"])):
            s = by_id[r["sample_id"] if k == k_last else f"{r['sample_id']}#turn{k}"]
            assert s["input_ids"] == (prompt + output)[:512]
            assert s["loss_mask"] == ([0] * len(prompt) + [1] * len(output))[:512]
    # the last turn's sample is the one `last` makes, under the conversation's own id
    assert {s["sample_id"]: s["input_ids"] for s in last} == \
        {s["sample_id"]: s["input_ids"] for s in every if "#turn" not in s["sample_id"]}


def test_rows_without_per_turn_prompts_give_their_last_turn(completions):
    """A completions shard from before the column (or an engine without ids): every falls back to the last turn."""
    _, _, out = completions
    table = pq.read_table(out).drop_columns(["turn_prompt_ids"])
    for row, ids in zip(table.to_pylist(), token_id_columns(table)):
        if ids is not None:
            assert ids[2] is None and turn_rows(row["sample_id"], row["messages"], ids) == \
                [(row["sample_id"], row["messages"], ids)]


def test_the_holdout_split_keeps_a_conversations_turns_together():
    ids = [f"conv-{i}" for i in range(400)]
    held = [i for i in ids if is_holdout(i, 0.2)]
    assert 40 < len(held) < 120
    for i in ids:
        assert all(is_holdout(f"{i}#turn{k}", 0.2) == is_holdout(i, 0.2) for k in range(3))
    assert conversation_id("a#turn12") == "a" and conversation_id("a#turnx") == "a#turnx"
    assert conversation_id("a#turn1#turn2") == "a#turn1" and conversation_id("plain") == "plain"


def test_max_turns_ends_a_conversation_after_its_first_answers(completions, tiny_target):
    """`generate.max_turns: 1` with `turns: all`: a conversation ends after its first answer, which is the
    uncapped run's (greedy); its later user turns are not sent, nor kept."""
    tmp, _, full_out = completions
    out = tmp / "capped.parquet"
    gen(tmp / "in.parquet", out, "--backend", "hf", "--model", tiny_target, "--max-new-tokens", "6",
        "--temperature", "0", "--threads", "1", "--batch-size", "4", "--turns", "all", "--max-turns", "1")
    full = {r["sample_id"]: r for r in read_completions(full_out)}
    capped = read_completions(out)
    assert sum(full[r["sample_id"]]["generated_turns"] > 1 for r in capped) >= 3  # something to cut
    for r in capped:
        f = full[r["sample_id"]]
        assert r["generated_turns"] == 1
        assert r["output_ids"] == f["output_ids"][:1] and r["turn_prompt_ids"] == f["turn_prompt_ids"][:1]
        first_answer = next(i for i, m in enumerate(f["messages"]) if m["role"] == "assistant")
        assert r["messages"] == f["messages"][:first_answer + 1]
        assert json.loads(r["sampling_params"])["max_turns"] == 1
    assert "max_turns" not in json.loads(full[capped[0]["sample_id"]]["sampling_params"])
