"""Regenerated samples are tokenized from the target's own ids: the stream is kept exactly, even where the
text round trip (decode, reasoning split, chat template, re-encode) would change it."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_pipeline.data.tokenize import tokenize_shard
from dflash_pipeline.generation.client import COMPLETION_SCHEMA
from dflash_pipeline.target import load_tokenizer


def _row(sid: str, messages: list[dict], prompt_ids, output_ids, finish="stop") -> dict:
    return {"sample_id": sid, "source": "t", "source_id": sid,
            "messages": [{"role": m["role"], "content": m["content"], "reasoning_content": m.get("reasoning_content")}
                         for m in messages],
            "status": "ok", "failure_reason": None, "finish_reason": finish, "model": "tiny",
            "sampling_params": json.dumps({"temperature": 0.3}), "prompt_tokens": len(prompt_ids or []),
            "completion_tokens": sum(map(len, output_ids or [])), "generated_turns": 1, "attempts": 1,
            "output_ids": output_ids, "prompt_ids": prompt_ids}


@pytest.fixture(scope="module")
def generated(tiny_target):
    """A generated turn in a segmentation the tokenizer would never produce: the answer spelled one
    character per token (a sampling model can emit any segmentation), after the thinking block."""
    tok = load_tokenizer(str(tiny_target))
    user = [{"role": "user", "content": "What is 12 plus 30?"}]
    prompt = tok.apply_chat_template(user, tokenize=True, add_generation_prompt=True, enable_thinking=True,
                                     return_dict=True)["input_ids"]
    answer = "12 plus 30 is 42."
    think = tok.encode("<think>\nadd them\n</think>\n\n", add_special_tokens=False)
    spelled = [tok.convert_tokens_to_ids(tok.tokenize(ch)[0]) for ch in answer]
    output = think + spelled + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert tok.decode(spelled) == answer and tok.encode(answer, add_special_tokens=False) != spelled
    messages = user + [{"role": "assistant", "content": answer, "reasoning_content": "add them"}]
    return tok, messages, prompt, output


def test_tokenize_keeps_the_targets_own_ids(generated, tiny_target, tmp_path):
    tok, messages, prompt, output = generated
    rows = [_row("with-ids", messages, prompt, [output]), _row("no-ids", messages, None, None)]
    shard = tmp_path / "completions.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=COMPLETION_SCHEMA), shard)
    audit = tokenize_shard(str(shard), str(tiny_target), str(tmp_path / "tok.parquet"), str(tmp_path / "a.json"),
                           max_length=1024)
    got = {r["sample_id"]: r for r in pq.read_table(tmp_path / "tok.parquet").to_pylist()}
    exact = got["with-ids"]
    assert exact["input_ids"] == prompt + output  # the stream as generated, thinking and end token included
    assert exact["loss_mask"] == [0] * len(prompt) + [1] * len(output)
    assert exact["num_loss_tokens"] == len(output) and not exact["truncated"]
    # the same turn without ids goes through the text: a different stream, which is why the ids are kept
    text = got["no-ids"]
    assert text["input_ids"] != exact["input_ids"] and text["input_ids"][:len(prompt)] == prompt
    supervised = [t for t, m in zip(text["input_ids"], text["loss_mask"]) if m]
    assert tok.decode(supervised).endswith("12 plus 30 is 42.<|im_end|>")
    assert audit["samples"] == 2 and audit["counts"]["closing_missing"] == 0


def test_truncated_stream_and_missing_end_token_are_counted(generated, tiny_target, tmp_path):
    _, messages, prompt, output = generated
    rows = [_row("long", messages, prompt, [output[:-1]], finish="length")]
    shard = tmp_path / "completions.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=COMPLETION_SCHEMA), shard)
    cut = len(prompt) + 5
    audit = tokenize_shard(str(shard), str(tiny_target), str(tmp_path / "tok.parquet"), str(tmp_path / "a.json"),
                           max_length=cut)
    row = pq.read_table(tmp_path / "tok.parquet").to_pylist()[0]
    assert row["input_ids"] == (prompt + output)[:cut] and row["loss_mask"] == [0] * len(prompt) + [1] * 5
    assert row["truncated"] and audit["counts"]["truncated"] == 1
    assert audit["counts"]["closing_missing"] == 1  # stopped by length: no end token to learn
