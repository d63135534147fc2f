"""Assistant-only loss masks for any chat template, found by rendering rather than by regexes.

For assistant turn i of a conversation whose full rendering is T:
- start: where T leaves the rendering of `messages[:i]` with the generation prompt (the common prefix).
  Everything the template puts before the model's output (role header, an empty think block when
  thinking is off) is prompt; what the model would generate is supervised.
- end of content: render T again with turn i's content changed; the common suffix of the two renderings
  starts right after the content. This holds whatever the template does to earlier turns (Qwen3 drops
  their thinking) or to the text around the content.
- the turn's closing text (`<|im_end|>`, `<|eot_id|>`, ...) is learned once per template by rendering a
  probe conversation, and supervised when it follows the content (the model must learn to stop).
Character spans become token spans through the tokenizer's char -> token alignment, so the mask is exact
for the token ids actually produced from T. A token is supervised when its first character is.

Tool calling: a sample's `tools` go to the template as `tools=`, messages as `message_for_template` gives them.
An assistant turn that calls tools is supervised from its start to its closing text: its text and the call
tokens the template writes after it (the closing's first occurrence ends the turn: tokenize refuses samples
whose text, calls or tools contain control tokens). Tool results and the tools' schema are never supervised
(they are not assistant turns). A template that drops tools, calls or results (`tools_missing`, probed once)
would train such a sample without them: tokenize refuses those samples (`tool_refusal`).
"""

from __future__ import annotations

from dataclasses import dataclass

import jinja2

from dflash_pipeline.data.conversations import message_for_template

SENTINEL = "\u2063\u2063"  # appended to one turn's content to find where it ends (invisible separator)
# a tool-calling probe: each marker must appear in the rendering for the template to support tool calling
PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_lookup", "description": "Probe description 3.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
PROBE_MESSAGES = [
    {"role": "user", "content": "Probe question"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_probe", "type": "function",
         "function": {"name": "probe_lookup", "arguments": {"q": "probe value 9"}}}]},
    {"role": "tool", "content": "probe result 5", "tool_call_id": "call_probe", "name": "probe_lookup"},
    {"role": "assistant", "content": "Probe answer 7"},
]
PROBE_MARKERS = (("the tools' schemas (tools=)", "Probe description 3."), ("assistant tool_calls", "probe value 9"),
                 ("tool results", "probe result 5"))


@dataclass
class MaskedSample:
    input_ids: list[int]
    loss_mask: list[int]
    text: str
    spans: list[tuple[int, int]]  # supervised character spans in `text`
    turn_tokens: list[int]  # supervised tokens per assistant turn (before truncation)
    truncated: bool
    closing_found: bool  # every assistant turn ended with the template's closing text


