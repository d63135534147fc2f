"""Tokenize one shard of conversations with the target's chat template and an assistant-only loss mask.

Writes the token shard (sample_id, input_ids, loss_mask, length, num_loss_tokens, truncated) and the
shard's audit: counts, binned histograms (loss-mask sums, lengths, turns, response lengths) and exact counts
of final-answer hashes, all bounded by the shard's size, which the audit stage merges. For completions
shards, rows whose generation failed are not tokenized; they are counted with their reasons.

Message text that contains the tokenizer's control tokens (`<|im_end|>`, `<|im_start|>`, `<|endoftext|>`:
special added tokens other than the thinking tags) would be encoded as those very tokens, letting a user
forge turns. Such samples are left out of the token shard and counted with a reason (`control_tokens` in the
audit, with examples); the thinking tags stay allowed, they are how inline reasoning is written. Tool calls'
JSON and the sample's tools are checked the same way.

Tool calling: samples with `tools`, assistant `tool_calls` and tool results render through the template with
`tools=` (data/chat_masking.py). A target whose template drops any of them cannot train such a sample: it is
left out and counted with that reason (`tools_unsupported`); chat-only samples are unaffected.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import time
from collections import Counter

import jinja2
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline import settings
from dflash_pipeline.data.audit_stats import AUDIT_FORMAT, Histogram, answer_hash, answer_key
from dflash_pipeline.data.conversations import ROLES, check_conversation_table, sample_tools, tool_calls_of
from dflash_pipeline.data.generated_tokens import encode_conversations, token_id_columns, turn_rows
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.progress import Progress
from dflash_pipeline.storage import atomic_path, write_json
from dflash_pipeline.target import load_tokenizer

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
COUNTS = ("truncated", "trivial", "no_supervision", "empty_response", "not_ending_with_assistant", "system_prompt",
          "closing_missing", "control_tokens", "template_error", "tools_unsupported", "tool_call_samples",
          "earlier_turn_samples")  # the last: samples of earlier generated turns (tokenize.turn_samples: every)
# what a chat template raises for a record it cannot render (`raise_exception(...)`, an undefined attribute,
# adding None to a string): that record is left out with the reason, the shard goes on
TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError)
HISTOGRAMS = ("loss_tokens", "length", "turns", "assistant_turns", "response_tokens")
REASONING_TAGS = ("<think>", "</think>")
TEXTS_PER_SHARD = 50  # answer texts kept per shard for the report (the most repeated ones)
EXAMPLES = 20


def control_token_pattern(tokenizer) -> re.Pattern | None:
    """A regex of the tokenizer's special added tokens that message text must not contain."""
    tokens = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    tokens |= set(tokenizer.all_special_tokens)
    tokens -= set(REASONING_TAGS)
    tokens = sorted((t for t in tokens if t), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, tokens))) if tokens else None


def forged_turn(messages: list[dict], pattern: re.Pattern | None, trusted_roles: frozenset = frozenset()) -> str | None:
    """The reason a conversation's text would be encoded with control tokens, or None. Turns of `trusted_roles`
    are not checked: in completions the assistant turns are the target's own output, special tokens included."""
    if pattern is None:
        return None
    for i, m in enumerate(messages):
        if m["role"] in trusted_roles:
            continue
        for field in ("content", "reasoning_content", "tool_calls"):
            hit = pattern.search(m.get(field) or "")
            if hit:
                return f"message {i} ({m['role']}) {field} contains the control token {hit.group()!r}"
    return None


def final_answer(message: dict) -> str:
    """A sample's final answer as the placeholder check counts it: the last assistant turn's text, and the calls
    it makes (name and arguments). A bare call has no text: without its calls, every sample ending in a call
    would count as one repeated empty answer, a placeholder."""
    calls = [f"{c['function']['name']}({json.dumps(c['function'].get('arguments'), sort_keys=True)})"
             for c in tool_calls_of(message)]
    return " ".join(part for part in [message["content"] or "", *calls] if part)


