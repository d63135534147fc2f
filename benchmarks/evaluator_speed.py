"""Evaluator speed at the SmolLM2-135M target shape (random weights, bf16): the old one-prompt path (on a subset,
extrapolated to all prompts) vs the batched evaluator (eager and CUDA-graph captured), greedy and T=0.7, and
the batch-1 speedup of speculative over plain greedy decoding (both captured). A random drafter accepts ~nothing
(tau ~1): the most steps per token, the worst case. `--tiny`: a tiny shape on CPU (a smoke test).

    PYTHONPATH=scripts python3 benchmarks/evaluator_speed.py --json out.json [--tiny]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def build(tiny: bool, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_pipeline.drafter.config import DrafterConfig
    from dflash_pipeline.drafter.model import DFlashDrafter
    from dflash_pipeline.drafter.target_head import TargetHead
    from dflash_pipeline.target_layers import default_target_layer_ids

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512) if tiny else dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        vocab_size=49152)
    cfg = LlamaConfig(**shape, max_position_embeddings=8192, rope_theta=100000, tie_word_embeddings=True,
                      rms_norm_eps=1e-5)
    dtype = torch.float32 if tiny else torch.bfloat16
    torch.manual_seed(0)
    target = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    head = TargetHead(target.model.embed_tokens.weight.detach().clone(), None).to(device)
    ids = default_target_layer_ids(cfg.num_hidden_layers, 5 if not tiny else 2)
    dcfg = DrafterConfig.from_target(cfg.to_dict(), len(ids), ids, 16 if not tiny else 4, 16, cfg.vocab_size)
    drafter = DFlashDrafter(dcfg).to(device=device, dtype=dtype).eval()
    return target, head, drafter


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def main() -> None:
    from dflash_pipeline.drafter.batched_rules import BatchedSampling
    from dflash_pipeline.drafter.decode_sets import decode_all
    from dflash_pipeline.drafter.evaluate import speedup_at_batch_1
    from dflash_pipeline.drafter.speculative import GREEDY, SpeculativeSampling, greedy_generate, speculative_generate

    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--json", default="")
    ap.add_argument("--prompts", type=int, default=80)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--old-subset", type=int, default=1)
    a = ap.parse_args()
    if a.tiny:
        a.prompts, a.new = 6, 16
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    target, head, drafter = build(a.tiny, device)
    g = torch.Generator().manual_seed(0)  # MT-Bench-like first-turn lengths (chat template included)
    lens = (torch.randn(a.prompts, generator=g) * 0.6 + 4.6).exp().clamp(20, 700).long().tolist()
    vocab = target.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
    rows, res = [], {"prompts": a.prompts, "new_tokens": a.new, "prompt_lengths": lens, "device": str(device)}
    k = a.old_subset
    _, t_plain = timed(lambda: [greedy_generate(target, p, a.new, set(), device) for p in prompts[:k]])
    _, t_g = timed(lambda: [speculative_generate(target, drafter, head, p, a.new, set(), device, GREEDY)
                            for p in prompts[:k]])
    gen = torch.Generator(device=device).manual_seed(0)
    _, t_s = timed(lambda: [speculative_generate(target, drafter, head, p, a.new, set(), device,
                                                 SpeculativeSampling(0.7, gen)) for p in prompts[:k]])
    scale = a.prompts / k
    rows.append((f"old one-prompt path ({k} prompt(s), x{scale:.0f})", t_plain * scale, t_g * scale, t_s * scale))
    for name, graphs in (("batched, eager", False), ("batched, CUDA graphs", True)):
        if graphs and device.type != "cuda":
            continue
        (_, tp), wp = timed(lambda: decode_all(target, prompts, a.new, set(), batch_size=a.prompts, graphs=graphs))
        (_, tg), wg = timed(lambda: decode_all(target, prompts, a.new, set(), drafter=drafter, head=head,
                                               batch_size=a.prompts, graphs=graphs))
        (_, ts), ws = timed(lambda: decode_all(target, prompts, a.new, set(), drafter=drafter, head=head,
                                               rule=BatchedSampling(0.7), batch_size=a.prompts, graphs=graphs))
        rows.append((f"{name} (batch {a.prompts}; setup+capture incl.)", wp, wg, ws))
    res["speedup_batch1"] = speedup_at_batch_1(target, drafter, head, [{"prompt": p} for p in prompts[:4]], a.new,
                                               set(), graphs=True)
    res["rows"] = [dict(zip(("variant", "plain_greedy_s", "spec_greedy_s", "spec_t0.7_s"), r)) for r in rows]
    print(f"\n{a.prompts} prompts x {a.new} new tokens, random drafter (tau ~1), {device}")
    print(f"{'variant':52s} {'plain greedy':>13s} {'spec greedy':>12s} {'spec T=0.7':>11s} {'per drafter':>12s}")
    for name, p, gr, s in rows:
        print(f"{name:52s} {p:12.1f}s {gr:11.1f}s {s:10.1f}s {gr + s:11.1f}s")
    s1 = res["speedup_batch1"]
    print(f"batch 1 (4 prompts, captured): plain {s1['plain_tokens_per_s']:.0f} tok/s, speculative "
          f"{s1['speculative_tokens_per_s']:.0f} tok/s, speedup {s1['speedup']:.2f}x at tau {s1['tau']:.2f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