def _common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search with C-speed slice comparisons
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix_len(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid:] == b[len(b) - mid:]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class ChatMasker:
    """Renders conversations with a tokenizer's chat template and builds exact assistant loss masks."""

    def __init__(self, tokenizer, enable_thinking: bool = True, max_length: int | None = None):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("a fast (Rust) tokenizer is required for exact character alignment")
        if not tokenizer.chat_template:
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer
        self.max_length = max_length
        self.template_kwargs = {"enable_thinking": enable_thinking}
        self._render = self._compile(tokenizer)
        self.closing = self._probe_closing()
        self.tools_missing = self._probe_tools()

    def _compile(self, tokenizer):
        try:  # the same compiled template that apply_chat_template uses, without its per-call overhead
            from transformers.utils.chat_template_utils import _compile_jinja_template

            template = _compile_jinja_template(tokenizer.chat_template)
            specials = dict(tokenizer.special_tokens_map)

            def render(messages, add_generation_prompt, tools=None, **overrides):
                extra = {} if tools is None else {"tools": tools}  # chat-only: rendered exactly as before tools
                return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                       **specials, **{**self.template_kwargs, **overrides}, **extra)
        except ImportError:  # pragma: no cover - older/newer transformers without the helper

            def render(messages, add_generation_prompt, tools=None, **overrides):
                return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt,
                                                     **{**self.template_kwargs, **overrides})
        return render

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list | None = None) -> str:
        return self._render(_clean(messages), add_generation_prompt, tools)

    def _probe_closing(self) -> str:
        probe = "Probe answer 7"
        text = self._render([{"role": "user", "content": "Probe question"},
                             {"role": "assistant", "content": probe}], False)
        at = text.rfind(probe)
        # trailing whitespace after the end-of-turn token is formatting the model does not generate
        return text[at + len(probe):].rstrip() if at >= 0 else ""

    def _probe_tools(self) -> str | None:
        """None when the template renders tools, tool calls and tool results; else what it drops or why it fails."""
        try:
            text = self._render(_clean(PROBE_MESSAGES), False, [PROBE_TOOL])
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            return f"a tool-calling conversation (it fails: {type(exc).__name__}: {str(exc)[:200]})"
        missing = [what for what, marker in PROBE_MARKERS if marker not in text]
        return " or ".join(missing) if missing else None

    def tool_refusal(self, messages: list[dict], tools: list | None) -> str | None:
        """Why a sample with tools, calls or tool results cannot be trained with this template, or None."""
        if self.tools_missing is None:
            return None
        if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            return (f"the chat template does not render {self.tools_missing}: the sample would train without "
                    "them (a target whose template takes tools= and tool_calls, e.g. Qwen3, trains it)")
        return None

    def spans(self, messages: list[dict], text: str | None = None,
              tools: list | None = None) -> tuple[str, list[tuple[int, int]], bool]:
        """(rendered text, supervised char spans, closing found for every turn)."""
        messages = _clean(messages)
        text = self._render(messages, False, tools) if text is None else text
        spans, closing_ok = [], True
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self._render(messages[:i], True, tools)
            start = _common_prefix_len(prompt, text)
            content = m.get("content") or ""
            calls = bool(m.get("tool_calls"))
            if calls and start < len(prompt):
                # thinking off: the generation prompt ends with an empty think block that a rendered earlier
                # turn lacks (Qwen3 writes it for the last turn only): the output starts after the header the
                # two thinking modes share, not partway into `<think>` where '<' of '<tool_call>' matched
                other = self._render(messages[:i], True, tools,
                                     enable_thinking=not self.template_kwargs["enable_thinking"])
                start = min(start, _common_prefix_len(other, text))
            cut = text.find(self.closing, start) if self.closing and (content or calls) else -1
            if cut >= 0 and (calls or text.endswith(content, start, cut)):
                # the content sits verbatim right before the turn's closing text (or the turn's calls follow
                # it): that is where the altered rendering below would find its end, without rendering again
                # (the closing text is a control token, which message text, calls and tools may not contain,
                # so its first occurrence ends this turn)
                spans.append((start, cut + len(self.closing)))
                continue
            altered = list(messages)
            altered[i] = {**m, "content": (m.get("content") or "") + SENTINEL}
            alt = self._render(altered, False, tools)
            if alt == text:  # the template does not render this turn's content
                spans.append((start, start))
                continue
            end = len(text) - _common_suffix_len(text, alt)
            if self.closing and text.startswith(self.closing, end):
                end += len(self.closing)
            else:
                closing_ok = False
            spans.append((start, max(start, end)))
        return text, spans, closing_ok

    def encode(self, conversations: list[list[dict]], tools: list | None = None) -> list[MaskedSample]:
        """Masked samples; `tools`: per conversation its tool schemas (a list) or None."""
        tools = tools or [None] * len(conversations)
        rendered = [self.spans(messages, tools=t) for messages, t in zip(conversations, tools)]
        encodings = self.backend.encode_batch([r[0] for r in rendered], add_special_tokens=False)
        out = []
        for (text, spans, closing_ok), enc in zip(rendered, encodings):
            ids = enc.ids
            mask = [0] * len(ids)
            turn_tokens = []
            for s, e in spans:
                k0, k1 = _token_range(enc, s, e)
                mask[k0:k1] = [1] * (k1 - k0)
                turn_tokens.append(k1 - k0)
            truncated = self.max_length is not None and len(ids) > self.max_length
            if truncated:
                ids, mask = ids[: self.max_length], mask[: self.max_length]
            out.append(MaskedSample(ids, mask, text, spans, turn_tokens, truncated, closing_ok))
        return out


def _token_range(enc, start: int, end: int) -> tuple[int, int]:
    """Tokens whose first character lies in [start, end), as a half-open index range."""
    if end <= start:
        return 0, 0
    k0 = enc.char_to_token(start)
    if k0 is None:  # start falls on a character no token covers: take the next token that starts after it
        k0 = next((k for k, (a, _) in enumerate(enc.offsets) if a >= start), len(enc.ids))
    elif enc.token_to_chars(k0)[0] < start:
        k0 += 1
    k1 = enc.char_to_token(end - 1)
    if k1 is None:
        k1 = next((k for k in range(len(enc.ids) - 1, -1, -1) if enc.offsets[k][0] < end), -1)
    return k0, max(k0, k1 + 1)


def _clean(messages: list[dict]) -> list[dict]:
    """Drop None-valued keys so templates test `reasoning_content is defined` the way HF callers do; tool calls
    as lists of dicts (stored as JSON text)."""
    return [message_for_template(m) for m in messages]
