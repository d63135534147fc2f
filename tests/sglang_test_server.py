"""A stand-in for SGLang 0.5.23's HTTP server: the parts the pipeline uses, over real HTTP, shaped as 0.5.23 answers.

Checked against the sglang==0.5.23 wheel (`srt/entrypoints/http_server.py`, `openai/serving_chat.py`,
`managers/tokenizer_manager.py`):
- `GET /health`: 503 while the server is starting (warm-up), then 200.
- `GET /model_info` (and its deprecated alias `/get_model_info`): `model_path`, `served_model_name`,
  `tokenizer_path`, `weight_version`, ... ; `GET /v1/models`: `data[0].id`, `max_model_len`.
- `POST /generate` (`input_ids` or `text`, `sampling_params` with `max_new_tokens` (default 128),
  `sampling_seed`): `text`, `output_ids` (the generated ids through the stop token), `meta_info` with
  `prompt_tokens`, `completion_tokens`, `finish_reason` `{"type": "stop", "matched": id}` /
  `{"type": "length", "length": n}` / `{"type": "abort", "message", "status_code": null, "err_type": null}`
  (HTTP 200); `prompt_token_ids` when `return_prompt_token_ids`. Errors: `{"error": {"message": ...}}`.
- `POST /v1/chat/completions` (OpenAI-style; with `--reasoning-parser` the thinking comes separately in
  `message.reasoning_content`; `seed`; with `return_token_ids`: `choices[0].prompt_token_ids` and
  `response_token_ids`). Errors: `{"object": "error", "message", "type": "BadRequestError", "param", "code"}`.
- `--api-key K`: every path but `/health` needs `Authorization: Bearer K`, else 401 `{"error": "Unauthorized"}`.
- Tool calls (0.5.23 `protocol.ToolCall`, `serving_chat._process_tool_calls`, `function_call/qwen25_detector.py`):
  a request's assistant `tool_calls` arguments given as JSON text are parsed for the template (not JSON: 400
  with SGLang's wording); `tools` go to the template. The model "decides" deterministically: when the request
  has tools and its last message is a user turn that names one of them, the answer is that call in Qwen's
  layout (`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, thinking first when on; the ids are
  the words' (instant) or the tokenizer's (model engine)). With `--tool-call-parser qwen`/`qwen25` the call
  text is parsed as 0.5.23's Qwen25Detector does: content = the text before the first `<tool_call>\n`,
  stripped; each block's JSON to a call `{"id": "call_<24 hex>", "index", "type": "function", "function":
  {"name", "arguments": "<JSON text>"}}` (calls to tools not in the request, and blocks that are not JSON, are
  dropped); `finish_reason` "tool_calls", `matched_stop` null. Other parser names are accepted (the flag
  list) but parse nothing here; without a parser the call stays in `content`, as in SGLang.
- Context: input >= context length, or input + max_new_tokens > context length, is HTTP 400 with SGLang's
  exact wording. The context length is `--context-length`, else the model's `max_position_embeddings`.

Flags are parsed strictly with SGLang 0.5.23's real flag list (`dflash_pipeline/generation/sglang_flags.json`):
a flag SGLang does not have exits with status 2, as the real launch_server does. Test-only knobs are
environment variables (they cannot look like SGLang flags):
- `DFLASH_TEST_SERVER_ENGINE`: `model` (default; the tiny demo model generates, transformers on CPU) or
  `instant` (answers at once with a text derived from the prompt, `answer:<hash> w0 w1 ...`, thinking
  `thinking about <hash>`, so a test can check every stored answer belongs to its sample; its tokens are
  words, its ids a hash of each word, end id 2). `..._ANSWER_WORDS` (12): words in an instant answer.
- `..._FAULT_RATE` (0), `..._FAULTS` (`500,503,drop,truncate`), `..._FAULT_DELAY` (5 s), `..._FAULT_SEED`:
  a fraction of the POSTs fail with one of `500`/`503`, `drop` (connection closed, no response), `truncate`
  (body cut short), `delay`, `empty` (a 200 answer with empty content, chat), `400` (rejected for another
  reason than length), `abort` (HTTP 200 with finish_reason abort, as SGLang reports an aborted request).
- `..._WITHOUT_MODEL_INFO=1`: `/model_info` answers 404 (an older server: only `/get_model_info`).
- `..._TOOL_ARGUMENTS`: `json` (default, SGLang's shape), `string` (the model wrote the arguments as a JSON
  string: SGLang passes it on as JSON text of a string), `text` (arguments that are not JSON at all: SGLang
  0.5.23's parsers never return that, other OpenAI-compatible servers pass the model's text through).
- `..._DELAY` (latency of every request), `..._DIE_AFTER` N (`os._exit` on the N-th POST, like a crash),
  `..._STARTUP_DELAY` (seconds of 503 on /health), `..._STATS_FILE` (request counts, seeds and budgets as JSON).
- Rate control (instant engine): `..._TOKENS_PER_S` simulates decoding: the server produces that many output
  tokens per second in all, shared equally by the requests in flight (like one GPU's batch), and an answer
  returns when its tokens are done; `..._ANSWER_WORDS_PER_PROMPT_WORD` k makes an answer `ANSWER_WORDS` + k x
  prompt words long (longer prompts, longer answers).

Run: `python tests/sglang_test_server.py --model-path M --host H --port P [SGLang flags]`; the pipeline's SGLang
launcher starts it through the same code path as the real server.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import re
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from dflash_pipeline.generation import sglang_flags

SGLANG_VERSION = "0.5.23"
END_ID = 2  # the instant engine's end token
ENV = "DFLASH_TEST_SERVER_"


@dataclass
class Knobs:
    """The test-only settings, from DFLASH_TEST_SERVER_* environment variables."""

    engine: str = "model"
    answer_words: int = 12
    delay: float = 0.0
    fault_rate: float = 0.0
    faults: str = "500,503,drop,truncate"
    fault_delay: float = 5.0
    fault_seed: int = 0
    die_after: int = 0
    startup_delay: float = 0.0
    stats_file: str = ""
    tokens_per_s: float = 0.0
    answer_words_per_prompt_word: float = 0.0
    without_model_info: int = 0  # 1: no /model_info (404), as servers before it was added: /get_model_info only
    tool_arguments: str = "json"  # json | string | text (see the module docstring)

    @classmethod
    def from_env(cls) -> "Knobs":
        knobs = cls()
        for name, value in vars(cls()).items():
            raw = os.environ.get(ENV + name.upper())
            if raw not in (None, ""):
                setattr(knobs, name, type(value)(raw))
        if knobs.engine not in ("model", "instant"):
            raise SystemExit(f"{ENV}ENGINE={knobs.engine!r}: model or instant")
        return knobs


def parse_args(argv=None):
    """SGLang's own flags, strictly: an unknown flag is argparse's error and exit status 2."""
    return sglang_flags.parser(prog="sglang_test_server.py").parse_args(argv)


def _h(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=6).hexdigest()


def instant_answer(messages: list[dict], words: int) -> tuple[str, str]:
    """(thinking, answer) as a pure function of the conversation so far."""
    key = _h(json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False))
    answer = " ".join([f"answer:{key}"] + [f"w{i}" for i in range(words - 1)])
    return f"thinking about {key}", answer


def word_ids(text: str) -> list[int]:
    """The instant engine's "token ids": one per word, a pure function of the word."""
    return [3 + int(_h(w), 16) % 50000 for w in text.split()]


