"""Training samples of regenerated conversations straight from the target's own token ids.

The generate stage stores, per sample, `output_ids` (per generated assistant turn, the exact ids the target
emitted: thinking, answer and the end token) and `prompt_ids` (the ids of the last generated turn's prompt,
as the engine fed them to the target). The training sequence is `prompt_ids + output_ids[-1]`: exactly the
stream the target produced. Rendering the text again through the chat template and re-encoding it would
not give it back: a byte-level BPE encodes a decoded string canonically, while a model may emit any
segmentation ("Hello" as "Hel" + "lo"), the reasoning parser strips and re-joins the think block, and the
template rewrites whitespace around it. A drafter trained on the re-encoded stream learns a stream its
target never produces.

Loss mask: every output id of the last generated turn, thinking included. With thinking on, the target's
own thinking tokens are what the drafter is asked to draft at inference, so they are trained like the
answer; the end token (`<|im_end|>`) is trained too (the drafter must predict the stop). The prompt,
including earlier turns of a `turns: all` conversation (which the template re-renders, Qwen3 without their
thinking, so they are not the ids the target emitted) is context only.

Rows without ids (a backend that returned none) fall back to the text rendering of the chat masker.

`tokenize.turn_samples: every` makes one sample of each generated turn (`turn_rows`): turn k's exact stream is
`turn_prompt_ids[k] + output_ids[k]` (the completions store every turn's prompt ids), supervised on its output,
under the ids `sample_ids.py` gives. A row without per-turn prompt ids (an engine that reported none, a journal
from before the column) gives its last turn only.
"""

from __future__ import annotations

from dflash_pipeline.data.chat_masking import MaskedSample
from dflash_pipeline.sample_ids import turn_sample_id


def token_id_columns(table) -> list[tuple[list[int], list[list[int]], list | None] | None]:
    """Per row of a completions table: (prompt_ids, output_ids per turn, prompt ids per turn or None), or None
    without ids."""
    names = table.column_names
    if "output_ids" not in names or "prompt_ids" not in names:
        return [None] * table.num_rows
    prompts, outputs = table.column("prompt_ids").to_pylist(), table.column("output_ids").to_pylist()
    turns = (table.column("turn_prompt_ids").to_pylist() if "turn_prompt_ids" in names
             else [None] * table.num_rows)
    return [(p, o, t if t and len(t) == len(o) else None) if p is not None and o else None
            for p, o, t in zip(prompts, outputs, turns)]


def turn_rows(sample_id: str, messages: list[dict], ids) -> list[tuple[str, list[dict], tuple]]:
    """`turn_samples: every`: the row as one (sample id, messages up to that turn, ids) per generated turn; the
    row unchanged when it has one turn, no per-turn prompt ids, or fewer assistant messages than turns."""
    if ids is None or ids[2] is None or len(ids[1]) < 2:
        return [(sample_id, messages, ids)]
    prompts, outputs = ids[2], ids[1]
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(answers) < len(outputs):
        return [(sample_id, messages, ids)]
    generated, last = answers[len(answers) - len(outputs):], len(outputs) - 1  # the generated turns come last
    return [(turn_sample_id(sample_id, k, last), messages[:generated[k] + 1],
             (prompts[k], outputs[:k + 1], None)) for k in range(len(outputs))]


def sample_from_ids(prompt_ids: list[int], output_ids: list[list[int]], closing_ids: list[int],
                    max_length: int | None) -> MaskedSample:
    """The exact stream prompt + last turn's output, supervised on the output (see the module docstring)."""
    last = list(output_ids[-1])
    ids = list(prompt_ids) + last
    mask = [0] * len(prompt_ids) + [1] * len(last)
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        ids, mask = ids[:max_length], mask[:max_length]
    closing_found = bool(closing_ids) and last[-len(closing_ids):] == closing_ids
    return MaskedSample(input_ids=ids, loss_mask=mask, text="", spans=[], turn_tokens=[len(last)],
                        truncated=truncated, closing_found=closing_found)


def encode_conversations(masker, conversations: list[list[dict]], token_ids: list | None,
                         tools: list | None = None) -> list[MaskedSample]:
    """Samples for a batch: from the target's ids where the row has them, else from the rendered text
    (`tools`: per conversation its tool schemas or None, for the template)."""
    tools = tools or [None] * len(conversations)
    if not token_ids or all(t is None for t in token_ids):
        return masker.encode(conversations, tools)
    closing = masker.tokenizer.encode(masker.closing, add_special_tokens=False) if masker.closing else []
    by_text = [(c, tl) for c, t, tl in zip(conversations, token_ids, tools) if t is None]
    rendered = iter(masker.encode([c for c, _ in by_text], [tl for _, tl in by_text]) if by_text else [])
    return [next(rendered) if t is None else sample_from_ids(t[0], t[1], closing, masker.max_length)
            for t in token_ids]
