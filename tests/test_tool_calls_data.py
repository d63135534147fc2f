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


# --- ingest of both shapes -------------------------------------------------------------------------------------

TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a time zone.",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}


def openai_record(rid: str = "oa-1", **changes) -> dict:
    """An OpenAI chat-completions record: parallel calls with arguments as JSON strings, tool turns, tools."""
    record = {"id": rid, "tools": [WEATHER_TOOL, TIME_TOOL], "messages": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Paris and the time in Tokyo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "Asia/Tokyo"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_a", "content": '{"temp_c": 21}'},
        {"role": "tool", "tool_call_id": "call_b", "name": "get_time", "content": "09:14"},
        {"role": "assistant", "content": "It is 21 C in Paris and 09:14 in Tokyo.", "tool_calls": []},
    ]}
    record.update(changes)
    return record


def sharegpt_record(rid: str = "sg-1", call: str | None = None, **changes) -> dict:
    """A LLaMA-Factory ShareGPT record: `function_call` / `observation` turns, `tools` as a JSON string of bare
    function schemas."""
    call = call if call is not None else '{"name": "get_weather", "arguments": {"city": "Rome"}}'
    record = {"id": rid, "tools": json.dumps([WEATHER_TOOL["function"]]), "conversations": [
        {"from": "human", "value": "How warm is it in Rome?"},
        {"from": "function_call", "value": call},
        {"from": "observation", "value": '{"temp_c": 25}'},
        {"from": "gpt", "value": "It is 25 C in Rome."},
    ]}
    record.update(changes)
    return record


def ingest_records(tmp_path, records):
    from dflash_pipeline.data.ingest import ingest_file

    path = tmp_path / "tools.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    stats = ingest_file(str(path), str(tmp_path / "r.parquet"), str(tmp_path / "s.json"), str(tmp_path / "q.jsonl"))
    rows = pq.read_table(tmp_path / "r.parquet").to_pylist()
    quarantine = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert json.loads((tmp_path / "s.json").read_text()) == stats
    return stats, rows, quarantine


def test_openai_tool_calls_are_ingested(tmp_path):
    stats, rows, quarantine = ingest_records(tmp_path, [openai_record()])
    assert not quarantine and stats["kept"] == 1
    row = rows[0]
    assert sample_tools(row) == [WEATHER_TOOL, TIME_TOOL]
    messages = [message_for_template(m) for m in row["messages"]]
    assert messages[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}}]}
    # the tool's name comes from the call it answers when the result does not repeat it
    assert messages[3] == {"role": "tool", "content": '{"temp_c": 21}', "tool_call_id": "call_a",
                           "name": "get_weather"}
    assert messages[4] == {"role": "tool", "content": "09:14", "tool_call_id": "call_b", "name": "get_time"}
    assert messages[5] == {"role": "assistant", "content": "It is 21 C in Paris and 09:14 in Tokyo."}  # []: no calls
    assert row["sample_id"] == sample_id(row["messages"], row["tools"])
    assert stats["tool_calls"] == {"samples": 1, "calls": 2, "malformed_quarantined": 0}
    from dflash_pipeline.data.manifest import write_shard  # the shard the later stages read keeps it all

    spec = {"shard": 0, "rows": [0, 1], "drop": [], "samples": 1}
    write_shard(str(tmp_path / "r.parquet"), spec, str(tmp_path / "shard.parquet"))
    shard = pq.read_table(tmp_path / "shard.parquet").to_pylist()[0]
    assert shard["tools"] == row["tools"] and shard["messages"] == row["messages"]


def test_sharegpt_function_call_and_observation_are_ingested(tmp_path):
    stats, rows, quarantine = ingest_records(tmp_path, [sharegpt_record()])
    assert not quarantine and stats["kept"] == 1
    row = rows[0]
    assert sample_tools(row) == [WEATHER_TOOL]  # bare function schemas wrapped as OpenAI tools
    roles = [m["role"] for m in row["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    call = message_for_template(row["messages"][1])
    assert call == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]}
    assert message_for_template(row["messages"][2]) == {"role": "tool", "content": '{"temp_c": 25}',
                                                        "tool_call_id": "call_1_0", "name": "get_weather"}
    assert stats["tool_calls"] == {"samples": 1, "calls": 1, "malformed_quarantined": 0}