# SGLang 0.5.23 function_call/qwen25_detector.py: the markers around one call
TOOL_BOT, TOOL_EOT = "<tool_call>\n", "\n</tool_call>"
QWEN_PARSERS = ("qwen", "qwen25")


def requested_tool(messages: list[dict], tools: list | None) -> dict | None:
    """The tool the stand-in model calls: the first of `tools` that the last message, a user turn, names."""
    if not tools or not messages or messages[-1].get("role") != "user":
        return None
    text = messages[-1].get("content") or ""
    return next((t for t in tools if t["function"]["name"] in text), None)


def call_text(tool: dict, key: str, arguments: str) -> str:
    """The call as a Qwen model writes it; arguments from the tool's parameters, a function of `key`."""
    props = ((tool["function"].get("parameters") or {}).get("properties") or {})
    args = {p: f"{p}-{key}" for p in props}
    raw = json.dumps(f"{key}") if arguments == "string" else json.dumps(args, ensure_ascii=False)
    return f'{TOOL_BOT}{{"name": "{tool["function"]["name"]}", "arguments": {raw}}}{TOOL_EOT}'


def qwen25_parse(text: str, tools: list) -> tuple[str, list | None]:
    """(content, tool_calls) as SGLang 0.5.23's Qwen25Detector.detect_and_parse + parse_base_json +
    serving_chat._process_tool_calls make them (no complete call: the content alone, the call text dropped)."""
    at = text.find(TOOL_BOT)
    if at == -1:
        return text, None
    names = {t["function"]["name"] for t in tools}
    calls = []
    for block in re.findall(re.escape(TOOL_BOT) + "(.*?)" + re.escape(TOOL_EOT), text, re.DOTALL):
        try:
            action = json.loads(block.strip())
        except ValueError:
            continue  # SGLang logs "Failed to parse JSON part" and goes on
        for act in action if isinstance(action, list) else [action]:
            name = act.get("name")
            if not (name and name in names):
                continue  # "Model attempted to call undefined function" (SGLANG_FORWARD_UNKNOWN_TOOLS unset)
            arguments = json.dumps(act.get("parameters") or act.get("arguments", {}), ensure_ascii=False)
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "index": len(calls), "type": "function",
                          "function": {"name": name, "arguments": arguments}})
    return text[:at].strip(), calls or None