class ShardAudit:
    """Per-shard audit numbers; everything is bounded by the shard's size (the audit stage merges them)."""

    def __init__(self, trivial_tokens: int):
        self.trivial_tokens = trivial_tokens
        self.counts: Counter[str] = Counter()
        self.roles: Counter[str] = Counter()
        self.answers: Counter[str] = Counter()  # answer hash -> samples
        self.texts: dict[str, str] = {}  # answer hash -> short answer text
        self.hist = {k: Histogram() for k in HISTOGRAMS}
        self.samples = self.tokens = self.loss_tokens = 0
        self.examples: list[dict] = []

    def add(self, messages: list[dict], sample) -> None:
        n_loss, assistant = int(sum(sample.loss_mask)), [m for m in messages if m["role"] == "assistant"]
        self.samples += 1
        self.tokens += len(sample.input_ids)
        self.loss_tokens += n_loss
        for key, value in (("loss_tokens", n_loss), ("length", len(sample.input_ids)), ("turns", len(messages)),
                           ("assistant_turns", len(assistant))):
            self.hist[key].add(value)
        for n in sample.turn_tokens:
            self.hist["response_tokens"].add(n)
        self.roles.update(m["role"] for m in messages)
        self._count(messages, assistant, sample, n_loss)
        if assistant:
            key = answer_key(final_answer(assistant[-1]))
            h = answer_hash(key)
            self.answers[h] += 1
            if not key.startswith("sha:"):
                self.texts.setdefault(h, key)

    def _count(self, messages, assistant, sample, n_loss) -> None:
        c = self.counts
        c["truncated"] += sample.truncated
        # trivial: no assistant turn carries more than a few supervised tokens (e.g. every answer `OK.`)
        c["trivial"] += max(sample.turn_tokens, default=0) <= self.trivial_tokens
        c["no_supervision"] += n_loss == 0
        c["empty_response"] += any(not (m["content"] or "").strip() and not (m.get("reasoning_content") or "").strip()
                                   and not m.get("tool_calls") for m in assistant)  # a bare call is a response
        c["not_ending_with_assistant"] += messages[-1]["role"] != "assistant"
        c["system_prompt"] += messages[0]["role"] == "system"
        c["closing_missing"] += not sample.closing_found
        c["tool_call_samples"] += any(m.get("tool_calls") for m in assistant)  # what trains, for the tool-call gate

    def reject(self, sample_id: str, reason: str, kind: str = "control_tokens") -> None:
        self.counts[kind] += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append({"sample_id": sample_id, "reason": reason})

    def to_json(self) -> dict:
        top = [h for h, _ in self.answers.most_common(TEXTS_PER_SHARD)]
        return {
            "samples": self.samples,
            "tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
            "counts": {k: int(self.counts[k]) for k in COUNTS},
            "rejected_examples": self.examples,
            "roles": dict(self.roles),
            "histograms": {k: h.to_json() for k, h in self.hist.items()},
            "answer_hashes": dict(self.answers),
            "answer_texts": {h: self.texts[h] for h in top if h in self.texts},
        }


def successful_rows(table: pa.Table) -> tuple[pa.Table, Counter]:
    """A completions shard's rows whose generation succeeded (only those are training data), and why the
    others failed; an ingested shard is returned whole."""
    failed: Counter[str] = Counter()
    if "status" not in table.column_names:
        return table, failed
    status = table.column("status").to_pylist()
    reasons = (table.column("failure_reason").to_pylist() if "failure_reason" in table.column_names
               else [None] * len(status))
    for st, why in zip(status, reasons):
        if st != "ok":
            failed[why or st or "unknown"] += 1
    return table.filter(pa.array([st == "ok" for st in status])), failed


def _refusal(masker, messages: list[dict], tools: list | None, pattern, trusted_roles) -> tuple[str, str] | None:
    """(audit count, reason) of a sample that cannot be tokenized safely, or None."""
    reason = forged_turn(messages, pattern, trusted_roles)
    if reason is None and tools and pattern is not None:
        hit = pattern.search(json.dumps(tools, ensure_ascii=False))
        reason = hit and f"the sample's tools contain the control token {hit.group()!r}"
    if reason:
        return "control_tokens", reason
    reason = masker.tool_refusal(messages, tools)
    return ("tools_unsupported", reason) if reason else None


def _encode_batch(masker, ids: list[str], conversations: list[list[dict]], audit: ShardAudit,
                  pattern, trusted_roles: frozenset = frozenset(), token_ids: list | None = None,
                  tools: list | None = None) -> pa.Table | None:
    """One batch of conversations -> token rows; samples with forged control tokens, or with tools the template
    cannot render, are left out. `token_ids`: per row the target's own (prompt_ids, output_ids) or None
    (data/generated_tokens.py); `tools`: per row the sample's tool schemas or None."""
    keep = []
    for sid, messages, ids_row, row_tools in zip(ids, conversations, token_ids or [None] * len(ids),
                                                 tools or [None] * len(ids)):
        refused = _refusal(masker, messages, row_tools, pattern, trusted_roles)
        if refused:
            audit.reject(sid, refused[1], refused[0])
        else:
            keep.append((sid, messages, ids_row, row_tools))
    keep, samples = _encode_or_reject(masker, keep, audit)
    if not keep:
        return None
    cols = {name: [] for name in TOKENS_SCHEMA.names}
    for (sid, messages, _, _), sample in zip(keep, samples):
        audit.add(messages, sample)
        for name, value in (("sample_id", sid), ("input_ids", sample.input_ids), ("loss_mask", sample.loss_mask),
                            ("length", len(sample.input_ids)), ("num_loss_tokens", int(sum(sample.loss_mask))),
                            ("truncated", sample.truncated)):
            cols[name].append(value)
    return pa.Table.from_pydict(cols, schema=TOKENS_SCHEMA)


