"""The normalized conversation: what every stage after ingest reads.

A sample is `{"sample_id", "source", "source_id", "messages": [MESSAGE], "tools"}` with MESSAGE
`{"role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name"}` and role in
{system, user, assistant, tool}. `reasoning_content` is the assistant's thinking (None if absent).
Tool calling (OpenAI's shape, stored as JSON text so the Parquet schema stays fixed whatever the tools are):
- assistant `tool_calls`: a list of `{"id", "type": "function", "function": {"name", "arguments"}}` with
  `arguments` a parsed JSON object (never a string); None when the turn calls nothing;
- role `tool`: the result of the call `tool_call_id`, of the tool `name`;
- sample `tools`: the record's tool schemas, `[{"type": "function", "function": {"name", "description",
  "parameters"}}]`, None when the record has none.
Ingested shards and completion shards share this Parquet schema (completions add generation columns).
Shards written before tool calling lack these columns and fields: `with_sample_columns` reads them as null.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata

import pyarrow as pa

from dflash_pipeline.errors import PipelineError

ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",  # OpenAI's legacy role for a function's result
    "observation": "tool",  # ShareGPT / LLaMA-Factory: a tool's result
    "function_call": "assistant",  # ShareGPT / LLaMA-Factory: the value is the call (data/tool_turns.py)
}

MESSAGE_TYPE = pa.struct(
    [("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string()),
     ("tool_calls", pa.string()), ("tool_call_id", pa.string()), ("name", pa.string())]
)
TOOL_FIELDS = ("tool_calls", "tool_call_id", "name")
ROLES = frozenset({"system", "user", "assistant", "tool"})

SAMPLE_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("source", pa.string()),
        ("source_id", pa.string()),
        ("messages", pa.list_(MESSAGE_TYPE)),
        ("tools", pa.string()),
    ]
)


class RecordRejected(ValueError):
    """A record that is quarantined; the message is the reason."""


def normalize_record(record) -> tuple[str | None, list[dict], str | None]:
    """(original id, normalized messages, tools JSON text or None) of a ShareGPT (`conversations`), OpenAI
    (`messages`) or LMSYS/WildChat (`conversation`) record, or RecordRejected. Tool calls: data/tool_turns.py."""
    from dflash_pipeline.data.tool_turns import ToolCalls, parse_tools

    if not isinstance(record, dict):
        raise RecordRejected(f"record is a {type(record).__name__}, not an object")
    if "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    elif "conversation" in record:  # LMSYS-Chat-1M and WildChat: OpenAI-style turns under the singular name
        turns, role_key, text_key = record["conversation"], "role", "content"
    else:
        raise RecordRejected("no 'conversations', 'messages' or 'conversation' field")
    if not isinstance(turns, list):
        raise RecordRejected(f"conversation is a {type(turns).__name__}, not a list")
    if not turns:
        raise RecordRejected("empty conversation")
    tools = parse_tools(record.get("tools"))
    calls = ToolCalls(tools)
    messages = [_normalize_turn(turn, i, role_key, text_key, calls) for i, turn in enumerate(turns)]
    if not any(m["role"] == "user" for m in messages):
        raise RecordRejected("no user turn")
    raw_id = record.get("id", record.get("conversation_id"))
    tools_text = None if tools is None else json.dumps(tools, ensure_ascii=False)
    return (None if raw_id is None else str(raw_id)), messages, tools_text


def _normalize_turn(turn, i: int, role_key: str, text_key: str, calls) -> dict:
    from dflash_pipeline.data.tool_turns import tool_result_text

    if not isinstance(turn, dict):
        raise RecordRejected(f"turn {i} is a {type(turn).__name__}, not an object")
    raw_role = turn.get(role_key, turn.get("role", turn.get("from")))
    if not isinstance(raw_role, str):
        raise RecordRejected(f"turn {i} has no role")
    role = ROLE_MAP.get(raw_role.strip().lower())
    if role is None:
        raise RecordRejected(f"turn {i} has unknown role {raw_role!r}")
    text = turn.get(text_key, turn.get("content", turn.get("value")))
    message = {"role": role, "content": text, "reasoning_content": turn.get("reasoning_content")}
    if raw_role.strip().lower() == "function_call":  # ShareGPT: the value is the call itself
        message["content"], message["tool_calls"] = "", calls.from_function_call(text, i)
    elif role == "assistant" and (_calls_something(turn) or isinstance(turn.get("function_call"), dict)):
        # a legacy OpenAI `function_call` object is one call
        raw = turn["tool_calls"] if _calls_something(turn) else [{"function": turn["function_call"]}]
        message["tool_calls"] = calls.from_openai(raw, i)
        message["content"] = "" if text is None else text
    elif role == "tool":
        message["content"] = tool_result_text(text)
        message["tool_call_id"], message["name"] = calls.answer(turn.get("tool_call_id"), turn.get("name"), i)
    if not isinstance(message["content"], str):
        raise RecordRejected(f"turn {i} ({raw_role}) has no text (got {type(text).__name__})")
    if message["reasoning_content"] is not None and not isinstance(message["reasoning_content"], str):
        raise RecordRejected(f"turn {i} has a non-string reasoning_content")
    if role == "system" and i != 0:
        raise RecordRejected(f"system turn at position {i}; only the first turn may be a system prompt")
    return message


def _calls_something(turn: dict) -> bool:
    """The turn carries `tool_calls` (API exports write `tool_calls: []` or null on turns that call nothing)."""
    return turn.get("tool_calls") not in (None, [])


def _nfc(text: str | None) -> str | None:
    return text if text is None or text.isascii() else unicodedata.normalize("NFC", text)


def _hashed_message(m: dict) -> list:
    row = [m["role"], _nfc(m["content"]), _nfc(m.get("reasoning_content"))]
    extra = [m.get(k) for k in TOOL_FIELDS]
    if any(x is not None for x in extra):  # chat-only messages hash exactly as before tool calling existed
        row += [_nfc(x) for x in extra]
    return row


def sample_id(messages: list[dict], tools: str | None = None) -> str:
    """Stable content hash of the normalized messages (and the sample's `tools` JSON text, if any): same
    conversation, same id, in any file. A chat-only sample keeps the id it had before tool calling existed.

    The text is hashed in Unicode NFC, so the composed and decomposed spellings of one text ("é" as one code
    point or as "e" + combining accent) are one sample: the Qwen tokenizers normalise to NFC before encoding,
    so both would train the same tokens twice. The stored text is kept as it came."""
    rows = [_hashed_message(m) for m in messages]
    canonical = json.dumps(rows if tools is None else {"messages": rows, "tools": _nfc(tools)},
                           ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode("utf-8"), digest_size=12).hexdigest()


def tool_calls_of(msg: dict) -> list[dict]:
    """The message's tool calls as a list of dicts (stored as JSON text; [] when it calls nothing)."""
    calls = msg.get("tool_calls")
    if calls is None:
        return []
    return json.loads(calls) if isinstance(calls, str) else list(calls)


def message_for_template(msg: dict) -> dict:
    """A stored message as a chat template's `messages` entry: None-valued keys dropped (templates test
    `reasoning_content is defined` the way HF callers pass it), `tool_calls` as a list of dicts whose
    `function.arguments` is a dict; a tool result keeps `tool_call_id` and `name`."""
    out = {k: v for k, v in msg.items() if v is not None}
    if "tool_calls" in out:
        out["tool_calls"] = tool_calls_of(out)
    return out


def sample_tools(sample: dict) -> list | None:
    """The sample's tool schemas as a list (what a template's `tools=` takes), or None without tools."""
    tools = sample.get("tools")
    if tools is None:
        return None
    return json.loads(tools) if isinstance(tools, str) else list(tools)


def with_sample_columns(table: pa.Table) -> pa.Table:
    """`table` with SAMPLE_SCHEMA's columns and message fields: a shard written before tool calling (no
    `tools` column, three message fields) reads as one whose tool fields are null. Other columns stay."""
    if "tools" not in table.column_names:
        table = table.append_column("tools", pa.nulls(table.num_rows, pa.string()))
    at = table.column_names.index("messages")
    if table.schema.field("messages").type != SAMPLE_SCHEMA.field("messages").type:
        table = table.set_column(at, "messages", table.column("messages").cast(SAMPLE_SCHEMA.field("messages").type))
    return table


def check_conversation_table(path: str, table: pa.Table) -> None:
    """A table of conversations (an ingested or completions shard) has ids and role/content messages; one line
    naming the file and what is wrong otherwise (e.g. a raw ShareGPT table that skipped ingest)."""
    missing = [c for c in ("sample_id", "messages") if c not in table.column_names]
    if missing:
        hint = " (ShareGPT 'conversations': run `dflash-pipeline ingest` on it first)" \
            if "conversations" in table.column_names else ""
        raise PipelineError(f"{path}: not an ingested shard: no column {', '.join(map(repr, missing))}{hint}")
    mtype = table.schema.field("messages").type
    fields = {f.name: f.type for f in mtype.value_type} if pa.types.is_list(mtype) and \
        pa.types.is_struct(mtype.value_type) else {}
    if fields.get("role") != pa.string() or fields.get("content") != pa.string():
        hint = " (ShareGPT from/value: run `dflash-pipeline ingest` on the raw file)" if "from" in fields else ""
        raise PipelineError(f"{path}: column 'messages' is {mtype}, expected a list of "
                            f"{{role: string, content: string}} structs{hint}")
