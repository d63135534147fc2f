"""The generation client: turns one sample into a regenerated conversation, against any engine.

An *engine* answers one chat request: `await engine.complete(messages, params, max_new_tokens) -> Completion`.
`HTTPEngine` talks to SGLang (or any OpenAI-compatible) servers over HTTP and spreads requests over them by
load; `generation_backends.HFEngine` runs transformers in-process. Everything above the engine (turn plan,
retries with backoff and jitter, the finish_reason=length policy, empty answers, permanent failures) is
shared, so the CPU demo exercises the same code as a GPU cluster.

Errors: `TransientError` (timeouts, 5xx, 429, dropped connections, truncated bodies) is retried with
exponential backoff and jitter up to `max_retries`; `PermanentError` (4xx such as a prompt longer than the
context) is recorded with its reason at once; `FatalError` (every server down for too long) stops the run,
leaving the journal to resume from.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field

import pyarrow as pa

from dflash_pipeline.data.conversations import SAMPLE_SCHEMA
from dflash_pipeline.errors import PipelineError

LOG = logging.getLogger(__name__)

COMPLETION_SCHEMA = pa.schema(
    list(SAMPLE_SCHEMA)
    + [
        ("status", pa.string()),             # ok | failed
        ("failure_reason", pa.string()),     # null when ok
        ("finish_reason", pa.string()),      # of the last generated turn: stop | length | null (failed early)
        ("model", pa.string()),
        ("sampling_params", pa.string()),    # JSON
        ("prompt_tokens", pa.int64()),       # summed over generated turns
        ("completion_tokens", pa.int64()),
        ("generated_turns", pa.int32()),
        ("attempts", pa.int32()),            # requests sent for this sample, retries included
        # The target's own token ids, per generated assistant turn in order: thinking + content + the end
        # token, exactly as sampled (null when the engine reports none: an OpenAI server without token ids).
        ("output_ids", pa.list_(pa.list_(pa.int32()))),
        # The prompt ids of the last generated turn: prompt_ids + output_ids[-1] is the exact token stream.
        ("prompt_ids", pa.list_(pa.int32())),
    ]
)


class TransientError(Exception):
    """Worth retrying: the request may succeed later (timeouts, 5xx, dropped connections)."""


class PermanentError(Exception):
    """Retrying cannot help (a prompt longer than the context, a rejected request)."""


class RejectedError(PermanentError):
    """The server refused the request for another reason than its length (HTTP 4xx): recorded, not retried in
    this run, but retried by a rerun (the cause is often the configuration, e.g. a wrong model name)."""


class FatalError(PipelineError):
    """The run cannot continue (e.g. every server has been down for too long)."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 2048
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    enable_thinking: bool = True
    seed: int | None = None

    def to_json(self, **extra) -> str:
        return json.dumps({**asdict(self), **extra}, sort_keys=True)


@dataclass
class Completion:
    content: str
    reasoning: str | None
    finish_reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    server: str = ""
    output_ids: list[int] | None = None  # as generated, the end token included
    prompt_ids: list[int] | None = None


@dataclass(frozen=True)
class Policy:
    """What the client does around each request (config `generate:`)."""

    turns: str = "first"                     # first | all
    on_length: str = "keep"                  # keep | drop | retry
    length_retry_max_new_tokens: int = 0     # budget of the one retry when on_length == retry
    max_retries: int = 8
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    empty_retries: int = 1

    def backoff(self, attempt: int) -> float:
        """Exponential backoff with full jitter in [0.5, 1.5) x the step."""
        step = min(self.backoff_max_s, self.backoff_base_s * (2 ** (attempt - 1)))
        return step * (0.5 + random.random())


@dataclass
class Counters:
    ok: int = 0
    failed: int = 0
    failed_permanent: int = 0
    length: int = 0
    empty: int = 0
    retries: int = 0
    rejected: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    failure_reasons: dict = field(default_factory=dict)

    def add_failure(self, reason: str) -> None:
        key = reason.split(":")[0][:80]
        self.failure_reasons[key] = self.failure_reasons.get(key, 0) + 1


def split_reasoning(text: str, enable_thinking: bool) -> tuple[str, str | None]:
    """(answer, thinking) of a raw model output, as SGLang's qwen3 reasoning parser separates them."""
    if "</think>" in text:
        reasoning, _, content = text.partition("</think>")
        reasoning = reasoning.split("<think>", 1)[-1]
        return content.strip(), reasoning.strip("\n")
    stripped = text.lstrip()
    if enable_thinking and stripped.startswith("<think>"):
        return "", stripped[len("<think>"):].strip("\n")  # thinking never finished
    return text.strip(), None


