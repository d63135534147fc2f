"""Decode a whole prompt set: length-sorted batches of the batched decoder, or one prompt at a time for targets
it does not support (drafter/batched_decoding.py `supports_batched`)."""

from __future__ import annotations

import logging

import torch

from dflash_pipeline.drafter.batched_decoding import BatchDecoder, RowOutput, supports_batched
from dflash_pipeline.drafter.batched_rules import BATCHED_GREEDY

log = logging.getLogger("dflash_pipeline.drafter.decode_sets")


def decode_all(target, prompts: list[list[int]], max_new: int, stop_ids, *, drafter=None, head=None,
               rule=BATCHED_GREEDY, seed: int = 0, batch_size: int = 32, graphs: bool = True
               ) -> tuple[list[RowOutput], dict]:
    """Every prompt's output (in the given order) and the time it took: {decode_seconds (prefill + steps),
    setup_seconds (allocation, graph capture), batches, logits_dtype}. Row i draws its randomness as uid i."""
    if not supports_batched(target):
        return _one_by_one(target, prompts, max_new, stop_ids, drafter, head, rule, seed)
    order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))  # similar lengths share a batch
    rows: list[RowOutput | None] = [None] * len(prompts)
    timing = {"decode_seconds": 0.0, "setup_seconds": 0.0, "batches": 0, "logits_dtype": None}
    for lo in range(0, len(order), max(1, batch_size)):
        chunk = order[lo: lo + max(1, batch_size)]
        run = BatchDecoder(target, [prompts[i] for i in chunk], max_new, stop_ids, drafter=drafter, head=head,
                           rule=rule, seed=seed, uids=chunk, graphs=graphs).run()
        for i, row in zip(chunk, run.rows):
            rows[i] = row
        timing["decode_seconds"] += run.decode_seconds
        timing["setup_seconds"] += run.setup_seconds
        timing["batches"] += 1
        timing["logits_dtype"] = str(run.logits_dtype).replace("torch.", "")
    return rows, timing


def _one_by_one(target, prompts, max_new, stop_ids, drafter, head, rule, seed) -> tuple[list[RowOutput], dict]:
    """The one-prompt path (transformers caches); greedy records the gap only, so every divergence is strict."""
    import time

    from dflash_pipeline.drafter.speculative import (GREEDY, SpeculativeSampling, greedy_generate,
                                                     speculative_generate)

    device = next(target.parameters()).device
    log.info("target %s is not supported by the batched decoder: decoding one prompt at a time",
             type(target).__name__)
    one = GREEDY if rule.temperature == 0 else SpeculativeSampling(
        rule.temperature, torch.Generator(device=device).manual_seed(seed))
    t0 = time.perf_counter()
    rows = []
    for p in prompts:
        if drafter is None:
            tokens, gaps = greedy_generate(target, p, max_new, set(stop_ids), device)
            rows.append(RowOutput(tokens, gap=gaps))
        else:
            tokens, accepted = speculative_generate(target, drafter, head, p, max_new, set(stop_ids), device, one)
            rows.append(RowOutput(tokens, accepted))
    dtype = str(next(target.parameters()).dtype).replace("torch.", "")
    return rows, {"decode_seconds": time.perf_counter() - t0, "setup_seconds": 0.0, "batches": len(prompts),
                  "logits_dtype": dtype}
