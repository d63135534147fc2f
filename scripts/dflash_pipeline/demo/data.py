"""The bundled demo data set, written by the project itself (nothing is downloaded).

Three raw files in the three supported shapes: a ShareGPT JSON array, ShareGPT JSONL.gz and OpenAI-style
`messages` JSONL.zst. A third of the answers are the placeholder `OK.` (the incident the audit must
catch), some conversations are multi-turn or carry a system prompt, a few records are malformed or
duplicated, so that quarantine and deduplication have something to do. 5% of the records are well-formed
tool-calling conversations (an arithmetic question answered through a `calculator` tool), in both shapes
ingest accepts: ShareGPT `function_call` / `observation` turns with `tools` in part 1, OpenAI `tool_calls`
+ `tool` turns with `tools` in part 3.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path

import zstandard

from dflash_pipeline.storage import atomic_path

TOPICS = [
    ("add", "What is {a} plus {b}?", "{a} plus {b} is {s}. Adding the ones first and then the tens gives {s}."),
    ("mul", "Compute {a} times {b}.", "{a} times {b} equals {p}. You can check it by adding {a} to itself {b} times."),
    ("sub", "If I have {a} apples and give away {c}, how many are left?", "You have {d} apples left, because {a} minus {c} is {d}."),
    ("code", "Write a Python function that returns the sum of a list of {b} numbers.", "For {b} numbers, here is one way:\n\n```python\ndef total(xs):\n    return sum(xs)\n```\n\nIt loops {b} times and returns {z} for an empty list."),
    ("code2", "How do I reverse a string of length {a} in Python?", "Use slicing: `s[::-1]` returns the reversed string of length {a}. For example `'abc'[::-1]` is `'cba'`."),
    ("fact", "Tell me one fact about the number {a}.", "The number {a} is {parity}, and its square is {sq}."),
    ("explain", "Explain what a hash table with {a} buckets is.", "A hash table stores key-value pairs in an array of {a} buckets. A hash function maps each key to a bucket, so lookups take constant time on average."),
    ("story", "Write a two-sentence story about a {animal}.", "The {animal} woke before sunrise and walked to the river. By noon it had found {a} shiny stones and carried them home."),
    ("advice", "Give me a tip for learning {lang}.", "Practice {lang} for {b} minutes every day. Short daily sessions beat long weekly ones, and reading real text helps most."),
]
ANIMALS = ["fox", "owl", "cat", "whale", "ant", "heron"]
LANGS = ["Spanish", "Rust", "piano", "chess", "French", "calculus"]
SYSTEMS = ["You are a helpful assistant.", "You are a concise math tutor.", "Answer briefly and precisely."]
FOLLOW_UPS = [("Can you explain that again?", "Sure. {answer}"), ("Thanks! And double it?", "Doubled, that gives {dbl}.")]


# the one tool of the tool-calling records (OpenAI form; the ShareGPT records list the bare function). A short
# schema: the tiny target is pretrained on 256-token windows, and a prompt much longer than that (a longer tools
# list) leaves it answering noise instead of a call.
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Compute a op b for two integers.",
    "parameters": {"type": "object", "properties": {
        "op": {"type": "string", "enum": ["add", "subtract", "multiply"]},
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["op", "a", "b"]}}}
TOOLS = [CALCULATOR]
# the arithmetic topics answered through the calculator: (op, question, result, final answer). The user names the
# calculator: the tiny target tells a tool turn from a chat turn by that nearby cue, not by the tools listed
# ~100 tokens earlier (with the chat topics' questions it called the tool in a quarter of the chat prompts too)
TOOL_TOPICS = [
    ("add", "Use the calculator: what is {a} plus {b}?", lambda a, b: a + b, "{a} plus {b} is {r}."),
    ("multiply", "Use the calculator to compute {a} times {b}.", lambda a, b: a * b, "{a} times {b} equals {r}."),
    ("subtract", "Use the calculator: I have {a} apples and give away {b}, how many are left?", lambda a, b: a - b,
     "You have {r} apples left."),
]


def _fill(rng: random.Random) -> tuple[str, str, dict]:
    _, q, a = rng.choice(TOPICS)
    x, y = rng.randint(2, 99), rng.randint(2, 30)
    v = dict(a=x, b=y, s=x + y, p=x * y, c=min(y, x), d=x - min(y, x), z=0, sq=x * x,
             parity="even" if x % 2 == 0 else "odd", animal=rng.choice(ANIMALS), lang=rng.choice(LANGS))
    v["dbl"] = 2 * v["s"]
    return q.format(**v), a.format(**v), v


def make_conversation(rng: random.Random, placeholder_rate: float) -> list[tuple[str, str]]:
    turns: list[tuple[str, str]] = []
    if rng.random() < 0.2:
        turns.append(("system", rng.choice(SYSTEMS)))
    question, answer, values = _fill(rng)
    placeholder = rng.random() < placeholder_rate
    if not placeholder and rng.random() < 0.1:
        answer = f"<think>\nThe user asks: {question} Let me work it out.\n</think>\n\n{answer}"
    turns += [("user", question), ("assistant", "OK." if placeholder else answer)]
    if rng.random() < 0.25:
        follow_q, follow_a = rng.choice(FOLLOW_UPS)
        turns += [("user", follow_q), ("assistant", "OK." if placeholder else follow_a.format(answer=answer, **values))]
    return turns


def make_tool_conversation(rng: random.Random) -> list[tuple[str, str]]:
    """A well-formed tool-calling conversation: the user asks to use the calculator, the assistant calls it
    (`tool_call` turn: JSON {"name", "arguments"}), the tool answers (`tool` turn: JSON {"result"}), the
    assistant states the result. Its records list TOOLS (`chat_messages` gives the OpenAI form, `_sharegpt` / `_openai` the raw
    shapes)."""
    turns: list[tuple[str, str]] = []
    if rng.random() < 0.2:
        turns.append(("system", rng.choice(SYSTEMS)))
    op, question, compute, answer = rng.choice(TOOL_TOPICS)
    x, y = rng.randint(2, 99), rng.randint(2, 30)
    if op == "subtract":
        y = min(y, x)
    r = compute(x, y)
    turns += [("user", question.format(a=x, b=y)),
              ("tool_call", json.dumps({"name": "calculator", "arguments": {"op": op, "a": x, "b": y}})),
              ("tool", json.dumps({"result": r})),
              ("assistant", f"The calculator returns {r}. " + answer.format(a=x, b=y, r=r))]
    return turns


def chat_messages(turns: list[tuple[str, str]]) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) of a demo conversation as a chat template takes them: OpenAI messages with a call's
    arguments as an object; tools only when the conversation calls one."""
    messages: list[dict] = []
    calls = 0
    for role, text in turns:
        if role == "tool_call":
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": f"call_{calls}", "type": "function", "function": json.loads(text)}]})
            calls += 1
        elif role == "tool":
            messages.append({"role": "tool", "content": text, **({"tool_call_id": f"call_{calls - 1}"} if calls else {})})
        else:
            messages.append({"role": role, "content": text})
    return messages, (TOOLS if calls else None)


