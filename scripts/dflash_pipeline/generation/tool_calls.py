"""Tool calls on the wire: stored messages to OpenAI chat messages, a server's `tool_calls` back to the stored
form, and what `turns: all` does when the target calls other tools than the original conversation did.

Stored form (data/conversations.py): an assistant's `tool_calls` is JSON text of `[{"id", "type": "function",
"function": {"name", "arguments": <object>}}]`; a tool result carries `tool_call_id` and `name`.
Wire form (OpenAI chat API, as SGLang 0.5.23's `protocol.ToolCall` / `FunctionResponse` take and give it):
`function.arguments` is a JSON *string*. SGLang 0.5.23 answers a parsed call as `{"id": "call_<24 hex>",
"index": k, "type": "function", "function": {"name", "arguments": "<JSON text>"}}` with
`finish_reason: "tool_calls"` (serving_chat._process_tool_calls).
"""

from __future__ import annotations

import hashlib
import json
import re

from dflash_pipeline.data.conversations import tool_calls_of
from dflash_pipeline.data.tool_turns import ArgumentsError, call_arguments

# Qwen2.5 / Qwen3 templates: a call is `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` after the text
QWEN_CALL_MARK = "<tool_call>"
_QWEN_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ToolCallError(ValueError):
    """A call in a server's answer that cannot be stored (arguments not a JSON object, no name)."""


def wire_message(m: dict) -> dict:
    """One stored message as the chat API wants it (earlier thinking is not sent back). A chat-only message is
    exactly `{"role", "content"}`, as before tool calling existed."""
    out = {"role": m["role"], "content": m["content"]}
    calls = tool_calls_of(m)
    if calls:
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": json.dumps(c["function"].get("arguments") or {},
                                                                   ensure_ascii=False)}}
                             for c in calls]
    if m["role"] == "tool":
        out.update({k: m[k] for k in ("tool_call_id", "name") if m.get(k) is not None})
    return out


def has_tool_content(sample: dict) -> bool:
    """The sample has tool schemas, calls or tool results (what an engine must render and parse)."""
    return bool(sample.get("tools")) or any(m.get("tool_calls") or m["role"] == "tool" for m in sample["messages"])


def parse_tool_calls(raw) -> list[dict] | None:
    """A response message's `tool_calls` in the stored form (arguments parsed into an object), None for none;
    ToolCallError for a call that cannot be stored."""
    if not raw:
        return None
    if not isinstance(raw, list):
        raise ToolCallError(f"tool_calls is a {type(raw).__name__}, not a list")
    calls = []
    for k, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolCallError(f"tool call {k} has no function name")
        raw_args = fn.get("arguments")
        try:
            args = call_arguments(raw_args)
        except ArgumentsError as exc:  # the text itself, when it is not JSON: what the target wrote
            raise ToolCallError(f"tool call {k} ({fn['name']}): {exc}"
                                + (f": {raw_args[:80]!r}" if exc.not_json else "")) from None
        calls.append({"id": str(call.get("id") or f"call_{k}"), "type": "function",
                      "function": {"name": fn["name"], "arguments": args}})
    return calls


def template_messages(messages: list[dict]) -> list[dict]:
    """Wire messages as a chat template takes them: call arguments given as JSON text become objects (SGLang
    0.5.23 does the same before rendering); chat-only messages are returned as they are."""
    if not any(m.get("tool_calls") for m in messages):
        return messages
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"]) if isinstance(c["function"]["arguments"], str)
                else c["function"]["arguments"]}} for c in m["tool_calls"]]}
        out.append(m)
    return out


def qwen_tool_calls(text: str) -> tuple[str, list[dict] | None]:
    """(content, calls in the stored form) of an answer in Qwen's layout, split as SGLang 0.5.23's qwen25 parser
    does: the content is the text before the first call, stripped; no complete block (an answer cut inside its
    call): the content alone. Unlike SGLang, which drops a block that is not JSON, such a block is a
    ToolCallError: the sample fails with the reason instead of losing the call silently."""
    at = text.find(QWEN_CALL_MARK)
    if at == -1:
        return text, None
    raw = []
    for k, block in enumerate(_QWEN_CALL.findall(text[at:])):
        try:
            obj = json.loads(block)
        except ValueError as exc:
            raise ToolCallError(f"tool call {k}: the <tool_call> block is not JSON ({getattr(exc, 'msg', exc)}): "
                                f"{block[:80]!r}") from None
        if not isinstance(obj, dict):
            raise ToolCallError(f"tool call {k}: the <tool_call> block is a {type(obj).__name__}, not an object")
        digest = hashlib.blake2b(f"{k}:{block}".encode(), digest_size=12).hexdigest()
        raw.append({"id": f"call_{digest}", "type": "function",
                    "function": {"name": obj.get("name"), "arguments": obj.get("arguments", obj.get("parameters"))}})
    return text[:at].strip(), parse_tool_calls(raw)


def called_names(calls) -> list[str]:
    return [c["function"]["name"] for c in calls or []]


def divergence(original: dict | None, generated: list[dict] | None, turn: int) -> str | None:
    """Why the conversation must end after this generated turn (None: it may go on with the original's later
    turns): the target called other tools than the original turn (or none where it called one, or one where
    it called none), so the original's tool results would answer calls that were not made."""
    want = called_names(tool_calls_of(original)) if original is not None else []
    got = called_names(generated)
    if want == got:
        return None
    said = ", ".join(got) if got else "no tool"
    return f"turn {turn}: the target called {said} where the original called {', '.join(want) or 'no tool'}"


def renamed_results(messages: list[dict], original: dict, generated: list[dict] | None) -> list[dict]:
    """The original's tool results with `tool_call_id` renamed to the ids of the target's calls (same tools,
    same order): their content stays the original's."""
    ids = {c["id"]: g["id"] for c, g in zip(tool_calls_of(original), generated or [])}
    return [{**m, "tool_call_id": ids.get(m.get("tool_call_id"), m.get("tool_call_id"))} if m["role"] == "tool"
            else m for m in messages]
