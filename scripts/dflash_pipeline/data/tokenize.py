"""Tokenize one shard of conversations with the target's chat template and an assistant-only loss mask.

Writes the token shard (sample_id, input_ids, loss_mask, length, num_loss_tokens, truncated) and the
shard's audit: per-sample numbers the audit stage aggregates (loss-mask sums, response lengths, turns,
truncation, roles, final answers for placeholder detection). For completions shards, rows whose
generation failed are not tokenized; they are counted with their reasons.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import time
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline.storage import atomic_path, write_json

log = logging.getLogger(__name__)

TOKENS_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("length", pa.int32()),
        ("num_loss_tokens", pa.int32()),
        ("truncated", pa.bool_()),
    ]
)
ANSWER_KEY_CHARS = 80


def answer_key(text: str) -> str:
    """Normalized final answer: short answers verbatim (readable in the report), long ones hashed."""
    norm = re.sub(r"\s+", " ", text.strip().lower())
    if len(norm) <= ANSWER_KEY_CHARS:
        return norm
    return "sha:" + hashlib.blake2b(norm.encode("utf-8"), digest_size=8).hexdigest()


def load_tokenizer(model_dir: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)


def tokenize_shard(input_path: str, model_dir: str, out_tokens: str, out_audit: str, max_length: int,
                   enable_thinking: bool = True, batch_size: int = 256, trivial_tokens: int = 6,
                   trust_remote_code: bool = False) -> dict:
    from dflash_pipeline.data.chat_masking import ChatMasker

    t0 = time.perf_counter()
    table = pq.read_table(input_path)
    tokenizer = load_tokenizer(model_dir, trust_remote_code)
    masker = ChatMasker(tokenizer, enable_thinking=enable_thinking, max_length=max_length)

    failed: Counter[str] = Counter()
    if "status" in table.column_names:  # a completions shard: only successful generations are training data
        status = table.column("status").to_pylist()
        reasons = table.column("failure_reason").to_pylist() if "failure_reason" in table.column_names else [None] * len(status)
        for st, why in zip(status, reasons):
            if st != "ok":
                failed[why or st or "unknown"] += 1
        table = table.filter(pa.array([st == "ok" for st in status]))

    ids = table.column("sample_id").to_pylist()
    conversations = table.column("messages").to_pylist()
    cols = {name: [] for name in TOKENS_SCHEMA.names}
    per_sample = {k: [] for k in ("loss_tokens", "length", "turns", "assistant_turns", "response_tokens")}
    roles: Counter[str] = Counter()
    answers: Counter[str] = Counter()
    counts = Counter()
    for lo in range(0, len(conversations), batch_size):
        batch = conversations[lo:lo + batch_size]
        for sid, messages, sample in zip(ids[lo:lo + batch_size], batch, masker.encode(batch)):
            n_loss = int(sum(sample.loss_mask))
            cols["sample_id"].append(sid)
            cols["input_ids"].append(sample.input_ids)
            cols["loss_mask"].append(sample.loss_mask)
            cols["length"].append(len(sample.input_ids))
            cols["num_loss_tokens"].append(n_loss)
            cols["truncated"].append(sample.truncated)
            assistant = [m for m in messages if m["role"] == "assistant"]
            roles.update(m["role"] for m in messages)
            per_sample["loss_tokens"].append(n_loss)
            per_sample["length"].append(len(sample.input_ids))
            per_sample["turns"].append(len(messages))
            per_sample["assistant_turns"].append(len(assistant))
            per_sample["response_tokens"].extend(sample.turn_tokens)
            counts["truncated"] += sample.truncated
            # trivial: no assistant turn carries more than a few supervised tokens (e.g. every answer `OK.`)
            counts["trivial"] += max(sample.turn_tokens, default=0) <= trivial_tokens
            counts["no_supervision"] += n_loss == 0
            counts["empty_response"] += any(not (m["content"] or "").strip() and not (m.get("reasoning_content") or "").strip()
                                            for m in assistant)
            counts["not_ending_with_assistant"] += messages[-1]["role"] != "assistant"
            counts["system_prompt"] += messages[0]["role"] == "system"
            counts["closing_missing"] += not sample.closing_found
            if assistant:
                answers[answer_key(assistant[-1]["content"] or "")] += 1
    with atomic_path(out_tokens) as tmp:
        pq.write_table(pa.Table.from_pydict(cols, schema=TOKENS_SCHEMA), tmp, compression="zstd")
    elapsed = time.perf_counter() - t0
    audit = {
        "input": os.path.basename(input_path),
        "samples": len(ids),
        "generation_failed": sum(failed.values()),
        "generation_failure_reasons": dict(failed.most_common()),
        "tokens": int(sum(per_sample["length"])),
        "loss_tokens": int(sum(per_sample["loss_tokens"])),
        "counts": {k: int(counts[k]) for k in ("truncated", "trivial", "no_supervision", "empty_response",
                                                "not_ending_with_assistant", "system_prompt", "closing_missing")},
        "roles": dict(roles),
        "per_sample": per_sample,
        "answers": dict(answers.most_common()),
        "settings": {"max_length": max_length, "enable_thinking": enable_thinking, "trivial_tokens": trivial_tokens,
                     "model": model_dir, "closing": masker.closing},
        "seconds": round(elapsed, 3),
    }
    write_json(out_audit, audit, indent=None)
    log.info("%s: %d samples, %d tokens (%d supervised) in %.2fs", input_path, len(ids), audit["tokens"],
             audit["loss_tokens"], elapsed)
    return audit


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, help="ingested or completions shard (Parquet)")
    p.add_argument("--model", required=True, help="target model directory (tokenizer + chat template)")
    p.add_argument("--out", required=True)
    p.add_argument("--audit", required=True)
    p.add_argument("--max-length", type=int, default=3072)
    p.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--trivial-tokens", type=int, default=6)
    p.add_argument("--trust-remote-code", action="store_true")


def run(args) -> int:
    audit = tokenize_shard(args.input, args.model, args.out, args.audit, args.max_length, args.enable_thinking,
                           args.batch_size, args.trivial_tokens, args.trust_remote_code)
    print(json.dumps({k: audit[k] for k in ("samples", "tokens", "loss_tokens", "counts", "seconds")}))
    return 0


def read_tokens(path: str) -> dict[str, np.ndarray]:
    """Load a token shard as numpy arrays (for tests and downstream stages)."""
    table = pq.read_table(path)
    return {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