def _encode_or_reject(masker, keep: list, audit: ShardAudit) -> tuple[list, list]:
    """The batch encoded at once; when the template raises, record by record, and the records it fails on are
    left out and counted with the template's message (`template_error` in the audit)."""
    if not keep:
        return keep, []
    try:
        return keep, encode_conversations(masker, [k[1] for k in keep], [k[2] for k in keep], [k[3] for k in keep])
    except TEMPLATE_ERRORS:
        pass
    kept, samples = [], []
    for item in keep:
        try:
            samples.extend(encode_conversations(masker, [item[1]], [item[2]], [item[3]]))
        except TEMPLATE_ERRORS as exc:
            reason = f"the chat template fails on it ({type(exc).__name__}: {str(exc)[:300]})"
            log.warning("sample %s: %s; left out of the token shard", item[0], reason)
            audit.reject(item[0], reason, "template_error")
            continue
        kept.append(item)
    return kept, samples


def _row_count(path: str) -> int:
    """Rows of a shard from its footer (for progress); a file that is not Parquet is one line naming it."""
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (OSError, pa.ArrowException) as exc:
        raise PipelineError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None


def read_conversations(path: str) -> pa.Table:
    """An ingested or completions shard; any other file is one line naming it and what is wrong."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise PipelineError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    check_conversation_table(path, table)
    return table


def check_conversation(path: str, row: int, sid, messages: list[dict]) -> None:
    """What ingest guarantees, checked on shards from elsewhere: an id, and known roles with text."""
    if not isinstance(sid, str) or not sid:
        raise PipelineError(f"{path}: row {row} has no sample_id")
    for i, m in enumerate(messages or []):
        if m.get("role") not in ROLES:
            raise PipelineError(f"{path}: row {row} (sample {sid!r}): message {i} has role {m.get('role')!r}, "
                                f"expected one of {sorted(ROLES)}")
    if not messages:
        raise PipelineError(f"{path}: row {row} (sample {sid!r}): no messages")


class ShardTokenizer:
    """The target's tokenizer, chat masker and control-token check, loaded once for any number of shards
    (loading a 248K-token vocabulary costs seconds: a job that takes several shards pays it once)."""

    def __init__(self, model_dir: str, max_length: int, enable_thinking: bool = True, batch_size: int = 256,
                 trivial_tokens: int = 6, trust_remote_code: bool = False, turn_samples: str | None = None):
        from dflash_pipeline.data.chat_masking import ChatMasker

        t0 = time.perf_counter()
        tokenizer = load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
        try:  # a missing or broken template fails here, before any shard is read
            self.masker = ChatMasker(tokenizer, enable_thinking=enable_thinking, max_length=max_length)
        except ValueError as exc:
            raise PipelineError(f"{model_dir}: {exc} (tokenize renders conversations with the target's "
                                "chat template: tokenizer_config.json 'chat_template' or chat_template.jinja)") from None
        except TEMPLATE_ERRORS as exc:
            raise PipelineError(f"{model_dir}: the chat template fails on a plain user/assistant exchange "
                                f"({type(exc).__name__}: {exc})") from None
        self.pattern = control_token_pattern(tokenizer)
        self.batch_size, self.trivial_tokens = batch_size, trivial_tokens
        self.turn_samples = turn_samples or settings.default("tokenize.turn_samples")
        self.settings = {"max_length": max_length, "enable_thinking": enable_thinking, "trivial_tokens": trivial_tokens,
                         "model": model_dir, "closing": self.masker.closing, "turn_samples": self.turn_samples}
        self.load_seconds = time.perf_counter() - t0

    def shard(self, input_path: str, out_tokens: str, out_audit: str, progress: Progress | None = None) -> dict:
        t0 = time.perf_counter()
        raw = read_conversations(input_path)
        # completions: the assistant turns were written by the target itself, not by a user who could forge turns
        trusted = frozenset({"assistant"}) if "status" in raw.column_names else frozenset()
        table, failed = successful_rows(raw)
        audit = ShardAudit(self.trivial_tokens)
        ids, parts = table.column("sample_id").to_pylist(), []
        token_ids = token_id_columns(table)  # regenerated rows: the target's own ids, no text round trip
        tools = ([sample_tools({"tools": t}) for t in table.column("tools").to_pylist()]
                 if "tools" in table.column_names else [None] * table.num_rows)  # shards from before tools: none
        for lo in range(0, table.num_rows, self.batch_size):
            conversations = table.column("messages").slice(lo, self.batch_size).to_pylist()
            for k, messages in enumerate(conversations):
                check_conversation(input_path, lo + k, ids[lo + k], messages)
            rows = list(zip(ids[lo:lo + self.batch_size], conversations, token_ids[lo:lo + self.batch_size],
                            tools[lo:lo + self.batch_size]))
            if self.turn_samples == "every":  # one row per generated turn (generated_tokens.turn_rows)
                rows = [(sid, msgs, t, tl) for sid0, m0, t0, tl in rows for sid, msgs, t in turn_rows(sid0, m0, t0)]
                audit.counts["earlier_turn_samples"] += len(rows) - len(conversations)
            part = _encode_batch(self.masker, [r[0] for r in rows], [r[1] for r in rows], audit, self.pattern,
                                 trusted, [r[2] for r in rows], [r[3] for r in rows])
            if part is not None:
                parts.append(part)
            if progress:
                progress.update(len(conversations))
        if progress and raw.num_rows > table.num_rows:
            progress.update(raw.num_rows - table.num_rows)  # failed generations: read, not tokenized
        tokens = pa.concat_tables(parts) if parts else TOKENS_SCHEMA.empty_table()
        with atomic_path(out_tokens) as tmp:
            pq.write_table(tokens, tmp, compression="zstd")
        summary = {"format": AUDIT_FORMAT, "input": os.path.basename(input_path), **audit.to_json(),
                   "generation_failed": sum(failed.values()), "generation_failure_reasons": dict(failed.most_common()),
                   "settings": self.settings, "seconds": round(time.perf_counter() - t0, 3),
                   "tokenizer_load_seconds": round(self.load_seconds, 3)}
        write_json(out_audit, summary, indent=None)
        log.info("%s: %d samples, %d tokens (%d supervised) in %.2fs", input_path, summary["samples"],
                 summary["tokens"], summary["loss_tokens"], summary["seconds"])
        return summary


def tokenize_shard(input_path: str, model_dir: str, out_tokens: str, out_audit: str, max_length: int,
                   enable_thinking: bool = True, batch_size: int = 256, trivial_tokens: int = 6,
                   trust_remote_code: bool = False) -> dict:
    return ShardTokenizer(model_dir, max_length, enable_thinking, batch_size, trivial_tokens,
                          trust_remote_code).shard(input_path, out_tokens, out_audit)


def shard_name(path: str) -> str:
    return os.path.basename(path).removesuffix(".parquet")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, help="ingested or completions shard(s) (Parquet)")
    p.add_argument("--model", required=True, help="target model directory (tokenizer + chat template)")
    p.add_argument("--out", help="token shard (one --input)")
    p.add_argument("--audit", help="the shard's audit (one --input)")
    p.add_argument("--out-dir", help="several --input: write NAME.parquet and NAME.audit.json here")
    p.add_argument("--max-length", type=int)
    p.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--trivial-tokens", type=int)
    p.add_argument("--trust-remote-code", action="store_true", default=None)
    p.add_argument("--turn-samples", choices=["last", "every"],
                   help="regenerated conversations: one sample per conversation (last) or per generated turn (every)")


def _outputs(args) -> list[tuple[str, str, str]]:
    if args.out_dir:
        return [(i, os.path.join(args.out_dir, f"{shard_name(i)}.parquet"),
                 os.path.join(args.out_dir, f"{shard_name(i)}.audit.json")) for i in args.input]
    if len(args.input) != 1 or not args.out or not args.audit:
        raise PipelineError("tokenize: give --out and --audit for one --input, or --out-dir for several")
    return [(args.input[0], args.out, args.audit)]


def run(args) -> int:
    jobs = _outputs(args)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
    tok = ShardTokenizer(args.model, args.max_length, args.enable_thinking, args.batch_size, args.trivial_tokens,
                         args.trust_remote_code, args.turn_samples)
    total = sum(_row_count(input_path) for input_path, _, _ in jobs)
    progress = Progress(f"tokenize ({len(jobs)} shard{'s' if len(jobs) > 1 else ''})", total, "samples", log)
    for input_path, out, audit_path in jobs:
        audit = tok.shard(input_path, out, audit_path, progress)
        print(json.dumps({"input": input_path, **{k: audit[k] for k in ("samples", "tokens", "loss_tokens", "seconds")}}))
    progress.finish()
    return 0

