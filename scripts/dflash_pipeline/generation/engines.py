"""Generation engines: `HTTPEngine` (SGLang or OpenAI-compatible servers) and `HFEngine` (transformers in-process).

Both answer `await engine.complete(messages, params, max_new_tokens) -> client.Completion` and cap
`max_new_tokens` to the context left after the prompt (SGLang rejects prompt + max_new_tokens > context with
HTTP 400); a prompt that leaves no room raises `client.ContextFull`. Contract checked against SGLang 0.5.23's
source: `/generate` returns `text`, `output_ids` (through the stop token) and `meta_info.finish_reason` as
`{"type": "stop"|"length"|"abort", ...}`, errors as `{"error": {"message"}}`; `/v1/chat/completions` returns
`choices[0].prompt_token_ids` / `response_token_ids` when asked with `return_token_ids`, errors as
`{"object": "error", "message"}`; `/model_info` (`/get_model_info` is its deprecated alias) names the model and
its `weight_version`; `/v1/models` gives `max_model_len`; `/health` answers 503 until warm-up is done and may
take up to 20 s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass

from dflash_pipeline import target
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.generation.client import (
    Completion, ContextFull, FatalError, PermanentError, RejectedError, TransientError, split_reasoning,
)
from dflash_pipeline.generation.tool_calls import (
    QWEN_CALL_MARK, ToolCallError, parse_tool_calls, qwen_tool_calls, template_messages,
)
from dflash_pipeline.storage import redact_credentials

LOG = logging.getLogger(__name__)
STOP_TEXTS = ("<|im_end|>", "<|endoftext|>")
# SGLang 0.5.23 (tokenizer_manager._validate_one_request) and vLLM wordings of a context overflow
_INPUT_TOO_LONG = re.compile(r"The input \((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)")
_TOTAL_TOO_LONG = re.compile(r"maximum context length of (\d+) tokens\. You requested a total of \d+ tokens: "
                             r"(\d+) tokens from the input")
_VLLM_TOO_LONG = re.compile(r"maximum context length is (\d+) tokens\. However, you requested \d+ tokens "
                            r"\((\d+) in the messages")


class _Overflow(Exception):
    """HTTP 400: prompt + max_new_tokens exceed the context; carries the numbers to ask again within it."""

    def __init__(self, prompt_tokens: int, context: int):
        super().__init__(f"{prompt_tokens} prompt tokens, context {context}")
        self.prompt_tokens, self.context = prompt_tokens, context


def capped_budget(prompt_tokens: int, budget: int, context: int | None) -> int:
    """max_new_tokens within the context left after the prompt; ContextFull when none is left."""
    if context is None:
        return budget
    left = context - prompt_tokens
    if left <= 0:
        raise ContextFull(f"prompt too long: {prompt_tokens} prompt tokens leave no room in the context "
                          f"length {context}")
    return min(budget, left)


# --------------------------------------------------------------------------------------------------------
# response parsing (pure functions)
# --------------------------------------------------------------------------------------------------------
def token_ids(value) -> list[int] | None:
    """A list of token ids from a response, or None (absent); anything else is a malformed response."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise TypeError(f"token ids are not a list of integers: {str(value)[:80]}")
    return value


def finish_of(value) -> tuple[str, str]:
    """(finish_reason, detail): SGLang's native API reports {"type": ..., "message": ...}, OpenAI a string."""
    if isinstance(value, dict):
        return str(value.get("type") or "none"), str(value.get("message") or "")
    return str(value or "none"), ""


def error_message(body: bytes) -> str:
    """The message of an error body: {"error": {"message"}} (/generate), {"error": "..."} (its contract check),
    {"message"} (OpenAI API), {"detail"} (FastAPI), else the text."""
    text = body[:500].decode("utf-8", "replace")
    try:
        data = json.loads(body)
    except ValueError:
        return text
    if not isinstance(data, dict):
        return text
    err = data.get("error")
    message = (err.get("message") if isinstance(err, dict) else err) or data.get("message") or data.get("detail")
    return redact_credentials(str(message or text))[:500]