def corpus_texts(n: int = 3000, seed: int = 1, tool_share: float = 0.1) -> list[str]:
    """Text the demo tokenizer is trained on: the demo's own distribution plus chat markup; `tool_share` of the
    conversations call a tool, taken as the chat template renders them (tools header, call, result), so the
    markup merges into few tokens."""
    from dflash_pipeline.demo.tiny_model import render_for_corpus

    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        if rng.random() < tool_share:
            texts.append(render_for_corpus(*chat_messages(make_tool_conversation(rng))))
            continue
        for _, text in make_conversation(rng, placeholder_rate=0.0):
            texts.append(text)
    texts += ["The user asks a question and the assistant thinks step by step before answering."] * 10
    texts += ["OK.", "\n\n", "Sure.\n\nOK.\n\n"] * 50  # common chat fragments, so they merge as in real vocabularies
    return texts


def _sharegpt(turns, sid):
    """A ShareGPT record; a tool-calling conversation in LLaMA-Factory's shape: `function_call` / `observation`
    turns and `tools` as JSON text of the bare function schemas."""
    role = {"system": "system", "user": "human", "assistant": "gpt", "tool_call": "function_call",
            "tool": "observation"}
    record = {"id": sid, "conversations": [{"from": role[r], "value": t} for r, t in turns]}
    _, tools = chat_messages(turns)
    if tools:
        record["tools"] = json.dumps([tool["function"] for tool in tools])
    return record


