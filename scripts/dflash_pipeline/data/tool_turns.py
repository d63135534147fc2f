"""Tool calls and tool results of a raw record, normalized to OpenAI's shape (see data/conversations.py).

Accepted shapes:
- OpenAI `messages`: assistant `tool_calls` (`function.arguments` a JSON string or an object), `tool` turns
  with `tool_call_id` (and optionally `name`), a record-level `tools` list;
- ShareGPT / LLaMA-Factory `conversations`: a `function_call` turn whose value is JSON `{"name", "arguments"}`
  (or a list of them: parallel calls), `observation` turns with the results, `tools` a JSON string or a list
  (entries either `{"type": "function", "function": {...}}` or the bare function schema).
Calls without an id get `call_<turn>_<k>`; a result without `tool_call_id` answers the oldest unanswered call
(to the tool the result names, if it names one).
Every malformed piece is a RecordRejected whose reason says which turn and what (the quarantine counts
these by the kinds in TOOL_REASON_KINDS).
"""

from __future__ import annotations

import json

from dflash_pipeline.data.conversations import RecordRejected

TOOL_REASON_KINDS = ("arguments are not JSON", "arguments are not a JSON object", "not in the record's tools",
                     "tool result with no preceding call", "unknown tool_call_id", "function_call value is not JSON",
                     "malformed tool call", "malformed 'tools'", "answers the call to")


def _json_error(exc: Exception) -> str:
    return exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)[:200]


class ArgumentsError(ValueError):
    """A call's arguments that cannot be stored; the message is the reason ("arguments are not JSON (...)")."""

    def __init__(self, reason: str, not_json: bool):
        super().__init__(reason)
        self.not_json = not_json


def call_arguments(args) -> dict:
    """A call's arguments in the stored form, a JSON object: JSON text is parsed, empty text and None are no
    arguments. The one rule for ingested calls and for calls a server answers (generation/tool_calls.py)."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError) as exc:
            raise ArgumentsError(f"arguments are not JSON ({_json_error(exc)})", not_json=True) from None
    args = {} if args is None else args
    if not isinstance(args, dict):
        raise ArgumentsError(f"arguments are not a JSON object (a {type(args).__name__})", not_json=False)
    return args


def parse_tools(raw) -> list | None:
    """The record's `tools` as a list of `{"type": "function", "function": {...}}` (None when absent/empty)."""
    if raw is None or raw == "" or raw == []:
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise RecordRejected(f"malformed 'tools': not JSON ({_json_error(exc)})") from None
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list):
        raise RecordRejected(f"malformed 'tools': a {type(raw).__name__}, not a list")
    tools = []
    for k, entry in enumerate(raw):
        fn = entry.get("function", entry) if isinstance(entry, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RecordRejected(f"malformed 'tools': entry {k} has no function name")
        tools.append({"type": "function", "function": fn})
    return tools or None


class ToolCalls:
    """The calls made so far in one conversation: checks names against `tools`, pairs results with calls."""

    def __init__(self, tools: list | None):
        self.names = [t["function"]["name"] for t in tools] if tools else None
        self.calls: dict[str, str] = {}  # id -> function name
        self.pending: list[str] = []  # ids not answered yet, oldest first

    def from_openai(self, raw, i: int) -> str:
        """An assistant turn's `tool_calls` (OpenAI) as the stored JSON text."""
        if not isinstance(raw, list) or not raw:
            raise RecordRejected(f"turn {i}: malformed tool call (tool_calls is a {type(raw).__name__}"
                                 f"{' that is empty' if raw == [] else ''}, expected a non-empty list)")
        calls = []
        for k, call in enumerate(raw):
            fn = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(fn, dict):
                raise RecordRejected(f"turn {i}: malformed tool call (call {k} is not an object with a function)")
            calls.append(self._call(fn, call.get("id"), i, k))
        return json.dumps(calls, ensure_ascii=False)

    def from_function_call(self, value, i: int) -> str:
        """A ShareGPT `function_call` turn's value (JSON text of one call or a list of calls) as stored JSON."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError) as exc:
                raise RecordRejected(f"turn {i}: function_call value is not JSON ({_json_error(exc)})") from None
        raw = value if isinstance(value, list) else [value]
        if not raw or not all(isinstance(c, dict) for c in raw):
            raise RecordRejected(f"turn {i}: malformed tool call (function_call value is not a call object "
                                 "or a list of them)")
        return json.dumps([self._call(c, c.get("id"), i, k) for k, c in enumerate(raw)], ensure_ascii=False)

    def _call(self, fn: dict, call_id, i: int, k: int) -> dict:
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise RecordRejected(f"turn {i}: malformed tool call (call {k} has no function name)")
        if self.names is not None and name not in self.names:
            raise RecordRejected(f"turn {i}: calls tool {name!r}, not in the record's tools "
                                 f"({', '.join(self.names)})")
        try:
            args = call_arguments(fn.get("arguments", fn.get("parameters")))
        except ArgumentsError as exc:
            raise RecordRejected(f"turn {i}: the call to {name!r}: {exc}") from None
        call_id = call_id if isinstance(call_id, str) and call_id else f"call_{i}_{k}"
        self.calls[call_id] = name
        self.pending.append(call_id)
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}

    def answer(self, call_id, name, i: int) -> tuple[str, str]:
        """(tool_call_id, tool name) of a tool result at turn `i`: the call it names by id, else the oldest
        open call (to the tool `name`, when the result names one)."""
        name = name if isinstance(name, str) and name else None
        if call_id is None or call_id == "":
            open_calls = [c for c in self.pending if name is None or self.calls[c] == name]
            if not open_calls:
                raise RecordRejected(f"turn {i}: tool result with no preceding call"
                                     f"{f' to {name!r}' if name is not None and self.pending else ''}")
            call_id = open_calls[0]
        elif not isinstance(call_id, str) or call_id not in self.calls:
            raise RecordRejected(f"turn {i}: tool result for unknown tool_call_id {call_id!r}"
                                 f"{'' if self.calls else ' (no preceding call)'}")
        elif name is not None and name != self.calls[call_id]:
            raise RecordRejected(f"turn {i}: tool result of {name!r} answers the call to {self.calls[call_id]!r} "
                                 f"(tool_call_id {call_id!r})")
        if call_id in self.pending:
            self.pending.remove(call_id)
        return call_id, self.calls[call_id]


def tool_result_text(value):
    """A tool result's content: text as is; an object or list (some datasets store parsed JSON) as JSON text."""
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return value