def classify_rejection(status: int, message: str) -> Exception:
    """The exception of an HTTP 4xx: an overflow to ask again within the context, a prompt that cannot fit, or
    another rejection."""
    total = _TOTAL_TOO_LONG.search(message) or _VLLM_TOO_LONG.search(message)
    if total:
        return _Overflow(int(total.group(2)), int(total.group(1)))
    if _INPUT_TOO_LONG.search(message) or any(w in message.lower() for w in ("context length", "too long")):
        return ContextFull(f"prompt too long: {message}")
    return RejectedError(f"rejected (HTTP {status}): {message}")


# --------------------------------------------------------------------------------------------------------
# HTTP engine: servers load-spread, dead ones taken out and probed back
# --------------------------------------------------------------------------------------------------------
@dataclass
class Endpoint:
    url: str
    capacity: int
    in_flight: int = 0
    alive: bool = True
    down_until: float = 0.0
    down_count: int = 0
    consecutive_failures: int = 0
    completed: int = 0
    failures: int = 0

    @property
    def name(self) -> str:
        """The URL as logged and stored: credentials (user:token@) never leave the process."""
        return redact_credentials(self.url)

    @property
    def load(self) -> float:
        return self.in_flight / self.capacity


class HTTPEngine:
    """Requests spread over servers by load (fewest in flight per slot); a failing server is taken out.

    `api="chat"` posts `/v1/chat/completions` (SGLang separates `reasoning_content` with its reasoning parser);
    `api="generate"` posts SGLang's native `/generate` with `input_ids` from `render(messages, enable_thinking)`
    (the target's chat template and tokenizer, here) and separates the thinking itself.
    """

    def __init__(self, urls: list[str], *, max_in_flight: int = 64, request_timeout_s: float = 3600.0,
                 api: str = "chat", model: str | None = None, render=None, context_length: int | None = None,
                 dead_after: int = 3, revive_after_s: float = 5.0, revive_max_s: float = 120.0,
                 all_down_timeout_s: float = 600.0, connect_timeout_s: float = 10.0, health_timeout_s: float = 30.0,
                 api_key: str | None = None):
        if not urls:
            raise PipelineError("generate: no server URLs")
        if api == "generate" and render is None:
            raise PipelineError("api=generate needs the target's tokenizer to render prompts (--model)")
        self.endpoints = [Endpoint(u.rstrip("/"), max_in_flight) for u in urls]
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.health_timeout_s = health_timeout_s
        self.api = api
        self.model = model
        self.render = render
        self.api_key = api_key  # SGLang --api-key: sent as a bearer token, never logged
        self.context_length = context_length
        self.weight_version: str | None = None
        self.served_model_path: str | None = None  # /model_info's model_path, whatever --model-name says
        self.tool_call_parser: str | None = None
        self.parser_reported = False  # /model_info named the servers' tool_call_parser (None: started without)
        self.dead_after = dead_after
        self.revive_after_s = revive_after_s
        self.revive_max_s = revive_max_s
        self.all_down_timeout_s = all_down_timeout_s
        self._slot_freed: asyncio.Event | None = None
        self._session = None
        self._prober: asyncio.Task | None = None
        self._all_down_since: float | None = None

    @property
    def capacity(self) -> int:
        return sum(e.capacity for e in self.endpoints)

    @property
    def model_name(self) -> str:
        return self.model or "unknown"

    @property
    def identity(self) -> str:
        """What identifies the weights behind the servers: model and the server's weight_version."""
        return f"{self.model_name}@{self.weight_version or 'unversioned'}"

    @property
    def in_flight(self) -> int:
        return sum(e.in_flight for e in self.endpoints)

    @property
    def parses_tool_calls(self) -> bool:
        """The chat API sends `tools` and the server parses the calls; /generate renders prompts here, without."""
        return self.api == "chat"

    def describe(self) -> str:
        alive = sum(e.alive for e in self.endpoints)
        return f"{alive}/{len(self.endpoints)} servers up"

    # -- life cycle ------------------------------------------------------------------------------------
    async def start(self, wait_s: float = 600.0) -> None:
        """Wait (up to `wait_s`) until a server is healthy (SGLang: 503 until warm-up), then read its identity."""
        import aiohttp

        self._slot_freed = asyncio.Event()
        self._session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else None,
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=self.connect_timeout_s),
        )
        deadline = time.monotonic() + wait_s
        while True:
            checks = await asyncio.gather(*(self._healthy(e) for e in self.endpoints))
            if any(checks):
                break
            if time.monotonic() > deadline:
                raise FatalError(f"no server answers /health within {wait_s:.0f} s: "
                                 + ", ".join(e.name for e in self.endpoints))
            await asyncio.sleep(1.0)
        for e, ok in zip(self.endpoints, checks):
            if not ok:
                self._take_out(e, "not healthy at start")
        await self._read_server_info()
        self._prober = asyncio.create_task(self._probe_loop())

    async def close(self) -> None:
        if self._prober:
            self._prober.cancel()
            try:
                await self._prober
            except (asyncio.CancelledError, Exception):
                pass
        if self._session:
            await self._session.close()

    async def _healthy(self, e: Endpoint) -> bool:
        import aiohttp

        try:
            async with self._session.get(e.url + "/health",
                                         timeout=aiohttp.ClientTimeout(total=self.health_timeout_s)) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _get_json(self, e: Endpoint, path: str) -> dict:
        try:
            async with self._session.get(e.url + path) as resp:
                if resp.status == 200:
                    data = await resp.json(content_type=None)
                    return data if isinstance(data, dict) else {}
        except Exception:  # identity is best effort: the config can name the model
            pass
        return {}

    async def _read_server_info(self) -> None:
        """Model, weight_version (/model_info, else /get_model_info) and context length (/v1/models)."""
        for e in (x for x in self.endpoints if x.alive):
            info = await self._get_json(e, "/model_info") or await self._get_json(e, "/get_model_info")
            card = ((await self._get_json(e, "/v1/models")).get("data") or [{}])[0]
            card = card if isinstance(card, dict) else {}
            self.model = self.model or info.get("model_path") or card.get("id")
            self.served_model_path = self.served_model_path or info.get("model_path")
            self.weight_version = self.weight_version or info.get("weight_version")
            if "tool_call_parser" in info:
                self.parser_reported, self.tool_call_parser = True, info["tool_call_parser"]
            if self.context_length is None and isinstance(card.get("max_model_len"), int):
                self.context_length = card["max_model_len"]
            if self.model:
                break
        LOG.info("servers: model %s, weight_version %s, context length %s", self.model_name, self.weight_version,
                 self.context_length or "unknown (the servers' 400s cap the budget)")

    def _take_out(self, e: Endpoint, why: str) -> None:
        if e.alive:
            e.alive = False
            e.down_count += 1
            LOG.warning("server %s taken out (%s); probing it again later", e.name, why)
        e.down_until = time.monotonic() + min(self.revive_max_s, self.revive_after_s * 2 ** (e.down_count - 1))

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.revive_after_s / 2))
            now = time.monotonic()
            for e in self.endpoints:
                if not e.alive and now >= e.down_until:
                    if await self._healthy(e):
                        e.alive = True
                        e.consecutive_failures = 0
                        LOG.warning("server %s is back", e.name)
                        self._slot_freed.set()
                    else:
                        self._take_out(e, "still down")

    # -- slots -----------------------------------------------------------------------------------------
    def _pick(self) -> Endpoint | None:
        best = None
        for e in self.endpoints:
            if e.alive and e.in_flight < e.capacity and (best is None or e.load < best.load):
                best = e
        return best

    async def _acquire(self) -> Endpoint:
        # single-threaded event loop: check-and-take needs no lock; only waiting does
        while True:
            e = self._pick()
            if e is not None:
                self._all_down_since = None
                e.in_flight += 1
                return e
            if not any(x.alive for x in self.endpoints):
                now = time.monotonic()
                self._all_down_since = self._all_down_since or now
                if now - self._all_down_since > self.all_down_timeout_s:
                    raise FatalError(f"every server has been down for {self.all_down_timeout_s:.0f} s: "
                                     + ", ".join(x.name for x in self.endpoints))
            self._slot_freed.clear()
            try:
                await asyncio.wait_for(self._slot_freed.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass

    def _release(self, e: Endpoint) -> None:
        e.in_flight -= 1
        self._slot_freed.set()

    def _failed(self, e: Endpoint, why: str) -> None:
        e.failures += 1
        e.consecutive_failures += 1
        if e.consecutive_failures >= self.dead_after:
            self._take_out(e, f"{e.consecutive_failures} failures in a row ({why})")

    # -- requests --------------------------------------------------------------------------------------
    async def complete(self, messages: list[dict], params, max_new_tokens: int, tools: list | None = None
                       ) -> Completion:
        if tools and self.parser_reported and not self.tool_call_parser:
            raise PermanentError("the servers run without --tool-call-parser, so the target's calls would stay "
                                 "unparsed text: set generate.sglang.tool_call_parser (e.g. qwen25)")
        e = await self._acquire()
        try:
            result = await self._complete_on(e, messages, params, max_new_tokens, tools)
        finally:
            self._release(e)
        e.completed += 1
        result.server = e.name
        return result

    async def _complete_on(self, e: Endpoint, messages, params, max_new_tokens: int, tools=None) -> Completion:
        import aiohttp

        try:
            try:
                return await self._post_api(e, messages, params, max_new_tokens, tools)
            except _Overflow as over:  # the server's numbers: ask once more within the context
                self.context_length = self.context_length or over.context
                return await self._post_api(e, messages, params,
                                            capped_budget(over.prompt_tokens, max_new_tokens, over.context), tools)
        except _Overflow as over:
            raise ContextFull(f"prompt too long: {over}") from None
        except (aiohttp.ClientConnectorError, ConnectionRefusedError) as exc:
            e.failures += 1
            self._take_out(e, f"cannot connect: {type(exc).__name__}")
            raise TransientError(f"{e.name}: cannot connect") from None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, TypeError) as exc:
            # dropped connection, truncated or invalid body, timeout
            self._failed(e, type(exc).__name__)
            raise TransientError(f"{e.name}: {type(exc).__name__}: {redact_credentials(str(exc))[:200]}") from None
        except TransientError:
            self._failed(e, "server error")
            raise
        except PermanentError:
            e.consecutive_failures = 0  # the server answered: it is healthy
            raise

    async def _post_api(self, e, messages, params, max_new_tokens, tools=None) -> Completion:
        if self.api == "generate":
            return await self._post_generate(e, messages, params, max_new_tokens)
        return await self._post_chat(e, messages, params, max_new_tokens, tools)

    async def _post(self, e: Endpoint, path: str, payload: dict) -> dict:
        async with self._session.post(e.url + path, json=payload) as resp:
            body = await resp.read()
        if resp.status >= 500 or resp.status in (408, 429):
            raise TransientError(f"{e.name}: HTTP {resp.status}: {error_message(body)[:200]}")
        if resp.status >= 400:
            raise classify_rejection(resp.status, error_message(body))
        e.consecutive_failures = 0
        return json.loads(body)

    async def _post_chat(self, e, messages, params, max_new_tokens, tools=None) -> Completion:
        payload = {"model": self.model or "default", "messages": messages, "max_tokens": max_new_tokens,
                   "temperature": params.temperature, "top_p": params.top_p,
                   "chat_template_kwargs": {"enable_thinking": params.enable_thinking},
                   "separate_reasoning": True, "stream": False,
                   "return_token_ids": True}  # SGLang: choices[0].prompt_token_ids / response_token_ids
        if params.top_k > 0:
            payload["top_k"] = params.top_k
        if params.seed is not None:
            payload["seed"] = params.seed
        if tools:
            payload["tools"] = tools  # tool_choice stays SGLang's default with tools: auto
        data = await self._post(e, "/v1/chat/completions", payload)
        choice = data["choices"][0]
        message = choice["message"]
        content = message.get("content") or ""
        reasoning = message.get("reasoning_content")
        finish, detail = finish_of(choice.get("finish_reason"))
        try:
            calls = parse_tool_calls(message.get("tool_calls"))
        except ToolCallError as exc:
            raise PermanentError(f"tool call not stored: {exc}") from None
        if finish == "tool_calls":  # SGLang 0.5.23 reports a stop that ended in parsed calls so
            finish = "stop"
        usage = data.get("usage") or {}
        if reasoning is None and "</think>" in content:  # a server without a reasoning parser
            content, reasoning = split_reasoning(content, params.enable_thinking)
        return Completion(content=content.strip(), reasoning=reasoning, finish_reason=finish, detail=detail,
                          prompt_tokens=int(usage.get("prompt_tokens") or 0),
                          completion_tokens=int(usage.get("completion_tokens") or 0),
                          output_ids=token_ids(choice.get("response_token_ids")),
                          prompt_ids=token_ids(choice.get("prompt_token_ids")), tool_calls=calls)

    async def _post_generate(self, e, messages, params, max_new_tokens) -> Completion:
        prompt_ids = self.render(messages, params.enable_thinking)
        budget = capped_budget(len(prompt_ids), max_new_tokens, self.context_length)
        sampling = {"max_new_tokens": budget, "temperature": params.temperature, "top_p": params.top_p,
                    "skip_special_tokens": False}
        if params.top_k > 0:
            sampling["top_k"] = params.top_k
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        data = await self._post(e, "/generate", {"input_ids": prompt_ids, "sampling_params": sampling})
        text = data["text"]
        meta = data.get("meta_info") or {}
        for stop in STOP_TEXTS:
            text = text.split(stop, 1)[0]
        content, reasoning = split_reasoning(text, params.enable_thinking)
        finish, detail = finish_of(meta.get("finish_reason"))
        return Completion(content=content, reasoning=reasoning, finish_reason=finish, detail=detail,
                          prompt_tokens=int(meta.get("prompt_tokens") or len(prompt_ids)),
                          completion_tokens=int(meta.get("completion_tokens") or 0),
                          output_ids=token_ids(data.get("output_ids")), prompt_ids=list(prompt_ids))


