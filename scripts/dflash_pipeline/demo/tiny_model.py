"""A tiny, randomly initialised Qwen3 target with a real byte-level BPE tokenizer and chat template.

Nothing can be downloaded from a model hub here, so the demo and the tests build their target: a
tokenizer trained on the demo corpus (special tokens <|im_start|>, <|im_end|>, <think>, </think>; the
tool-calling markup <tool_call>, </tool_call>, <tool_response>, </tool_response> one token each), the
project's Qwen3-style chat template, and `Qwen3ForCausalLM` from a small config with a fixed seed.
The embedding has spare rows past the tokenizer's vocabulary; the last one is the drafter's mask token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# tool-calling markup, one token each and not special (as in Qwen3's vocabulary): text may hold them
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")


def chat_template() -> str:
    return TEMPLATE_PATH.read_text(encoding="utf-8")


def render_for_corpus(messages: list[dict], tools: list[dict] | None) -> str:
    """A conversation as the chat template renders it (jinja2 set up as transformers does), without the special
    tokens: tokenizer training text for the template's markup."""
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False)
    text = env.from_string(chat_template()).render(messages=messages, tools=tools, add_generation_prompt=False)
    for token in SPECIAL_TOKENS + TOOL_TOKENS:
        text = text.replace(token, " ")
    return text


def build_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens(TOOL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<think>", "</think>"],
    )
    fast.chat_template = chat_template()
    return fast


def build_model(vocab_size: int, args, seed: int, eos_token_id: int | None = None, pad_token_id: int | None = None):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.hidden_size // args.num_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        eos_token_id=eos_token_id,  # generation stops at the end of an assistant turn (<|im_end|>)
        pad_token_id=pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.eval()
    return model


def pretrain(model, tokenizer, steps: int, seed: int, seq_len: int = 256, batch: int = 4, lr: float = 3e-3,
             tool_share: float = 0.1) -> float:
    """A few hundred CPU steps of next-token training on chat-rendered demo conversations (`tool_share` of them
    tool-calling ones: the call, the tool's result and the answer, as the template renders them with the tools).

    A randomly initialised target answers with noise that no drafter can predict; a briefly trained one
    answers in the demo's patterns, as a real model answers in its own, so the demo's drafter has something
    to learn and its acceptance length means something. Windows of 256 tokens: a tool-calling prompt (tools
    header and schema, ~170 tokens) and its call fit in one (in 128-token windows the target never saw a call
    that far from the prompt's start and answered tool prompts with noise). Returns the final loss.
    """
    import random

    import torch

    from dflash_pipeline.demo.data import chat_messages, make_conversation, make_tool_conversation

    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < steps * batch * seq_len // 3:  # ~3 passes over the corpus
        # `tool_share` of the conversations call a tool, rendered with the tools listed in the system turn, so
        # that the target answers a prompt listing tools with a <tool_call> (what the demo's tool records teach)
        tool = rng.random() < tool_share
        msgs, tools = chat_messages(make_tool_conversation(rng) if tool else make_conversation(rng, 0.0))
        ids += tokenizer.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=True)["input_ids"]
    data = torch.tensor(ids, dtype=torch.long)
    n_windows = (len(data) - 1) // seq_len
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        starts = torch.randint(0, n_windows, (batch,), generator=gen) * seq_len
        x = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()
    return float(loss)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="model directory to write")
    p.add_argument("--vocab-size", type=int, default=2048, help="tokenizer vocabulary (BPE merges)")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--intermediate-size", type=int, default=384)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pretrain-steps", type=int,
                   help="CPU training steps on the demo corpus so the target answers in patterns (0: random)")


def run(args) -> int:
    from dflash_pipeline.demo.data import corpus_texts
    from dflash_pipeline.storage import atomic_dir

    tokenizer = build_tokenizer(corpus_texts(), args.vocab_size)
    # spare embedding rows past the tokenizer (rounded up to 64): the last is the drafter's mask token
    embed_rows = ((len(tokenizer) + 1 + 63) // 64) * 64
    model = build_model(embed_rows, args, args.seed, tokenizer.eos_token_id, tokenizer.pad_token_id)
    if args.pretrain_steps:
        import time

        t0 = time.perf_counter()
        loss = pretrain(model, tokenizer, args.pretrain_steps, args.seed)
        print(f"pretrained {args.pretrain_steps} steps in {time.perf_counter() - t0:.1f}s, final loss {loss:.3f}")
    with atomic_dir(args.out) as tmp:
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp, safe_serialization=True)
        (Path(tmp) / "demo_target.json").write_text(
            json.dumps({"mask_token_id": embed_rows - 1, "tokenizer_vocab": len(tokenizer)}, indent=2)
        )
    print(f"tiny target written to {args.out}: vocab {len(tokenizer)}, embedding rows {embed_rows}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    return 0
