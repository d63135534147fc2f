"""Evaluation prompt files (MT-Bench's `question.jsonl`: question_id, category, turns) and the decontamination
key: none of these prompts may be in the training data, so ingest drops every sample whose first user turn
matches one after normalisation (Unicode NFKC, case folded, whitespace collapsed)."""

from __future__ import annotations

import json
import re
import unicodedata

from dflash_pipeline.errors import PipelineError

_SPACE = re.compile(r"\s+")


def normalise(text: str) -> str:
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text)).strip().casefold()


def read_prompts_file(path: str) -> list[dict]:
    """[{"id", "category", "prompt"}] from a JSONL file of MT-Bench questions (the first turn is the prompt) or of
    {"prompt": ...} lines; any other line is an error naming the file and line."""
    prompts = []
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PipelineError(f"{path}: cannot read the evaluation prompts ({exc})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise PipelineError(f"{path}:{n}: not JSON ({exc})") from None
        turns = rec.get("turns") if isinstance(rec, dict) else None
        text = turns[0] if isinstance(turns, list) and turns else (rec.get("prompt") if isinstance(rec, dict) else None)
        if not isinstance(text, str) or not text.strip():
            raise PipelineError(f"{path}:{n}: expected a question with `turns` (MT-Bench question.jsonl) or a "
                                f"`prompt` string")
        prompts.append({"id": str(rec.get("question_id", rec.get("id", n))),
                        "category": str(rec.get("category") or "all"), "prompt": text})
    if not prompts:
        raise PipelineError(f"{path}: no evaluation prompts")
    return prompts


def excluded_prompts(paths: list[str]) -> dict[str, str]:
    """normalised prompt -> where it comes from (file:question id), for every prompt of every file."""
    keys = {}
    for path in paths:
        for p in read_prompts_file(path):
            keys.setdefault(normalise(p["prompt"]), f"{path}#{p['id']}")
    return keys


def first_user_turn(messages: list[dict]) -> str | None:
    return next((m["content"] for m in messages if m["role"] == "user"), None)
