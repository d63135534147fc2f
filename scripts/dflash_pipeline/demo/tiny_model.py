"""A tiny, randomly initialised Qwen3 target with a real byte-level BPE tokenizer and chat template.

Nothing can be downloaded from a model hub here, so the demo and the tests build their target: a
tokenizer trained on the demo corpus (special tokens <|im_start|>, <|im_end|>, <think>, </think>), the
project's Qwen3-style chat template, and `Qwen3ForCausalLM` from a small config with a fixed seed.
The embedding has spare rows past the tokenizer's vocabulary; the last one is the drafter's mask token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")


def chat_template() -> str:
    return TEMPLATE_PATH.read_text(encoding="utf-8")


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


def pretrain(model, tokenizer, steps: int, seed: int, seq_len: int = 128, batch: int = 8, lr: float = 3e-3) -> float:
    """A few hundred CPU steps of next-token training on chat-rendered demo conversations.

    A randomly initialised target answers with noise that no drafter can predict; a briefly trained one
    answers in the demo's patterns, as a real model answers in its own, so the demo's drafter has something
    to learn and its acceptance length means something. Returns the final loss.
    """
    import random

    import torch

    from dflash_pipeline.demo.data import make_conversation

    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < steps * batch * seq_len // 3:  # ~3 passes over the corpus
        turns = make_conversation(rng, placeholder_rate=0.0)
        msgs = [{"role": r, "content": t} for r, t in turns]
        ids += tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
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
    p.add_argument("--pretrain-steps", type=int, default=0,
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
