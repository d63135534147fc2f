"""The generation client: turns one sample into a regenerated conversation, against any engine.

An *engine* (`engines.HTTPEngine` for SGLang / OpenAI-compatible servers, `engines.HFEngine` in-process) answers
one chat request: `await engine.complete(messages, params, max_new_tokens) -> Completion`. Everything above
the engine (turn plan, per-sample seeds, retries with backoff and jitter, the finish_reason policy, empty
answers, permanent failures, conversations cut by the context) lives here, so the CPU demo runs the same code
as a GPU cluster.

Errors: `TransientError` (timeouts, 5xx, 429, dropped connections, truncated bodies, an answer the server
aborted) is retried with exponential backoff and jitter up to `max_retries`; `PermanentError` (a prompt that
leaves no room in the context, an answer cut at max_new_tokens under `on_length: drop`) is recorded with its
reason at once; `FatalError` (every server down for too long) stops the run, leaving the journal to resume from.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import random
from dataclasses import asdict, dataclass, field

import pyarrow as pa

from dflash_pipeline import settings
from dflash_pipeline.data.conversations import SAMPLE_SCHEMA, TOOL_FIELDS, sample_tools
from dflash_pipeline.errors import PipelineError

COMPLETION_SCHEMA = pa.schema(
    list(SAMPLE_SCHEMA)
    + [
        ("status", pa.string()),             # ok | failed
        ("failure_reason", pa.string()),     # null when ok
        ("finish_reason", pa.string()),      # of the last generated turn: stop | length | null (failed early)
        ("model", pa.string()),
        ("sampling_params", pa.string()),    # JSON, with this sample's seed
        ("prompt_tokens", pa.int64()),       # summed over generated turns
        ("completion_tokens", pa.int64()),
        ("generated_turns", pa.int32()),
        ("attempts", pa.int32()),            # requests sent for this sample, retries included
        # The target's own token ids, per generated assistant turn in order: thinking + content + the end
        # token, exactly as sampled (null when the engine reports none: an OpenAI server without token ids).
        ("output_ids", pa.list_(pa.list_(pa.int32()))),
        # The prompt ids of the last generated turn: prompt_ids + output_ids[-1] is the exact token stream.
        ("prompt_ids", pa.list_(pa.int32())),
        # The prompt ids of every generated turn in order (the last is prompt_ids): turn k's exact stream is
        # turn_prompt_ids[k] + output_ids[k] (tokenize.turn_samples: every). Null where an engine reported no ids
        # and in journals written before the column (those rows give their last turn only).
        ("turn_prompt_ids", pa.list_(pa.list_(pa.int32()))),
        # `turns: all` with tools: why the conversation ends early (the target called other tools than the
        # original turn; its later tool results would answer calls that were not made), null otherwise
        ("cut_reason", pa.string()),
    ]
)
OK_FINISH = ("stop", "length")
LOG = logging.getLogger(__name__)


class TransientError(Exception):
    """Worth retrying: the request may succeed later (timeouts, 5xx, dropped connections, aborts)."""


class PermanentError(Exception):
    """Retrying cannot help (a prompt that does not fit the context, a dropped length cut)."""


class ContextFull(PermanentError):
    """The prompt leaves no room for an answer in the context."""


class RejectedError(PermanentError):
    """The server refused the request for another reason than its length (HTTP 4xx): recorded, not retried in
    this run, but retried by a rerun (the cause is often the configuration, e.g. a wrong model name)."""


class FatalError(PipelineError):
    """The run cannot continue (e.g. every server has been down for too long)."""


@dataclass(frozen=True)
class SamplingParams:
    """What each request asks for (config `generate:`; every default is the schema's)."""

    max_new_tokens: int = settings.field("generate.max_new_tokens")
    temperature: float = settings.field("generate.temperature")
    top_p: float = settings.field("generate.top_p")
    top_k: int = settings.field("generate.top_k")
    enable_thinking: bool = settings.field("generate.enable_thinking")
    seed: int | None = settings.field("generate.seed")  # the run's base seed; each request's derives from its id

    def to_json(self, **extra) -> str:
        return json.dumps({**asdict(self), **extra}, sort_keys=True)


def sample_seed(base: int | None, sample_id: str) -> int:
    """The seed of one sample: a pure function of the run's seed and the sample id (31 bits), so samples never
    share a random stream, also when the server runs deterministic inference."""
    digest = hashlib.sha256(f"{base or 0}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


@dataclass
class Completion:
    content: str
    reasoning: str | None
    finish_reason: str                   # stop | length | abort | ... (anything but stop/length fails)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    server: str = ""
    output_ids: list[int] | None = None  # as generated, the end token included
    prompt_ids: list[int] | None = None
    detail: str = ""                     # the server's message for an abort
    tool_calls: list[dict] | None = None  # parsed calls, stored form (generation/tool_calls.py)


@dataclass(frozen=True)
class Policy:
    """What the client does around each request (config `generate:`)."""

    turns: str = settings.field("generate.turns")                # first | all
    max_turns: int = settings.field("generate.max_turns")        # turns: all: at most this many (0: all)
    on_length: str = settings.field("generate.on_length")        # keep | drop | retry
    length_retry_max_new_tokens: int = settings.field("generate.length_retry_max_new_tokens")  # the one retry's
    max_retries: int = settings.field("generate.max_retries")
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    empty_retries: int = settings.field("generate.empty_retries")

    def recorded(self) -> dict:
        """What the sampling record and the journal's fingerprint carry of the policy: max_turns only when set, so
        the records and journals of runs without it stay as they were."""
        capped = {"max_turns": self.max_turns} if self.max_turns else {}
        return {"turns": self.turns, "on_length": self.on_length, **capped}

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
    aborted: int = 0       # answers the server ended with another finish_reason than stop/length
    truncated: int = 0     # conversations cut where a later turn did not fit the context (kept, status ok)
    cut: int = 0           # conversations cut where the target called other tools than the original (kept, ok)
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
    """Messages as the chat API wants them (earlier thinking is not sent back; tool calls with their arguments
    as JSON text, tool results with their call's id: generation/tool_calls.py)."""
    from dflash_pipeline.generation.tool_calls import wire_message

    return [wire_message(m) for m in messages]


# --------------------------------------------------------------------------------------------------------
# one assistant turn
# --------------------------------------------------------------------------------------------------------
@dataclass
class _Turn:
    """The state of one turn's attempts."""

    budget: int
    seed: int
    attempt: int = 0          # transient failures so far
    length_retried: bool = False
    empty_seen: int = 0


async def _transient(exc: Exception, turn: _Turn, policy: Policy, counters: Counters) -> None:
    """Count a transient failure, give up past max_retries, else back off (and reseed) before the next try."""
    turn.attempt += 1
    if turn.attempt > policy.max_retries:
        raise TransientError(f"gave up after {turn.attempt} attempts: {exc}") from None
    counters.retries += 1
    await asyncio.sleep(policy.backoff(turn.attempt))


def _length_retry(turn: _Turn, policy: Policy, counters: Counters) -> bool:
    """On finish_reason=length: True to ask again with the larger budget, else keep or raise (the policy)."""
    counters.length += 1
    if policy.on_length == "retry" and not turn.length_retried and policy.length_retry_max_new_tokens > turn.budget:
        turn.length_retried = True
        turn.budget = policy.length_retry_max_new_tokens
        counters.retries += 1
        return True
    if policy.on_length in ("drop", "retry"):
        raise PermanentError(f"finish_reason=length: answer cut at {turn.budget} new tokens")
    return False


async def complete_with_policy(engine, messages, params: SamplingParams, policy: Policy, counters: Counters,
                               tally: list, seed: int, tools: list | None = None) -> Completion:
    """One assistant turn, with retries, the finish_reason policy and the empty-answer check.

    Raises PermanentError (not worth retrying later: no room in the context, length dropped, empty) or
    TransientError (retries exhausted: a rerun tries again). An empty answer is asked again with the next seed
    (the same seed would give the same answer under deterministic inference). `tools` (the sample's schemas)
    go with the request only when there are any, so chat-only requests are what they always were.
    """
    extra = {"tools": tools} if tools else {}
    turn = _Turn(budget=params.max_new_tokens, seed=seed)
    while True:
        tally[0] += 1
        counters.requests += 1
        try:
            result = await engine.complete(messages, dataclasses.replace(params, seed=turn.seed), turn.budget,
                                           **extra)
        except TransientError as exc:
            await _transient(exc, turn, policy, counters)
            continue
        if result.finish_reason not in OK_FINISH:
            counters.aborted += 1
            reason = f"finish_reason={result.finish_reason}" + (f": {result.detail}" if result.detail else "")
            await _transient(TransientError(reason), turn, policy, counters)
            continue
        if result.finish_reason == "length" and _length_retry(turn, policy, counters):
            continue
        if not result.content.strip() and not result.tool_calls:  # a bare call is an answer
            counters.empty += 1
            turn.empty_seen += 1
            if turn.empty_seen <= policy.empty_retries:
                counters.retries += 1
                turn.seed = (turn.seed + 1) & 0x7FFFFFFF
                continue
            raise PermanentError(f"empty response (finish_reason={result.finish_reason}, "
                                 f"{result.completion_tokens} tokens)")
        return result


# --------------------------------------------------------------------------------------------------------
# one sample
# --------------------------------------------------------------------------------------------------------
def turn_plan(messages: list[dict], turns: str):
    """Yield the index of every assistant turn to generate (len(messages) for a trailing user turn). A tool
    result asks for an answer as a user turn does (an assistant turn after a tool result is generated too)."""
    seen_user = asked = False
    for i, m in enumerate(messages):
        if m["role"] == "user" or (m["role"] == "tool" and seen_user):
            seen_user = asked = True
        elif m["role"] == "assistant" and asked:
            yield i
            if turns == "first":
                return
            asked = False
    if messages and messages[-1]["role"] in ("user", "tool") and seen_user:
        yield len(messages)


@dataclass
class _Conversation:
    """What one sample's generation has produced so far."""

    messages: list[dict] = field(default_factory=list)
    generated: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish: str | None = None
    turn_ids: list = field(default_factory=list)
    prompt_ids: list[int] | None = None
    turn_prompt_ids: list = field(default_factory=list)
    truncated: bool = False
    cut_reason: str | None = None

    def add(self, result: Completion) -> None:
        message = {"role": "assistant", "content": result.content, "reasoning_content": result.reasoning}
        if result.tool_calls:
            message["tool_calls"] = json.dumps(result.tool_calls, ensure_ascii=False)
        self.messages.append(message)
        self.prompt_tokens += result.prompt_tokens
        self.completion_tokens += result.completion_tokens
        self.finish = result.finish_reason
        self.turn_ids.append(result.output_ids)
        self.prompt_ids = result.prompt_ids
        self.turn_prompt_ids.append(result.prompt_ids)
        self.generated += 1


async def _regenerate(engine, original: list[dict], params, policy, counters, tally, seed: int,
                      tools: list | None = None) -> _Conversation:
    """Every planned turn in order, each on the model's own earlier answers. A later turn that no longer fits
    the context ends the conversation after the turns already made (kept as a shorter conversation); so does a
    turn whose tool calls differ from the original turn's (`cut_reason`, generation/tool_calls.py): later tool
    results stay the original ones, which answer only the calls the original made."""
    from dflash_pipeline.generation.tool_calls import divergence, renamed_results

    conv = _Conversation()
    cursor, answered = 0, None  # answered: (original turn, the target's calls) of the last generated turn
    capped = False
    for pos in turn_plan(original, policy.turns):
        if policy.max_turns and conv.generated >= policy.max_turns:
            capped = True  # the conversation ends after its first max_turns answers
            break
        # user/system turns; an original assistant turn survives only before the first user turn
        before = [m for m in original[cursor:pos] if m["role"] != "assistant" or conv.generated == 0]
        conv.messages.extend(renamed_results(before, *answered) if answered else before)
        cursor = pos + 1
        try:
            result = await complete_with_policy(engine, chat_messages(conv.messages), params, policy, counters,
                                                tally, seed, tools)
        except ContextFull:
            if conv.generated == 0:
                raise
            last = max(i for i, m in enumerate(conv.messages) if m["role"] == "assistant")
            conv.messages, conv.truncated = conv.messages[: last + 1], True
            return conv
        except (PermanentError, TransientError) as exc:
            if conv.generated == 0:
                raise
            raise type(exc)(f"turn {conv.generated + 1}: {exc}") from None
        conv.add(result)
        answered = (original[pos], result.tool_calls) if pos < len(original) else None
        later = policy.turns == "all" and pos + 1 < len(original)  # original turns would follow this one
        cut = divergence(original[pos], result.tool_calls, conv.generated) if later else None
        if cut:
            conv.cut_reason = cut
            return conv
    if policy.turns == "all" and not capped:
        rest = [m for m in original[cursor:] if m["role"] != "assistant"]
        conv.messages.extend(renamed_results(rest, *answered) if answered else rest)
    if conv.generated == 0:
        raise PermanentError("no user turn to answer")
    return conv


def _prompt_only(original: list[dict]) -> list[dict]:
    """A failed row keeps only the messages before the first assistant turn: never training data."""
    first = next((i for i, m in enumerate(original) if m["role"] == "assistant"), len(original))
    return original[:first]


async def generate_sample(engine, sample: dict, params: SamplingParams, policy: Policy, counters: Counters,
                          model: str, sampling_json: str) -> dict:
    """The completion row of one sample (status ok, or failed with a reason; `permanent` for the journal)."""
    from dflash_pipeline.generation.tool_calls import has_tool_content

    original = sample["messages"]
    seed = sample_seed(params.seed, sample["sample_id"])
    tally = [0]
    conv, reason, permanent = None, None, True
    try:
        if has_tool_content(sample) and not getattr(engine, "parses_tool_calls", False):
            raise PermanentError(tools_refusal(sample["sample_id"], engine))
        conv = await _regenerate(engine, original, params, policy, counters, tally, seed, sample_tools(sample))
    except PermanentError as exc:
        reason = str(exc)
        if isinstance(exc, RejectedError):
            permanent = False
            counters.rejected += 1
    except TransientError as exc:
        reason, permanent = str(exc), False
    if conv is None:
        counters.failed += 1
        counters.failed_permanent += int(permanent)
        counters.add_failure(reason)
        if reason.startswith(TOOLS_UNSUPPORTED) and counters.failure_reasons[TOOLS_UNSUPPORTED] == 1:
            LOG.warning("%s (every such sample fails with this reason)", reason)
        conv = _Conversation(messages=_prompt_only(original))
    else:
        counters.ok += 1
        counters.truncated += int(conv.truncated)
        counters.cut += int(conv.cut_reason is not None)
    counters.prompt_tokens += conv.prompt_tokens
    counters.completion_tokens += conv.completion_tokens
    ok = reason is None
    output_ids = conv.turn_ids if ok and all(t is not None for t in conv.turn_ids) else None
    return {
        "sample_id": sample["sample_id"],
        "source": sample["source"],
        "source_id": sample["source_id"],
        "messages": [{"role": m["role"], "content": m["content"], "reasoning_content": m.get("reasoning_content"),
                      **{k: m.get(k) for k in TOOL_FIELDS}} for m in conv.messages],
        "tools": sample.get("tools"),
        "status": "ok" if ok else "failed",
        "failure_reason": reason,
        "finish_reason": conv.finish,
        "model": model,
        "sampling_params": json.dumps({**json.loads(sampling_json), "seed": seed, "base_seed": params.seed},
                                      sort_keys=True),
        "prompt_tokens": conv.prompt_tokens,
        "completion_tokens": conv.completion_tokens,
        "generated_turns": conv.generated,
        "attempts": tally[0],
        "output_ids": output_ids,
        "prompt_ids": conv.prompt_ids if ok else None,
        "turn_prompt_ids": (conv.turn_prompt_ids if output_ids is not None
                            and all(p is not None for p in conv.turn_prompt_ids) else None),
        "cut_reason": conv.cut_reason if ok else None,
        "permanent": permanent,
    }


TOOLS_UNSUPPORTED = "tools_unsupported"


def tools_refusal(sample_id: str, engine) -> str:
    """The one line a sample with tools fails with on an engine that neither sends tools nor parses calls."""
    hf = ("the hf backend", " (it reads calls only in Qwen's <tool_call> layout, and the target's chat template "
                            "has none)")
    which, why = {"HFEngine": hf, "SlotEngine": hf,
                  "HTTPEngine": ("the servers' /generate API (api: generate)", " (prompts are rendered here without "
                                                                                 "tools)")
                  }.get(type(engine).__name__, (engine.describe(), ""))
    return (f"{TOOLS_UNSUPPORTED}: sample {sample_id} has tools or tool calls, which {which} cannot regenerate"
            f"{why}; regenerate it with generate.backend: sglang (chat API) and generate.sglang.tool_call_parser "
            "set for the target (e.g. qwen25)")