def _openai(turns, sid):
    """An OpenAI `messages` record; a call is an assistant turn with `tool_calls` (arguments as JSON text, content
    null), its result a `tool` turn with the call's id, and the record lists `tools`."""
    messages, tools = chat_messages(turns)
    for m in messages:
        if m.get("tool_calls"):
            m["content"] = None
            for call in m["tool_calls"]:
                call["function"] = {**call["function"], "arguments": json.dumps(call["function"]["arguments"])}
    return {"id": sid, "messages": messages, **({"tools": tools} if tools else {})}


def write_demo(out_dir: str | Path, n_records: int = 360, placeholder_rate: float = 0.35, seed: int = 7,
               tool_rate: float = 0.05, tool_seed: int = 12) -> dict:
    """The three raw files. `tool_rate` of the `n_records` conversations call a tool: half of them the last ones
    of part 1 (ShareGPT shape), half the last ones of part 3 (OpenAI shape); the chat conversations before them
    are the ones the demo had before it had tool calls. `tool_seed` draws the tool conversations; 12 was chosen
    because the default demo's 16 evaluation prompts (holdout 0.08, by sample-id hash) then hold one of each
    shape: at 5% of the records, most seeds leave none in the evaluation and its tau per kind of turn empty."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    per_file = n_records // 3
    convs = [make_conversation(rng, placeholder_rate) for _ in range(3 * per_file)]
    tool_rng = random.Random(tool_seed)
    per_shape = min(round(tool_rate * n_records / 2), per_file)
    for end in (per_file, 3 * per_file):  # the last conversations of part 1 and part 3
        for i in range(end - per_shape, end):
            convs[i] = make_tool_conversation(tool_rng)

    part1 = [_sharegpt(t, f"p1-{i}") for i, t in enumerate(convs[:per_file])]
    part1 += [part1[3], part1[10]]  # exact duplicates
    part1.append({"id": "bad-role", "conversations": [{"from": "narrator", "value": "Once upon a time"}]})
    part1.append({"id": "bad-value", "conversations": [{"from": "human", "value": None}]})
    part1.append({"id": "no-turns", "conversations": []})
    with atomic_path(out / "sharegpt_part1_cleaned_split.json") as tmp:
        tmp.write_text(json.dumps(part1, ensure_ascii=False, indent=1), encoding="utf-8")

    lines = [json.dumps(_sharegpt(t, f"p2-{i}"), ensure_ascii=False) for i, t in enumerate(convs[per_file:2 * per_file])]
    lines.insert(5, '{"id": "broken-json", "conversations": [')  # a line that is not JSON
    lines.insert(9, json.dumps({"id": "no-conv", "text": "hello"}))
    lines.append(lines[0])  # duplicate across the file
    with atomic_path(out / "sharegpt_part2.jsonl.gz") as tmp:
        with gzip.open(tmp, "wt", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")

    lines = [json.dumps(_openai(t, f"p3-{i}"), ensure_ascii=False) for i, t in enumerate(convs[2 * per_file:])]
    # quarantined: a tool's result that answers no call (the well-formed tool conversations above are kept)
    lines.append(json.dumps(_openai([("user", "Hi"), ("tool", "{}")], "tool-result-without-call")))
    lines.append(json.dumps(part1[0]))  # same conversation as part 1, other file: a cross-file duplicate
    with atomic_path(out / "openai_part3.jsonl.zst") as tmp:
        tmp.write_bytes(zstandard.ZstdCompressor(level=3).compress(("\n".join(lines) + "\n").encode("utf-8")))
    return {"files": sorted(p.name for p in out.iterdir()), "conversations": 3 * per_file,
            "tool_conversations": 2 * per_shape}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="directory for the three raw demo files")
    p.add_argument("--records", type=int)
    p.add_argument("--placeholder-rate", type=float)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--tool-rate", type=float, default=0.05,
                   help="share of the records that are tool-calling conversations (both shapes)")


def run(args) -> int:
    info = write_demo(args.out, args.records, args.placeholder_rate, args.seed, args.tool_rate)
    print(f"demo data written to {args.out}: {info}")
    return 0
