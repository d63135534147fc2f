"""Tool-calling conversations on the data side: the sample schema, ingest of both shapes, masks, audit."""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline.data.conversations import (
    MESSAGE_TYPE,
    SAMPLE_SCHEMA,
    message_for_template,
    sample_id,
    sample_tools,
    with_sample_columns,
)

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def stored_tool_conversation() -> tuple[list[dict], str]:
    """(messages, tools) as a normalized sample stores them: tool fields as JSON text."""
    messages = [
        {"role": "user", "content": "Weather in Paris?", "reasoning_content": None},
        {"role": "assistant", "content": "", "reasoning_content": None, "tool_calls": json.dumps([CALL])},
        {"role": "tool", "content": '{"temp_c": 21}', "reasoning_content": None, "tool_call_id": "call_1",
         "name": "get_weather"},
        {"role": "assistant", "content": "It is 21 C in Paris.", "reasoning_content": None},
    ]
    return messages, json.dumps([WEATHER_TOOL])


def test_chat_only_sample_id_is_unchanged():
    # the formula before tool calling existed: ids of existing results stay valid
    messages = [{"role": "user", "content": "Hi", "reasoning_content": None},
                {"role": "assistant", "content": "Hello", "reasoning_content": "greet"}]
    old = json.dumps([[m["role"], m["content"], m["reasoning_content"]] for m in messages], ensure_ascii=False,
                     separators=(",", ":"))
    expected = hashlib.blake2b(old.encode("utf-8"), digest_size=12).hexdigest()
    assert sample_id(messages) == expected
    with_nulls = [{**m, "tool_calls": None, "tool_call_id": None, "name": None} for m in messages]
    assert sample_id(with_nulls) == expected


def test_sample_id_covers_tool_fields_and_tools():
    messages, tools = stored_tool_conversation()
    base = sample_id(messages, tools)
    assert base != sample_id(messages)  # the tools are part of the sample
    other_args = [dict(m) for m in messages]
    other_args[1]["tool_calls"] = json.dumps([{**CALL, "function": {"name": "get_weather",
                                                                    "arguments": {"city": "Rome"}}}])
    assert sample_id(other_args, tools) != base
    other_id = [dict(m) for m in messages]
    other_id[2]["tool_call_id"] = "call_2"
    assert sample_id(other_id, tools) != base


def test_message_for_template_and_sample_tools():
    messages, tools = stored_tool_conversation()
    assert message_for_template(messages[0]) == {"role": "user", "content": "Weather in Paris?"}
    call = message_for_template(messages[1])
    assert call["tool_calls"] == [CALL] and isinstance(call["tool_calls"][0]["function"]["arguments"], dict)
    assert message_for_template(messages[2]) == {"role": "tool", "content": '{"temp_c": 21}',
                                                 "tool_call_id": "call_1", "name": "get_weather"}
    assert sample_tools({"tools": tools}) == [WEATHER_TOOL]
    assert sample_tools({"tools": None}) is None and sample_tools({}) is None


def test_shard_written_before_tools_reads_as_null(tmp_path):
    old_message = pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string())])
    old_schema = pa.schema([("sample_id", pa.string()), ("source", pa.string()), ("source_id", pa.string()),
                            ("messages", pa.list_(old_message)), ("status", pa.string())])
    rows = [{"sample_id": "a", "source": "f#0", "source_id": None, "status": "ok",
             "messages": [{"role": "user", "content": "Hi", "reasoning_content": None}]}]
    pq.write_table(pa.Table.from_pylist(rows, schema=old_schema), tmp_path / "old.parquet")
    table = with_sample_columns(pq.read_table(tmp_path / "old.parquet"))
    assert table.schema.field("messages").type == pa.list_(MESSAGE_TYPE)
    row = table.to_pylist()[0]
    assert row["tools"] is None and row["status"] == "ok"
    assert row["messages"] == [{"role": "user", "content": "Hi", "reasoning_content": None, "tool_calls": None,
                                "tool_call_id": None, "name": None}]
    assert table.select(SAMPLE_SCHEMA.names).cast(SAMPLE_SCHEMA).num_rows == 1