def chat_messages(messages: list[dict]) -> list[dict]:
    """Messages as the chat API wants them (earlier thinking is not sent back)."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


# --------------------------------------------------------------------------------------------------------
# one sample
# --------------------------------------------------------------------------------------------------------
async def complete_with_policy(engine, messages, params: SamplingParams, policy: Policy, counters: Counters,
                               tally: list) -> Completion:
    """One assistant turn, with retries, the length policy and the empty-answer check.

    Raises PermanentError (not worth retrying later: too long, length dropped, empty) or TransientError
    (retries exhausted: a rerun tries again).
    """
    budget = params.max_new_tokens
    attempt = 0
    length_retried = False
    empty_seen = 0
    while True:
        tally[0] += 1
        counters.requests += 1
        try:
            result = await engine.complete(messages, params, budget)
        except PermanentError:
            raise
        except TransientError as exc:
            attempt += 1
            if attempt > policy.max_retries:
                raise TransientError(f"gave up after {attempt} attempts: {exc}") from None
            counters.retries += 1
            await asyncio.sleep(policy.backoff(attempt))
            continue
        if result.finish_reason == "length":
            counters.length += 1
            if policy.on_length == "retry" and not length_retried and policy.length_retry_max_new_tokens > budget:
                length_retried = True
                budget = policy.length_retry_max_new_tokens
                counters.retries += 1
                continue
            if policy.on_length in ("drop", "retry"):
                raise PermanentError(f"finish_reason=length: answer cut at {budget} new tokens")
        if not result.content.strip():
            counters.empty += 1
            empty_seen += 1
            if empty_seen <= policy.empty_retries:
                counters.retries += 1
                continue
            raise PermanentError(f"empty response (finish_reason={result.finish_reason}, "
                                 f"{result.completion_tokens} tokens)")
        return result


def turn_plan(messages: list[dict], turns: str):
    """Yield (prefix_index, replaces) for every assistant turn to generate; see `generate_sample`."""
    seen_user = False
    for i, m in enumerate(messages):
        if m["role"] == "user":
            seen_user = True
        elif m["role"] == "assistant" and seen_user:
            yield i
            if turns == "first":
                return
            seen_user = False
    if messages and messages[-1]["role"] == "user":
        yield len(messages)


async def generate_sample(engine, sample: dict, params: SamplingParams, policy: Policy, counters: Counters,
                          model: str, sampling_json: str) -> dict:
    """The completion row of one sample (status ok, or failed with a reason; `permanent` for the journal)."""
    original = sample["messages"]
    out: list[dict] = []
    cursor = 0
    tally = [0]
    prompt_tokens = completion_tokens = generated = 0
    finish = None
    turn_ids: list[list[int] | None] = []
    prompt_ids = None
    status, reason, permanent = "ok", None, True
    try:
        for pos in turn_plan(original, policy.turns):
            # user/system turns; an original assistant turn survives only before the first user turn
            out.extend(m for m in original[cursor:pos] if m["role"] != "assistant" or generated == 0)
            cursor = pos + 1
            result = await complete_with_policy(engine, chat_messages(out), params, policy, counters, tally)
            out.append({"role": "assistant", "content": result.content, "reasoning_content": result.reasoning})
            prompt_tokens += result.prompt_tokens
            completion_tokens += result.completion_tokens
            finish = result.finish_reason
            turn_ids.append(result.output_ids)
            prompt_ids = result.prompt_ids
            generated += 1
        if policy.turns == "all":
            out.extend(m for m in original[cursor:] if m["role"] != "assistant")
        if generated == 0:
            raise PermanentError("no user turn to answer")
    except PermanentError as exc:
        status, reason = "failed", f"{exc}" if generated == 0 else f"turn {generated + 1}: {exc}"
        if isinstance(exc, RejectedError):
            permanent = False
            counters.rejected += 1
    except TransientError as exc:
        status, reason, permanent = "failed", f"{exc}" if generated == 0 else f"turn {generated + 1}: {exc}", False
    if status == "failed":
        # a failed row carries only the prompt: it can never be mistaken for training data
        out = [m for m in original[: next((i for i, m in enumerate(original) if m["role"] == "assistant"),
                                          len(original))]]
        counters.failed += 1
        counters.failed_permanent += int(permanent)
        counters.add_failure(reason)
    else:
        counters.ok += 1
    counters.prompt_tokens += prompt_tokens
    counters.completion_tokens += completion_tokens
    return {
        "sample_id": sample["sample_id"],
        "source": sample["source"],
        "source_id": sample["source_id"],
        "messages": [{"role": m["role"], "content": m["content"], "reasoning_content": m.get("reasoning_content")}
                     for m in out],
        "status": status,
        "failure_reason": reason,
        "finish_reason": finish,
        "model": model,
        "sampling_params": sampling_json,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "generated_turns": generated,
        "attempts": tally[0],
        "output_ids": turn_ids if status == "ok" and all(t is not None for t in turn_ids) else None,
        "prompt_ids": prompt_ids if status == "ok" else None,
        "permanent": permanent,
    }


# --------------------------------------------------------------------------------------------------------
# HTTP engine: SGLang / OpenAI-compatible servers, load-spread, dead servers taken out and probed back
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
    def load(self) -> float:
        return self.in_flight / self.capacity


class HTTPEngine:
    """Requests spread over servers by load (fewest in flight per slot); a failing server is taken out.

    `api="chat"` posts OpenAI-style `/v1/chat/completions` (SGLang separates `reasoning_content` with its
    reasoning parser); `api="generate"` posts SGLang's native `/generate` with a prompt rendered here by
    `render(messages, enable_thinking) -> str` and separates the thinking itself.
    """

    def __init__(self, urls: list[str], *, max_in_flight: int = 64, request_timeout_s: float = 3600.0,
                 api: str = "chat", model: str | None = None, render=None, dead_after: int = 3,
                 revive_after_s: float = 5.0, revive_max_s: float = 120.0, all_down_timeout_s: float = 600.0,
                 connect_timeout_s: float = 10.0):
        if not urls:
            raise PipelineError("generate: no server URLs")
        self.endpoints = [Endpoint(u.rstrip("/"), max_in_flight) for u in urls]
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.api = api
        self.model = model
        self.render = render
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
    def in_flight(self) -> int:
        return sum(e.in_flight for e in self.endpoints)

    def describe(self) -> str:
        alive = sum(e.alive for e in self.endpoints)
        return f"{alive}/{len(self.endpoints)} servers up"

    async def start(self, wait_s: float = 60.0) -> None:
        import aiohttp

        self._slot_freed = asyncio.Event()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=self.connect_timeout_s),
        )
        deadline = time.monotonic() + wait_s
        while True:
            checks = await asyncio.gather(*(self._healthy(e) for e in self.endpoints))
            if any(checks):
                break
            if time.monotonic() > deadline:
                raise FatalError(f"no server answers /health: {', '.join(e.url for e in self.endpoints)}")
            await asyncio.sleep(1.0)
        for e, ok in zip(self.endpoints, checks):
            if not ok:
                self._take_out(e, "not healthy at start")
        if self.model is None:
            self.model = await self._model_name()
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
            async with self._session.get(e.url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _model_name(self) -> str:
        for e in self.endpoints:
            if not e.alive:
                continue
            try:
                async with self._session.get(e.url + "/get_model_info") as resp:
                    if resp.status == 200:
                        info = await resp.json(content_type=None)
                        if info.get("model_path"):
                            return str(info["model_path"])
            except Exception:  # model identity is best effort; the config can name it
                pass
            try:  # OpenAI-compatible servers (vLLM, ...): the served model's id
                async with self._session.get(e.url + "/v1/models") as resp:
                    if resp.status == 200:
                        data = (await resp.json(content_type=None)).get("data") or []
                        if data and data[0].get("id"):
                            return str(data[0]["id"])
            except Exception:
                pass
        return "unknown"

    def _take_out(self, e: Endpoint, why: str) -> None:
        if e.alive:
            e.alive = False
            e.down_count += 1
            LOG.warning("server %s taken out (%s); probing it again later", e.url, why)
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
                        LOG.warning("server %s is back", e.url)
                        self._slot_freed.set()
                    else:
                        self._take_out(e, "still down")

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
                                     + ", ".join(x.url for x in self.endpoints))
            self._slot_freed.clear()
            try:
                await asyncio.wait_for(self._slot_freed.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass

    def _release(self, e: Endpoint) -> None:
        e.in_flight -= 1
        self._slot_freed.set()

    async def complete(self, messages: list[dict], params: SamplingParams, max_new_tokens: int) -> Completion:
        import aiohttp

        e = await self._acquire()
        try:
            try:
                if self.api == "generate":
                    result = await self._post_generate(e, messages, params, max_new_tokens)
                else:
                    result = await self._post_chat(e, messages, params, max_new_tokens)
            except (aiohttp.ClientConnectorError, ConnectionRefusedError) as exc:
                e.failures += 1
                self._take_out(e, f"cannot connect: {type(exc).__name__}")
                raise TransientError(f"{e.url}: cannot connect") from None
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
                # dropped connection, truncated or invalid body, timeout
                e.failures += 1
                e.consecutive_failures += 1
                if e.consecutive_failures >= self.dead_after:
                    self._take_out(e, f"{e.consecutive_failures} failures in a row")
                raise TransientError(f"{e.url}: {type(exc).__name__}: {str(exc)[:200]}") from None
            except TransientError:
                e.failures += 1
                e.consecutive_failures += 1
                if e.consecutive_failures >= self.dead_after:
                    self._take_out(e, f"{e.consecutive_failures} failures in a row")
                raise
            except PermanentError:
                e.consecutive_failures = 0  # the server answered: it is healthy
                raise
            e.consecutive_failures = 0
            e.completed += 1
            result.server = e.url
            return result
        finally:
            self._release(e)

    async def _post(self, e: Endpoint, path: str, payload: dict) -> dict:
        async with self._session.post(e.url + path, json=payload) as resp:
            body = await resp.read()
            if resp.status >= 500 or resp.status in (408, 429):
                raise TransientError(f"{e.url}: HTTP {resp.status}: {body[:200].decode('utf-8', 'replace')}")
            if resp.status >= 400:
                reason = _error_reason(resp.status, body)
                raise (PermanentError if reason.startswith("prompt too long") else RejectedError)(reason)
            return json.loads(body)

    async def _post_chat(self, e, messages, params, max_new_tokens) -> Completion:
        payload = {
            "model": self.model or "default",
            "messages": messages,
            "max_tokens": max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "chat_template_kwargs": {"enable_thinking": params.enable_thinking},
            "separate_reasoning": True,
            "stream": False,
            "return_token_ids": True,  # SGLang: choices[0].prompt_token_ids / response_token_ids
        }
        if params.top_k > 0:
            payload["top_k"] = params.top_k
        if params.seed is not None:
            payload["seed"] = params.seed
        data = await self._post(e, "/v1/chat/completions", payload)
        try:
            choice = data["choices"][0]
            message = choice["message"]
            content = message.get("content") or ""
            reasoning = message.get("reasoning_content")
            finish = choice.get("finish_reason") or "stop"
            usage = data.get("usage") or {}
            output_ids = _ids(choice.get("response_token_ids"))
            prompt_ids = _ids(choice.get("prompt_token_ids"))
        except (KeyError, IndexError, TypeError) as exc:
            raise TransientError(f"{e.url}: malformed response ({exc})") from None
        if reasoning is None and "</think>" in content:  # a server without a reasoning parser
            content, reasoning = split_reasoning(content, params.enable_thinking)
        return Completion(content=content.strip(), reasoning=reasoning, finish_reason=_finish(finish),
                          prompt_tokens=int(usage.get("prompt_tokens") or 0),
                          completion_tokens=int(usage.get("completion_tokens") or 0),
                          output_ids=output_ids, prompt_ids=prompt_ids)

    async def _post_generate(self, e, messages, params, max_new_tokens) -> Completion:
        if self.render is None:
            raise PipelineError("api=generate needs the target's tokenizer to render prompts")
        sampling = {"max_new_tokens": max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
                    "skip_special_tokens": False}
        if params.top_k > 0:
            sampling["top_k"] = params.top_k
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        prompt_ids = self.render(messages, params.enable_thinking)
        data = await self._post(e, "/generate", {"input_ids": prompt_ids, "sampling_params": sampling})
        try:
            text = data["text"]
            meta = data.get("meta_info") or {}
            output_ids = _ids(data.get("output_ids"))
        except (KeyError, TypeError) as exc:
            raise TransientError(f"{e.url}: malformed response ({exc})") from None
        for stop in ("<|im_end|>", "<|endoftext|>"):
            text = text.split(stop, 1)[0]
        content, reasoning = split_reasoning(text, params.enable_thinking)
        return Completion(content=content, reasoning=reasoning, finish_reason=_finish(meta.get("finish_reason")),
                          prompt_tokens=int(meta.get("prompt_tokens") or 0),
                          completion_tokens=int(meta.get("completion_tokens") or 0),
                          output_ids=output_ids, prompt_ids=list(prompt_ids))


def _ids(value) -> list[int] | None:
    """A list of token ids from a response, or None (absent); anything else is a malformed response."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise TypeError(f"token ids are not a list of integers: {str(value)[:80]}")
    return value


def _finish(value) -> str:
    """SGLang's native API reports {"type": "length", ...}; the OpenAI one a plain string."""
    if isinstance(value, dict):
        value = value.get("type")
    return str(value or "stop")


def _error_reason(status: int, body: bytes) -> str:
    text = body[:500].decode("utf-8", "replace")
    try:
        data = json.loads(body)
        message = data.get("message") or (data.get("error") or {}).get("message") or text
        text = str(message)[:500]
    except (ValueError, AttributeError):
        pass
    low = text.lower()
    if "context length" in low or "too long" in low or "maximum context" in low or "longer than" in low:
        return f"prompt too long: {text}"
    return f"rejected (HTTP {status}): {text}"
