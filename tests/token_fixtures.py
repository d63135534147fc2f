"""Test data: token shards whose responses are the tiny target's own greedy continuations."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM

from dflash_pipeline.storage import atomic_path


def write_greedy_token_shard(model_dir: str, out: str, num_samples: int, prompt_len: int = 24,
                             new_tokens: int = 48, seed: int = 0, prefix: str = "greedy",
                             suffix_len: int = 4) -> None:
    """A token shard whose responses are the target's own greedy continuations of random prompts.

    For tests and benchmarks: the same kind of data the generate stage produces (the target's own output),
    without the ingest/generate stages. Columns follow the token-shard contract.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest on shared cores
    try:
        target = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        ids = _greedy_rollouts(target, num_samples, prompt_len, new_tokens, seed, suffix_len)
    finally:
        torch.set_num_threads(threads)
    rows = {"sample_id": [], "input_ids": [], "loss_mask": [], "length": [], "num_loss_tokens": [], "truncated": []}
    for i in range(num_samples):
        seq = ids[i].tolist()
        mask = [0] * prompt_len + [1] * new_tokens
        rows["sample_id"].append(f"{prefix}-{i:05d}")
        rows["input_ids"].append(seq)
        rows["loss_mask"].append(mask)
        rows["length"].append(len(seq))
        rows["num_loss_tokens"].append(new_tokens)
        rows["truncated"].append(False)
    schema = pa.schema([("sample_id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8())), ("length", pa.int32()),
                        ("num_loss_tokens", pa.int32()), ("truncated", pa.bool_())])
    with atomic_path(out, suffix=".parquet") as tmp:
        pq.write_table(pa.table(rows, schema=schema), tmp)


def _greedy_rollouts(target, num_samples, prompt_len, new_tokens, seed, suffix_len) -> torch.Tensor:
    vocab = int(target.config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, min(vocab, 1000), (num_samples, prompt_len), generator=g)
    # a fixed prompt ending shared by all samples, like a chat template's assistant header
    suffix = torch.randint(0, min(vocab, 1000), (suffix_len,), generator=torch.Generator().manual_seed(12345))
    if suffix_len:
        prompts[:, -suffix_len:] = suffix
    ids = prompts
    past = None
    step_in = prompts
    with torch.no_grad():
        for _ in range(new_tokens):  # batched greedy decoding with the KV cache
            o = target(input_ids=step_in, past_key_values=past, use_cache=True)
            past = o.past_key_values
            step_in = o.logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, step_in], dim=1)
    return ids


def train_two_steps(model_dir, shard, out, checkpoint_dir, *extra) -> int:
    """The train command on a token shard: online, a 1-layer drafter (block 8, 4 anchors), 2 steps of 4 samples,
    a checkpoint each step, nothing held out; `extra`: the options under test."""
    from dflash_pipeline.cli import main as cli_main

    return cli_main(["train", "--mode", "online", "--inputs", str(shard), "--model", str(model_dir), "--out", str(out),
                     "--checkpoint-dir", str(checkpoint_dir), "--num-layers", "1", "--block-size", "8",
                     "--num-anchors", "4", "--batch-size", "4", "--max-steps", "2", "--checkpoint-every", "1",
                     "--log-every", "1", "--max-length", "48", "--holdout-fraction", "0", *map(str, extra)])
