"""Kernels a decoding step dispatches, plain greedy against speculative, by part (batched evaluator, batch 1).

At batch 1 on a small target the step runs as one CUDA graph whose nodes are tiny kernels: their number, not
their FLOPs, sets the step's time (a 135M target's 30 layers take ~3.8 ms a token on an H100, ~5 us a kernel).
This counts the ATen kernels each step dispatches (views and allocations excluded), on any device, so a change
to the drafter's or the verification's code can be weighed on a CPU before a GPU times it. Parts of the
speculative step: the drafter's forward, its LM head, the target's verification forward and the rest
(proposal, acceptance, caches, bookkeeping). Shape: SmolLM2-135M (random weights; `--tiny`: a tiny one).

    PYTHONPATH=scripts:benchmarks python3 benchmarks/decode_step_kernels.py [--tiny] [--prompt 200]
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NOT_KERNELS = {"detach", "empty", "empty_strided", "lift_fresh", "alias", "_local_scalar_dense", "_unsafe_view",
               "set_", "resize_"}


class KernelCount(TorchDispatchMode):
    """Counts dispatched ATen ops that launch work, under the label of the part that is running."""

    def __init__(self):
        super().__init__()
        self.part = "rest"
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NOT_KERNELS:
            self.counts[self.part][name] += 1
        return func(*args, **(kwargs or {}))


def label(module: torch.nn.Module, mode: KernelCount, part: str) -> list:
    """Hooks that put `module`'s forward under `part` (the outer part again after it)."""
    outer: list[str] = []

    def pre(*_):
        outer.append(mode.part)
        mode.part = part

    def post(*_):
        mode.part = outer.pop()

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


def step_counts(decoder, parts: dict[str, torch.nn.Module]) -> dict[str, collections.Counter]:
    """One decoding step's kernels by part, after the prefill and one step (caches and graphs warm)."""
    with torch.no_grad():
        decoder._prefill()
        decoder.step()
        mode = KernelCount()
        hooks = [h for part, module in parts.items() for h in label(module, mode, part)]
        try:
            with mode:
                decoder.step()
        finally:
            for h in hooks:
                h.remove()
    return dict(mode.counts)


def main(argv=None) -> dict:
    from evaluator_speed import build

    from dflash_pipeline.drafter.batched_decoding import BatchDecoder

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--prompt", type=int, default=200, help="prompt tokens (the caches' length follows)")
    ap.add_argument("--top", type=int, default=6, help="the most frequent kernels listed per part")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    target, head, drafter = build(a.tiny, torch.device("cpu"))
    target, head, drafter = target.float(), head.float(), drafter.float()  # bf16 matmuls are slow on a CPU
    prompt = [[5 + (i * 37) % (target.config.vocab_size - 5) for i in range(a.prompt)]]
    new = 16
    plain = step_counts(BatchDecoder(target, prompt, new, set(), graphs=False), {"target forward": target})
    spec = step_counts(BatchDecoder(target, prompt, new, set(), drafter=drafter, head=head, graphs=False),
                       {"target forward": target, "drafter forward": drafter, "drafter LM head": head.lm_head})
    parts = ["drafter forward", "drafter LM head", "target forward", "rest"]
    total = {k: sum(sum(c.values()) for c in v.values()) for k, v in (("plain", plain), ("spec", spec))}
    print(f"kernels per decoding step, batch 1, prompt {a.prompt} tokens, block {drafter.config.block_size}, "
          f"{'tiny' if a.tiny else 'SmolLM2-135M'} shape\n")
    print(f"{'part':<16} | {'plain':>6} | {'spec':>6} | most frequent in the speculative step")
    print(f"{'-' * 16}-+-{'-' * 6}-+-{'-' * 6}-+-{'-' * 40}")
    for part in parts:
        p, s = sum(plain.get(part, {}).values()), sum(spec.get(part, {}).values())
        top = ", ".join(f"{k} {v}" for k, v in spec.get(part, collections.Counter()).most_common(a.top))
        print(f"{part:<16} | {p:>6} | {s:>6} | {top}")
    print(f"{'step':<16} | {total['plain']:>6} | {total['spec']:>6} | spec / plain {total['spec'] / total['plain']:.2f}x")
    return {"plain": {k: dict(v) for k, v in plain.items()}, "spec": {k: dict(v) for k, v in spec.items()},
            "total": total}


if __name__ == "__main__":
    main()