def template_tool_calls(messages: list[dict]) -> str | None:
    """SGLang 0.5.23 (serving_chat.normalize_assistant_tool_call_arguments, strict): assistant history
    arguments given as JSON text become objects for the template; the error message when one is not."""
    for m in messages:
        for call in (m.get("tool_calls") or []) if m.get("role") == "assistant" else []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    return "Assistant tool call function.arguments must be valid JSON."
                if not isinstance(fn["arguments"], dict):
                    return "Assistant tool call function.arguments must be a JSON object."
    return None


def input_too_long(n: int, context: int) -> str:
    return f"The input ({n} tokens) is longer than the model's context length ({context} tokens)."


def total_too_long(n: int, max_new: int, context: int) -> str:
    return (f"Requested token count exceeds the model's maximum context length of {context} tokens. You requested a "
            f"total of {n + max_new} tokens: {n} tokens from the input messages and {max_new} tokens for the "
            f"completion. Please reduce the number of tokens in the input messages or the completion to fit "
            f"within the limit.")


def context_error(n: int, max_new: int | None, context: int) -> str | None:
    """SGLang 0.5.23's check (tokenizer_manager._validate_one_request), None when the request fits."""
    if n >= context:
        return input_too_long(n, context)
    if max_new is not None and n + max_new > context:
        return total_too_long(n, max_new, context)
    return None


def generate_error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def openai_error(message: str, status: int = 400, kind: str = "BadRequestError") -> web.Response:
    return web.json_response({"object": "error", "message": message, "type": kind, "param": None, "code": status},
                             status=status)


@dataclass
class Answer:
    """One generated answer, engine-neutral."""

    text: str                 # the raw output text (thinking included), without the end token
    output_ids: list[int]     # through the end token when it stopped
    prompt_ids: list[int]
    finish: str               # stop | length
    budget: int
    extra: dict = field(default_factory=dict)

    def finish_reason(self, end_id: int) -> dict:
        if self.finish == "length":
            return {"type": "length", "length": self.budget}
        return {"type": "stop", "matched": end_id}


