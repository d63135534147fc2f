"""Assistant-only loss masks, checked token by token against the rendered text, for several templates."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from data_fixtures import supervised_runs
from dflash_pipeline.data.chat_masking import ChatMasker


@pytest.fixture(scope="module")
def tokenizer(tiny_target):
    return AutoTokenizer.from_pretrained(tiny_target)


def check_partition(tokenizer, sample):
    """Every token is in the text once: masked + unmasked decode back to the rendered text."""
    assert tokenizer.decode(sample.input_ids) == sample.text
    assert len(sample.input_ids) == len(sample.loss_mask)


MULTI_TURN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "5.", "reasoning_content": "Two plus three."},
    {"role": "user", "content": "Double it?"},
    {"role": "assistant", "content": "It is 10.", "reasoning_content": "Five times two."},
]


def test_multi_turn_thinking_exact(tokenizer):
    sample = ChatMasker(tokenizer, enable_thinking=True).encode([MULTI_TURN])[0]
    check_partition(tokenizer, sample)
    # earlier turn: thinking dropped by the template, answer + end-of-turn supervised;
    # last turn: the think block is part of what the model generates
    assert supervised_runs(tokenizer, sample) == [
        "5.<|im_end|>",
        "<think>\nFive times two.\n</think>\n\nIt is 10.<|im_end|>",
    ]
    assert "Two plus three" not in sample.text
    assert sample.closing_found and sample.turn_tokens == [sum(1 for _ in tokenizer("5.<|im_end|>").input_ids),
                                                          sum(sample.loss_mask) - len(tokenizer("5.<|im_end|>").input_ids)]


def test_thinking_inline_in_content_and_disabled(tokenizer):
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!"}]
    on = ChatMasker(tokenizer, enable_thinking=True).encode([conv])[0]
    assert supervised_runs(tokenizer, on) == ["<think>\nhmm\n</think>\n\nHello!<|im_end|>"]
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    off = ChatMasker(tokenizer, enable_thinking=False).encode([plain])[0]
    # with thinking off the empty think block is part of the prompt (the generation prompt carries it)
    assert supervised_runs(tokenizer, off) == ["Hello!<|im_end|>"]
    assert "<think>\n\n</think>\n\n" in off.text


def test_conversation_ending_with_user_and_truncation(tokenizer):
    conv = MULTI_TURN[:4]
    sample = ChatMasker(tokenizer).encode([conv])[0]
    assert supervised_runs(tokenizer, sample) == ["5.<|im_end|>"]
    short = ChatMasker(tokenizer, max_length=12).encode([MULTI_TURN])[0]
    assert short.truncated and len(short.input_ids) == 12 == len(short.loss_mask)
    full = ChatMasker(tokenizer).encode([MULTI_TURN])[0]
    assert short.input_ids == full.input_ids[:12] and short.loss_mask == full.loss_mask[:12]


def test_content_that_repeats_the_prompt(tokenizer):
    """An answer equal to the question (or to the header text) is still located by rendering."""
    conv = [{"role": "user", "content": "assistant"}, {"role": "assistant", "content": "assistant"},
            {"role": "user", "content": "OK."}, {"role": "assistant", "content": "OK."}]
    sample = ChatMasker(tokenizer).encode([conv])[0]
    check_partition(tokenizer, sample)
    assert supervised_runs(tokenizer, sample) == ["assistant<|im_end|>", "<think>\n\n</think>\n\nOK.<|im_end|>"]


LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
GENERATION_TAGGED = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_other_template_llama3_style(tiny_target):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|bos|>"]})
    tok.bos_token = "<|bos|>"
    tok.chat_template = LLAMA3_STYLE
    masker = ChatMasker(tok)
    assert masker.closing == "<|eot_id|>"
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": " padded question "},
            {"role": "assistant", "content": "  An answer.  "}, {"role": "user", "content": "Next"},
            {"role": "assistant", "content": "Second."}]
    sample = masker.encode([conv])[0]
    assert supervised_runs(tok, sample) == ["An answer.<|eot_id|>", "Second.<|eot_id|>"]


def test_matches_transformers_generation_mask(tiny_target):
    """On a template with {% generation %} markers, our mask equals transformers' own assistant mask."""
    tok = AutoTokenizer.from_pretrained(tiny_target)
    tok.chat_template = GENERATION_TAGGED
    conv = [{"role": "system", "content": "Sys"}, {"role": "user", "content": "Question one"},
            {"role": "assistant", "content": "Answer one, longer."}, {"role": "user", "content": "Two?"},
            {"role": "assistant", "content": "Answer two."}]
    ref = tok.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ours = ChatMasker(tok).encode([conv])[0]
    assert ours.input_ids == list(ref["input_ids"])
    assert ours.loss_mask == list(ref["assistant_masks"])
    assert sum(ours.loss_mask) > 0


def test_batch_equals_single(tokenizer):
    masker = ChatMasker(tokenizer)
    convs = [MULTI_TURN, MULTI_TURN[:3], [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]]
    batch = masker.encode(convs)
    for conv, got in zip(convs, batch):
        single = masker.encode([conv])[0]
        assert (got.input_ids, got.loss_mask) == (single.input_ids, single.loss_mask)