def with_tool_calls(result: Completion, tools: list | None) -> Completion:
    """An in-process answer with its Qwen-style calls parsed (only when the request had tools, as SGLang)."""
    if not tools:
        return result
    try:
        result.content, result.tool_calls = qwen_tool_calls(result.content)
    except ToolCallError as exc:
        raise PermanentError(f"tool call not stored: {exc}") from None
    return result


def chat_renderer(model_dir: str, trust_remote_code: bool = False):
    """render(messages, enable_thinking) -> the prompt's token ids, with the target's chat template."""
    tok = target.load_tokenizer(model_dir, trust_remote_code=trust_remote_code)

    def render(messages, enable_thinking):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=enable_thinking)
        return tok(text, add_special_tokens=False)["input_ids"]

    return render


# --------------------------------------------------------------------------------------------------------
# hf: in-process transformers, batched
# --------------------------------------------------------------------------------------------------------
_MASK64 = (1 << 64) - 1
_SPLITMIX = [c - (1 << 64) if c >= 1 << 63 else c for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                                              0x94D049BB133111EB)]  # as int64


def _shift_right(x, bits: int):
    """Logical right shift of int64 lanes (torch shifts signed values arithmetically)."""
    import torch

    return torch.bitwise_and(torch.bitwise_right_shift(x, bits), (1 << (64 - bits)) - 1)