class SharedDecoder:
    """Simulated decoding: `rate` output tokens/s in total, shared equally by the requests in flight."""

    TICK_S = 0.005

    def __init__(self, rate: float):
        self.rate = rate
        self.left: dict[asyncio.Future, float] = {}
        self.task: asyncio.Task | None = None

    async def decode(self, tokens: int) -> None:
        if self.rate <= 0 or tokens <= 0:
            return
        done = asyncio.get_running_loop().create_future()
        self.left[done] = float(tokens)
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run())
        try:
            await done
        finally:
            self.left.pop(done, None)  # a request whose client went away stops using its share

    async def _run(self) -> None:
        last = time.monotonic()
        while self.left:
            await asyncio.sleep(self.TICK_S)
            now = time.monotonic()
            budget, last = (now - last) * self.rate, now
            while budget > 1e-9 and self.left:  # equal shares; what a finished request leaves goes to the rest
                step = min(budget / len(self.left), min(self.left.values()))
                budget -= step * len(self.left)
                for fut in list(self.left):
                    self.left[fut] -= step
                    if self.left[fut] <= 1e-9:
                        del self.left[fut]
                        if not fut.done():
                            fut.set_result(None)


class Server:
    def __init__(self, args, knobs: Knobs):
        self.args = args
        self.knobs = knobs
        self.rng = random.Random(knobs.fault_seed)
        self.posts = 0
        self.faults = 0
        self.seeds: list = []
        self.budgets: list = []
        self.started = time.monotonic()
        self.lock = asyncio.Lock()
        self.tokenizer = self.model = None
        self.decoder = SharedDecoder(knobs.tokens_per_s)
        self.end_id = END_ID
        config = self._model_config()
        self.context = int(args.context_length) if args.context_length else int(
            config.get("max_position_embeddings") or 32768)
        self.model_type = config.get("model_type")
        if knobs.engine == "model":
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            torch.set_num_threads(1)
            self.tokenizer = AutoTokenizer.from_pretrained(args.model_path)
            self.model = AutoModelForCausalLM.from_pretrained(args.model_path).eval()
            self.end_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def _model_config(self) -> dict:
        path = Path(self.args.model_path) / "config.json"
        return json.loads(path.read_text()) if path.exists() else {}

    @property
    def served_name(self) -> str:
        return self.args.served_model_name or self.args.model_path

    # -- faults ----------------------------------------------------------------------------------------
    async def fault(self, request, api: str) -> web.StreamResponse | None:
        self.posts += 1
        self._stats()
        if self.knobs.die_after and self.posts >= self.knobs.die_after:
            os._exit(1)
        if self.knobs.delay:
            await asyncio.sleep(self.knobs.delay)
        if self.knobs.fault_rate <= 0 or self.rng.random() >= self.knobs.fault_rate:
            return None
        self.faults += 1
        self._stats()
        kind = self.rng.choice([k.strip() for k in self.knobs.faults.split(",") if k.strip()])
        return await self._inject(kind, request, api)

    async def _inject(self, kind: str, request, api: str) -> web.StreamResponse | None:
        error = generate_error if api == "generate" else openai_error
        if kind in ("500", "503"):
            return error("injected fault", int(kind))
        if kind == "400":
            return error("The model `nonexistent` does not exist.", 400)
        if kind == "drop":
            request.transport.close()
            raise asyncio.CancelledError  # nothing is sent
        if kind == "delay":
            await asyncio.sleep(self.knobs.fault_delay)
            return None
        if kind in ("empty", "abort"):
            return self._fake_answer(kind, api)
        if kind == "truncate":
            body = json.dumps({"id": "x", "choices": [{"message": {"content": "cut"}}]}).encode()
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            resp.content_length = len(body)
            await resp.prepare(request)
            await resp.write(body[: len(body) // 2])
            request.transport.close()
            raise asyncio.CancelledError
        raise ValueError(f"unknown fault kind {kind}")

    def _fake_answer(self, kind: str, api: str) -> web.Response:
        """`empty`: a 200 answer with no content; `abort`: SGLang's answer for a request aborted without an
        error status (finish_reason abort, HTTP 200)."""
        abort = {"type": "abort", "message": "Abort in waiting queue", "status_code": None, "err_type": None}
        if api == "generate":
            reason = abort if kind == "abort" else {"type": "stop", "matched": self.end_id}
            return web.json_response({"text": "", "output_ids": [], "meta_info": {
                "id": "fault", "finish_reason": reason, "prompt_tokens": 1, "completion_tokens": 0}})
        return web.json_response({"id": kind, "object": "chat.completion", "choices": [
            {"index": 0, "finish_reason": "abort" if kind == "abort" else "stop",
             "message": {"role": "assistant", "content": "", "reasoning_content": None}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    def _stats(self) -> None:
        if self.knobs.stats_file:
            tmp = self.knobs.stats_file + ".tmp"
            with open(tmp, "w") as fh:
                json.dump({"posts": self.posts, "faults": self.faults, "pid": os.getpid(), "seeds": self.seeds,
                           "budgets": self.budgets}, fh)
            os.replace(tmp, self.knobs.stats_file)

    # -- engines ---------------------------------------------------------------------------------------
    async def _answer_instant(self, key_messages: list[dict], prompt_ids: list[int], budget: int,
                              thinking: bool) -> Answer:
        words_wanted = self.knobs.answer_words + round(self.knobs.answer_words_per_prompt_word * len(prompt_ids))
        reasoning, answer = instant_answer(key_messages, words_wanted)
        words = answer.split()
        finish = "length" if len(words) > budget else "stop"
        content = " ".join(words[:budget])
        await self.decoder.decode(min(len(words), budget))
        text = f"<think>\n{reasoning}\n</think>\n\n{content}" if thinking else content
        ids = word_ids(text) + ([END_ID] if finish == "stop" else [])
        return Answer(text, ids, prompt_ids, finish, budget, {"completion_tokens": min(len(words), budget)})

    async def _answer_model(self, prompt_ids: list[int], budget: int, temperature: float, seed) -> Answer:
        import torch

        def go():
            with torch.inference_mode():
                kwargs = dict(max_new_tokens=budget, eos_token_id=self.end_id, pad_token_id=self.end_id)
                if temperature > 0:
                    torch.manual_seed(int(seed if seed is not None else self.args.random_seed or 0))
                    kwargs.update(do_sample=True, temperature=temperature)
                else:
                    kwargs.update(do_sample=False)
                out = self.model.generate(input_ids=torch.tensor([prompt_ids]), **kwargs)
            return out[0, len(prompt_ids):].tolist()

        async with self.lock:
            new = await asyncio.to_thread(go)
        if self.end_id in new:
            new = new[: new.index(self.end_id) + 1]
            text = self.tokenizer.decode(new[:-1], skip_special_tokens=False)
            return Answer(text, new, prompt_ids, "stop", budget, {"completion_tokens": len(new)})
        text = self.tokenizer.decode(new, skip_special_tokens=False)
        return Answer(text, new, prompt_ids, "length", budget, {"completion_tokens": len(new)})

    def _parse(self, text: str, thinking: bool) -> tuple[str | None, str]:
        """(reasoning, content) as the qwen3 reasoning parser splits them; no parser: all content."""
        if not self.args.reasoning_parser:
            return None, text
        if "</think>" in text:
            r, _, c = text.partition("</think>")
            return r.replace("<think>", "").strip("\n"), c.strip()
        if thinking and text.lstrip().startswith("<think>"):
            return text.lstrip()[len("<think>"):], ""
        return None, text.strip()

    # -- handlers --------------------------------------------------------------------------------------
    async def health(self, request):
        if time.monotonic() - self.started < self.knobs.startup_delay:
            return web.Response(status=503)  # ServerStatus.Starting
        return web.Response(status=200)

    async def model_info(self, request):
        return web.json_response({
            "model_path": self.args.model_path, "served_model_name": self.served_name,
            "tokenizer_path": self.args.model_path, "is_generation": True, "preferred_sampling_params": None,
            "weight_version": self.args.weight_version or "default", "load_format": self.args.load_format or "auto",
            "reasoning_parser": self.args.reasoning_parser, "tool_call_parser": self.args.tool_call_parser, "disaggregation_mode": "null",
            "has_image_understanding": False, "has_audio_understanding": False, "model_type": self.model_type,
            "architectures": None})

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{
            "id": self.served_name, "object": "model", "created": int(time.time()), "owned_by": "sglang",
            "root": self.served_name, "parent": None, "max_model_len": self.context}]})

    async def chat(self, request):
        body = await request.json()
        faulted = await self.fault(request, "chat")
        if faulted is not None:
            return faulted
        messages = body["messages"]
        problem = template_tool_calls(messages)
        if problem:
            return openai_error(problem, kind="BadRequest")
        tools = body.get("tools") or None
        budget = body.get("max_completion_tokens") or body.get("max_tokens")
        thinking = bool((body.get("chat_template_kwargs") or {}).get("enable_thinking", True))
        self._record(body.get("seed"), budget)
        if self.knobs.engine == "instant":
            prompt_ids = word_ids(" ".join(m.get("content") or "" for m in messages))
        else:
            prompt = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                        add_generation_prompt=True, enable_thinking=thinking)
            prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        problem = context_error(len(prompt_ids), budget, self.context)
        if problem:
            return openai_error(problem)
        budget = int(budget or 128)
        tool = requested_tool(messages, tools)
        if tool is not None:
            ans = await self._answer_call(tool, messages, prompt_ids, budget, thinking)
        elif self.knobs.engine == "instant":
            ans = await self._answer_instant(messages, prompt_ids, budget, thinking)
        else:
            ans = await self._answer_model(prompt_ids, budget, float(body.get("temperature", 1.0)), body.get("seed"))
        return web.json_response(self._chat_body(ans, body, thinking, tools))

    async def _answer_call(self, tool: dict, messages: list[dict], prompt_ids: list[int], budget: int,
                           thinking: bool) -> Answer:
        """The scripted call (module docstring), thinking first when on, cut at the budget like any answer."""
        key = _h(json.dumps([[m["role"], m.get("content")] for m in messages], ensure_ascii=False))
        text = call_text(tool, key, self.knobs.tool_arguments)
        text = f"<think>\nthinking about {key}\n</think>\n\n{text}" if thinking else text
        if self.knobs.engine == "instant":
            words = text.split()  # the instant engine's tokens are words
            ids = word_ids(text)
        else:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        finish = "length" if len(ids) > budget else "stop"
        if finish == "length":
            ids = ids[:budget]
            text = " ".join(words[:budget]) if self.knobs.engine == "instant" else self.tokenizer.decode(ids)
        await self.decoder.decode(len(ids))
        ids = ids + ([self.end_id] if finish == "stop" else [])
        return Answer(text, ids, prompt_ids, finish, budget, {"completion_tokens": len(ids)})

    def _tool_calls(self, content: str, body: dict, tools: list | None) -> tuple[str, list | None]:
        """(content, tool_calls) after the tool-call parser (only when it is active for the request)."""
        if not tools or body.get("tool_choice", "auto") == "none" or self.args.tool_call_parser not in QWEN_PARSERS:
            return content, None
        content, calls = qwen25_parse(content, tools)
        if calls and self.knobs.tool_arguments == "text":
            for call in calls:
                call["function"]["arguments"] = "not JSON: " + call["function"]["arguments"]
        return content, calls

    def _chat_body(self, ans: Answer, body: dict, thinking: bool, tools: list | None = None) -> dict:
        reasoning, content = self._parse(ans.text, thinking)
        content, calls = self._tool_calls(content, body, tools)
        finish, matched = ans.finish, self.end_id if ans.finish == "stop" else None
        message = {"role": "assistant", "content": content or "", "reasoning_content": reasoning}
        if calls:  # SGLang leaves the key out when there are no calls
            message["tool_calls"] = calls
            if finish == "stop":
                finish, matched = "tool_calls", None
        choice = {"index": 0, "finish_reason": finish, "matched_stop": matched, "message": message}
        if body.get("return_token_ids"):  # choices[0].prompt_token_ids / response_token_ids
            choice.update(prompt_token_ids=ans.prompt_ids, response_token_ids=ans.output_ids)
        completion = ans.extra["completion_tokens"]
        return {"id": f"chatcmpl-{self.posts}", "object": "chat.completion", "created": int(time.time()),
                "model": self.served_name, "choices": [choice],
                "usage": {"prompt_tokens": len(ans.prompt_ids), "completion_tokens": completion,
                          "total_tokens": len(ans.prompt_ids) + completion}}

    async def generate(self, request):
        body = await request.json()
        faulted = await self.fault(request, "generate")
        if faulted is not None:
            return faulted
        sp = body.get("sampling_params") or {}
        budget = int(sp.get("max_new_tokens", 128))  # SGLang's default budget is 128
        self._record(sp.get("sampling_seed"), budget)
        if body.get("input_ids") is not None:
            prompt_ids = list(body["input_ids"])
        elif self.knobs.engine == "instant":
            prompt_ids = word_ids(body.get("text") or "")
        else:
            prompt_ids = self.tokenizer(body["text"], add_special_tokens=False)["input_ids"]
        problem = context_error(len(prompt_ids), budget, self.context)
        if problem:
            return generate_error(problem)
        if self.knobs.engine == "instant":
            key = [{"role": "user", "content": body.get("text") or " ".join(map(str, prompt_ids))}]
            ans = await self._answer_instant(key, prompt_ids, budget, True)
        else:
            ans = await self._answer_model(prompt_ids, budget, float(sp.get("temperature", 1.0)),
                                           sp.get("sampling_seed"))
        out = {"text": ans.text, "output_ids": ans.output_ids, "meta_info": {
            "id": str(self.posts), "finish_reason": ans.finish_reason(self.end_id), "prompt_tokens": len(prompt_ids),
            "weight_version": self.args.weight_version or "default", "completion_tokens": ans.extra["completion_tokens"],
            "cached_tokens": 0}}
        if body.get("return_prompt_token_ids"):
            out["prompt_token_ids"] = prompt_ids
        return web.json_response(out)

    def _record(self, seed, budget) -> None:
        self.seeds.append(seed)
        self.budgets.append(budget)
        self._stats()


def api_key_middleware(api_key: str):
    """SGLang's --api-key: every path but /health, /ready and /metrics needs `Authorization: Bearer KEY`."""

    @web.middleware
    async def check(request, handler):
        if request.path.startswith(("/health", "/ready", "/metrics")):
            return await handler(request)
        if request.headers.get("Authorization", "") != f"Bearer {api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check


def main(argv=None) -> None:
    args = parse_args(argv)
    knobs = Knobs.from_env()
    server = Server(args, knobs)
    app = web.Application(client_max_size=64 << 20,
                          middlewares=[api_key_middleware(args.api_key)] if args.api_key else [])
    app.router.add_get("/health", server.health)
    app.router.add_get("/health_generate", server.health)
    if not knobs.without_model_info:
        app.router.add_get("/model_info", server.model_info)
    app.router.add_get("/get_model_info", server.model_info)  # deprecated alias in 0.5.23
    app.router.add_get("/v1/models", server.models)
    app.router.add_post("/v1/chat/completions", server.chat)
    app.router.add_post("/generate", server.generate)
    print(f"SGLang {SGLANG_VERSION} stand-in on http://{args.host}:{args.port} (engine {knobs.engine})",
          file=sys.stderr, flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, handle_signals=True)


if __name__ == "__main__":
    main()