def _with_turn(record: dict, index: int, **fields) -> dict:
    key = "messages" if "messages" in record else "conversations"
    turns = [dict(t) for t in record[key]]
    turns[index].update(fields)
    return {**record, key: turns}


def _openai_call(name: str, arguments: str) -> list:
    return [{"id": "call_a", "type": "function", "function": {"name": name, "arguments": arguments}}]


MALFORMED = [
    ("args-not-json", _with_turn(openai_record(), 2, tool_calls=_openai_call("get_weather", '{"city": Paris')),
     "arguments are not JSON", "turn 2: the call to 'get_weather': arguments are not JSON"),
    ("args-a-list", _with_turn(openai_record(), 2, tool_calls=_openai_call("get_weather", "[1, 2]")),
     "arguments are not a JSON object", "arguments are not a JSON object (a list)"),
    ("unknown-tool", sharegpt_record(call='{"name": "book_flight", "arguments": {"to": "Rome"}}'),
     "not in the record's tools", "turn 1: calls tool 'book_flight', not in the record's tools (get_weather)"),
    ("no-call", {"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "{}"}]},
     "tool result with no preceding call", "turn 1: tool result with no preceding call"),
    ("observation-first", {"conversations": [{"from": "human", "value": "Hi"}, {"from": "observation", "value": "1"},
                                             {"from": "gpt", "value": "ok"}]},
     "tool result with no preceding call", "turn 1: tool result with no preceding call"),
    ("unknown-id", _with_turn(openai_record(), 3, tool_call_id="call_zzz"),
     "unknown tool_call_id", "turn 3: tool result for unknown tool_call_id 'call_zzz'"),
    ("wrong-name", _with_turn(openai_record(), 3, name="get_time"),
     "answers the call to", "turn 3: tool result of 'get_time' answers the call to 'get_weather'"),
    ("call-not-json", sharegpt_record(call='get_weather(city="Rome")'),
     "function_call value is not JSON", "turn 1: function_call value is not JSON"),
    ("tools-not-json", sharegpt_record(tools='[{"name": "get_weather"'), "malformed 'tools'",
     "malformed 'tools': not JSON"),
]


def test_malformed_tool_calls_are_quarantined_with_reasons(tmp_path):
    good = [openai_record("good-oa"), sharegpt_record("good-sg"),
            {"id": "chat", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
            '{"id": "cut", "messages": [']
    records = good[:2] + [{**record, "id": rid} for rid, record, _, _ in MALFORMED] + good[2:]
    stats, rows, quarantine = ingest_records(tmp_path, records)
    assert [r["source_id"] for r in rows] == ["good-oa", "good-sg", "chat"]
    reasons = {q["record_index"]: q["reason"] for q in quarantine}
    for index, (rid, _, _, text) in enumerate(MALFORMED, start=2):
        assert text in reasons[index], (rid, reasons[index])
    assert reasons[len(records) - 1].startswith("invalid JSON")
    assert (stats["records_read"], stats["kept"], stats["quarantined"]) == (len(records), 3, len(MALFORMED) + 1)
    assert stats["records_read"] == stats["kept"] + stats["quarantined"]
    expected = {}
    for _, _, kind, _ in MALFORMED:
        expected[kind] = expected.get(kind, 0) + 1
    assert stats["quarantine_reasons"] == {**expected, "invalid JSON": 1}
    assert stats["tool_calls"] == {"samples": 2, "calls": 3, "malformed_quarantined": len(MALFORMED)}


def test_demo_tool_result_without_call_is_quarantined_as_such(tmp_path):
    from dflash_pipeline.data.ingest import ingest_file
    from dflash_pipeline.demo.data import write_demo

    write_demo(tmp_path / "raw", n_records=36)
    stats = ingest_file(str(tmp_path / "raw" / "openai_part3.jsonl.zst"), str(tmp_path / "r.parquet"),
                        str(tmp_path / "s.json"), str(tmp_path / "q.jsonl"))
    quarantine = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert [(json.loads(q["record"])["id"], q["reason"]) for q in quarantine] == [
        ("tool-result-without-call", "turn 1: tool result with no preceding call")]
    assert stats["tool_calls"]["malformed_quarantined"] == 1 and (stats["records_read"], stats["kept"]) == (14, 13)