def counter_uniform(seeds, step: int, vocab: int):
    """Uniforms in (0, 1), [rows, vocab] float64, from splitmix64 of (row seed, step, token id): a pure function
    of its counters, computed on the seeds' device in a few elementwise kernels, whatever the batch around it
    (int64 products wrap, as splitmix64's unsigned ones do)."""
    import torch

    golden, mix1, mix2 = _SPLITMIX
    offset = ((step + 1) * mix2) & _MASK64
    offset -= (1 << 64) if offset >= 1 << 63 else 0
    token = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = (seeds.view(-1, 1) * golden + offset) ^ (token.view(1, -1) * golden)
    x = (x ^ _shift_right(x, 30)) * mix1
    x = (x ^ _shift_right(x, 27)) * mix2
    x = x ^ _shift_right(x, 31)
    return (_shift_right(x, 11).double() + 0.5) * 2.0 ** -53


class RowSeededSampling:
    """Sampling for `generate(do_sample=False)` with one random stream per row: temperature, top-k and top-p
    warp the logits, then Gumbel noise from the row's own counter-based stream (seed, step, token) makes the
    greedy pick an exact sample (Gumbel-max). A sample's tokens depend on its seed only, not on the batch it
    happened to be in; the noise is drawn where the logits are (a wide GPU batch draws it in a few kernels, not
    rows x vocab CPU draws a step)."""

    def __init__(self, seeds: list[int], temperature: float, top_k: int, top_p: float, prompt_width: int):
        import torch
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.warpers = [TemperatureLogitsWarper(temperature)]
        if top_k > 0:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))
        self.seeds = torch.tensor([int(s) & ((1 << 63) - 1) for s in seeds], dtype=torch.int64)
        self.prompt_width = prompt_width  # the step is the count of tokens generated so far

    def __call__(self, input_ids, scores):
        import torch

        for warp in self.warpers:
            scores = warp(input_ids, scores)
        logp = torch.log_softmax(scores.float(), dim=-1)
        self.seeds = self.seeds.to(scores.device)
        u = counter_uniform(self.seeds, int(input_ids.shape[1]) - self.prompt_width, scores.shape[-1])
        gumbel = -torch.log(-torch.log(u))
        return logp + gumbel.to(logp.dtype)


