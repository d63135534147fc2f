"""The bundled demo data set, written by the project itself (nothing is downloaded).

Three raw files in the three supported shapes: a ShareGPT JSON array, ShareGPT JSONL.gz and OpenAI-style
`messages` JSONL.zst. A third of the answers are the placeholder `OK.` (the incident the audit must
catch), some conversations are multi-turn or carry a system prompt, a few records are malformed or
duplicated, so that quarantine and deduplication have something to do.
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


def corpus_texts(n: int = 3000, seed: int = 1) -> list[str]:
    """Text the demo tokenizer is trained on: the demo's own distribution plus chat markup."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        for _, text in make_conversation(rng, placeholder_rate=0.0):
            texts.append(text)
    texts += ["The user asks a question and the assistant thinks step by step before answering."] * 10
    texts += ["OK.", "\n\n", "Sure.\n\nOK.\n\n"] * 50  # common chat fragments, so they merge as in real vocabularies
    return texts


def _sharegpt(turns, sid):
    role = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"id": sid, "conversations": [{"from": role[r], "value": t} for r, t in turns]}


def _openai(turns, sid):
    return {"id": sid, "messages": [{"role": r, "content": t} for r, t in turns]}


def write_demo(out_dir: str | Path, n_records: int = 360, placeholder_rate: float = 0.35, seed: int = 7) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    per_file = n_records // 3
    convs = [make_conversation(rng, placeholder_rate) for _ in range(3 * per_file)]

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
    # quarantined: a tool's result that answers no call (well-formed tool calling is accepted)
    lines.append(json.dumps(_openai([("user", "Hi"), ("tool", "{}")], "tool-result-without-call")))
    lines.append(json.dumps(part1[0]))  # same conversation as part 1, other file: a cross-file duplicate
    with atomic_path(out / "openai_part3.jsonl.zst") as tmp:
        tmp.write_bytes(zstandard.ZstdCompressor(level=3).compress(("\n".join(lines) + "\n").encode("utf-8")))
    return {"files": sorted(p.name for p in out.iterdir()), "conversations": 3 * per_file}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="directory for the three raw demo files")
    p.add_argument("--records", type=int, default=360)
    p.add_argument("--placeholder-rate", type=float, default=0.35)
    p.add_argument("--seed", type=int, default=7)


def run(args) -> int:
    info = write_demo(args.out, args.records, args.placeholder_rate, args.seed)
    print(f"demo data written to {args.out}: {info}")
    return 0