def length_sorted_batches(items: list, max_tokens: int | None) -> list[list]:
    """Requests (prompt ids first) sorted by prompt length and cut so that rows x (longest prompt + budget) stays
    within `max_tokens` (the KV cache and the prefill's padding); None: one batch."""
    items = sorted(items, key=lambda it: len(it[0]))
    if not max_tokens:
        return [items] if items else []
    batches, current = [], []
    for it in items:
        if current and (len(current) + 1) * (len(it[0]) + max(it[1], max(c[1] for c in current))) > max_tokens:
            batches.append(current)
            current = []
        current.append(it)
    return batches + ([current] if current else [])


class HFEngine:
    """transformers in-process: concurrent requests from the client's workers are batched into `generate`
    calls run in a thread, so the CPU demo uses exactly the client code that drives SGLang servers.

    A small target's decode step costs about the same for 80 rows as for 500 on a GPU (kernel launches, not
    arithmetic), so the rate grows with the batch: requests waiting together are sorted by prompt length and
    cut into batches of at most `max_batch_tokens` (rows x (longest prompt + budget), the KV cache) so that a
    wide batch pads little. Each batch runs to its longest budget; rows with a smaller one are cut to theirs
    (causal: the tokens up to a row's budget do not depend on what follows)."""

    def __init__(self, model_path: str, *, batch_size: int = 32, device: str = "cpu", dtype: str = "auto",
                 context_length: int | None = None, trust_remote_code: bool = False, max_wait_s: float = 0.02,
                 threads: int | None = None, max_batch_tokens: int | None = None, cache: str = "dynamic"):
        if cache not in ("dynamic", "static"):
            raise PipelineError(f"hf backend: cache must be dynamic or static, not {cache!r}")
        self.model_path = str(model_path)
        self.batch_size = batch_size
        self.max_batch_tokens = max_batch_tokens
        self.cache = cache  # static: transformers' static KV cache (its generate compiles the decode step on a GPU)
        self.generated_tokens = 0
        self.generate_seconds = 0.0
        self.device = device
        self.dtype = dtype
        self.context_length = context_length
        self.trust_remote_code = trust_remote_code
        self.max_wait_s = max_wait_s
        self.threads = threads
        self.model = None
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self._in_flight = 0

    @property
    def capacity(self) -> int:
        return 2 * self.batch_size  # one batch running, the next one filling

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def identity(self) -> str:
        return f"{self.model_path}@{target.fingerprint(self.model_path)}"

    def describe(self) -> str:
        return f"hf in-process on {self.device}"

    async def start(self, wait_s: float = 0) -> None:
        await asyncio.to_thread(self._load)
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._batch_loop())

    def _load(self) -> None:
        import torch

        if self.threads:
            # small models on a shared CPU: one intra-op thread avoids OpenMP spin contention (30x here)
            torch.set_num_threads(self.threads)
        self.tokenizer = target.load_tokenizer(self.model_path, trust_remote_code=self.trust_remote_code)
        self.model = target.load_model(self.model_path, self.device, self.dtype,
                                       trust_remote_code=self.trust_remote_code)
        if self.context_length is None:
            config = target.text_config(self.model.config)
            self.context_length = int(getattr(config, "max_position_embeddings", None) or 1 << 30)
        self.eos_ids = {i for i in [self.tokenizer.eos_token_id,
                                    self.tokenizer.convert_tokens_to_ids("<|im_end|>")] if isinstance(i, int)}
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.model_name = self.model_path

    async def close(self) -> None:
        if self._task and not self._task.done():
            self._queue.put_nowait(None)  # the batch loop ends at the sentinel
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 30)
            except (asyncio.TimeoutError, Exception):
                self._task.cancel()

    @property
    def parses_tool_calls(self) -> bool:
        """Tools are rendered and calls parsed here only in the one layout this engine reads, Qwen's
        `<tool_call>` JSON blocks (Qwen2.5/Qwen3 templates); a target whose template has none is refused."""
        template = getattr(self.tokenizer, "chat_template", None) if self.model is not None else None
        return isinstance(template, str) and QWEN_CALL_MARK in template

    def render(self, messages: list[dict], enable_thinking: bool, tools: list | None = None) -> list[int]:
        text = self.tokenizer.apply_chat_template(template_messages(messages), tools=tools or None, tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=enable_thinking)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def complete(self, messages, params, max_new_tokens: int, tools: list | None = None) -> Completion:
        ids = self.render(messages, params.enable_thinking, tools)
        budget = capped_budget(len(ids), max_new_tokens, self.context_length)
        future = asyncio.get_running_loop().create_future()
        self._in_flight += 1
        try:
            await self._queue.put((ids, budget, params, future))
            return with_tool_calls(await future, tools)
        finally:
            self._in_flight -= 1

    async def _next_batch(self) -> tuple[list, bool]:
        """Requests that arrive together (up to batch_size); True when the sentinel came (stop after)."""
        first = await self._queue.get()
        if first is None:
            return [], True
        batch = [first]
        await asyncio.sleep(self.max_wait_s)  # let concurrent requests join the batch
        while len(batch) < self.batch_size and not self._queue.empty():
            item = self._queue.get_nowait()
            if item is None:
                return batch, True
            batch.append(item)
        return batch, False

    async def _batch_loop(self) -> None:
        stop = False
        while not stop:
            batch, stop = await self._next_batch()
            groups: dict = {}  # one generate call per sampling group (and length-sorted batch); seeds may differ
            for item in batch:
                key = (item[2].temperature, item[2].top_p, item[2].top_k, item[2].enable_thinking)
                groups.setdefault(key, []).append(item)
            for items in groups.values():
                for part in length_sorted_batches([it for it in items if not it[3].done()], self.max_batch_tokens):
                    await self._run_group(part)

    async def _run_group(self, live: list) -> None:
        try:
            results = await asyncio.to_thread(self._generate, [it[0] for it in live], [it[1] for it in live],
                                              [it[2] for it in live])
        except Exception as exc:  # a model failure fails these requests, not the loop
            for it in live:
                if not it[3].done():
                    it[3].set_exception(exc)
            return
        for it, res in zip(live, results):
            if not it[3].done():
                it[3].set_result(res)

    def _generate(self, prompts: list[list[int]], budgets: list[int], params: list) -> list[Completion]:
        import torch

        started = time.perf_counter()
        budget = max(budgets)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding
            input_ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        first = params[0]
        kwargs = dict(max_new_tokens=budget, pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids),
                      do_sample=False, temperature=None, top_p=None, top_k=None)
        if self.cache == "static":
            kwargs["cache_implementation"] = "static"
        if first.temperature > 0:
            kwargs["logits_processor"] = [RowSeededSampling([p.seed or 0 for p in params], first.temperature,
                                                            first.top_k, first.top_p, width)]
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                                      **kwargs)
        results = [self._completion(tokens[:row_budget], prompt, first.enable_thinking)
                   for tokens, prompt, row_budget in zip(out[:, width:].tolist(), prompts, budgets)]
        seconds = time.perf_counter() - started
        new = sum(r.completion_tokens for r in results)
        self.generated_tokens += new
        self.generate_seconds += seconds
        LOG.info("hf generate: %d rows, prompts <= %d tokens, %d steps, %d new tokens in %.1f s (%.0f tok/s)",
                 len(prompts), width, out.shape[1] - width, new, seconds, new / max(seconds, 1e-9))
        return results

    def _completion(self, tokens: list[int], prompt: list[int], enable_thinking: bool) -> Completion:
        finish = "length"
        for k, t in enumerate(tokens):
            if t in self.eos_ids:
                tokens, finish = tokens[:k + 1], "stop"  # the end token is part of what was generated
                break
        text = self.tokenizer.decode(tokens[:-1] if finish == "stop" else tokens, skip_special_tokens=False)
        content, reasoning = split_reasoning(text, enable_thinking)
        return Completion(content=content, reasoning=reasoning, finish_reason=finish, prompt_tokens=len(prompt),
                          completion_tokens=len(tokens), server="hf", output_ids=tokens, prompt_ids=list(prompt))
