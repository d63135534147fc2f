"""`labels: distill`'s cost, and what reading each position's target distribution once saves, side by side.

One training step of the DFlash drafter (block_loss forward + backward, clip, AdamW; flex attention and bf16
autocast on a GPU, as `dflash-pipeline train` runs it) at the SmolLM2-135M shape of the recipe runs (hidden 576,
vocab 49,152, 5 layers, block 16, 512 anchors, 4 sequences of ShareGPT-turn lengths) or Qwen3-8B's (`--shape
qwen3-8b`), random weights, features and target hidden states (the target's own forward is the same for every
variant and left out). Variants:
- hard:      data labels, chunked head CE (two head matmuls per scored token)
- soft:      the target's distribution per scored token (a third head matmul for every scored token: a position
             scored by ~13 overlapping blocks runs the head ~13 times)
- soft-once: the same soft CE with each position's distribution computed once per chunk (batch.soft_rows)
Checks first that soft and soft-once give the same loss, then prints ms per step, tokens/s and the ratios.

    PYTHONPATH=scripts:benchmarks python3 benchmarks/distill_head_speed.py [--shape qwen3-8b] [--steps 20]
    PYTHONPATH=scripts:benchmarks python3 benchmarks/distill_head_speed.py --tiny --device cpu   # smoke test
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from dflash_pipeline.drafter.batch import collate, sample_anchors, with_scored_index
from dflash_pipeline.drafter.config import DrafterConfig
from dflash_pipeline.drafter.loss import block_loss
from dflash_pipeline.drafter.model import DFlashDrafter
from dflash_pipeline.drafter.target_head import TargetHead

SHAPES = {  # target config fields the drafter reads, and the target layers it taps
    "smollm2-135m": (dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                          head_dim=64, num_hidden_layers=30, vocab_size=49152, rope_theta=100000.0),
                     [1, 8, 15, 22, 28]),
    "qwen3-8b": (dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, num_hidden_layers=36, vocab_size=151936, rope_theta=1_000_000.0),
                 [1, 9, 17, 25, 33]),
    "tiny": (dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_hidden_layers=4, vocab_size=500, rope_theta=10000.0), [0, 3]),
}
VARIANTS = ("hard", "soft", "soft-once")


def drafter_config(shape: str, layers: int) -> DrafterConfig:
    fields, taps = SHAPES[shape]
    tc = {**fields, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192, "model_type": "llama",
          "rope_parameters": {"rope_type": "default", "rope_theta": fields["rope_theta"]}}
    return DrafterConfig.from_target(tc, layers, taps, 16, fields["vocab_size"] - 1)


def host_batches(cfg, lengths, anchors, n, seed=0):
    """`n` padded host batches of sequences of `lengths` (prompt 20%, the answer supervised), sorted anchors."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        samples, anc = [], []
        for length in lengths:
            mask = torch.zeros(length, dtype=torch.uint8)
            mask[length // 5:] = 1
            feats = torch.randn(length, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
            samples.append({"input_ids": torch.randint(0, cfg.vocab_size - 1, (length,), generator=g).numpy(),
                            "loss_mask": mask.numpy(), "features": feats})
            anc.append(sample_anchors(mask.numpy(), anchors, g))
        out.append(collate(samples, anc, pad_multiple=256, num_blocks=anchors))
    return out


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def make_step(variant, cfg, head, dev, head_chunk):
    torch.manual_seed(0)
    model = DFlashDrafter(cfg).to(dev)
    gpu = dev.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), fused=gpu or None)

    def step(batch, soft):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=gpu):
            out = block_loss(model, head, batch, batch.features, 4.0, attention="flex" if gpu else "sdpa",
                             compute_dtype=torch.bfloat16 if gpu else torch.float32, head_chunk=head_chunk,
                             weighting="dpace", dpace_alpha=0.2, soft=None if variant == "hard" else soft)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    return step


def device_batches(variant, cfg, hosts, dev, head_chunk, dtype):
    g = torch.Generator().manual_seed(7)
    out = []
    for hb in hosts:
        b = with_scored_index(hb, cfg.block_size, head_chunk if variant == "soft-once" else None)
        b = b.to(dev)
        b = replace(b, features=b.features.to(dtype))
        soft = torch.randn(*hb.input_ids.shape, cfg.hidden_size, generator=g).to(dev, dtype)
        out.append((b, soft))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2-135m", choices=[s for s in SHAPES if s != "tiny"])
    ap.add_argument("--lengths", default="1800,1100,700,420", help="tokens of each sequence of a batch")
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--head-chunk", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape and batch (CPU smoke test of this script)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    shape, lengths = ("tiny", [90, 60]) if args.tiny else (args.shape, [int(x) for x in args.lengths.split(",")])
    anchors, chunk = (24, 64) if args.tiny else (args.anchors, args.head_chunk)
    steps = 2 if args.tiny else args.steps
    cfg = drafter_config(shape, 1 if args.tiny else args.layers)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    head = TargetHead(torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02, None).to(dev, dtype)
    hosts = host_batches(cfg, lengths, anchors, 4)
    once = with_scored_index(hosts[0], cfg.block_size, chunk)
    scored, rows = len(once.scored_index), len(once.soft_rows)
    spans = sum(hi - lo for lo, hi in once.soft_spans)
    print(f"{shape}: {len(lengths)} sequences ({sum(lengths)} tokens), {anchors} anchors, head chunk {chunk}: "
          f"{scored} scored block tokens read {rows} positions; the chunks' spans hold {spans} rows "
          f"({scored / max(spans, 1):.1f}x fewer target head rows)")

    # the same loss either way (the first step of a fresh drafter, the same batch)
    losses = {}
    for variant in ("soft", "soft-once"):
        b, soft = device_batches(variant, cfg, hosts[:1], dev, chunk, dtype)[0]
        losses[variant] = float(make_step(variant, cfg, head, dev, chunk)(b, soft).loss.detach())
    rel = abs(losses["soft"] - losses["soft-once"]) / abs(losses["soft"])
    print(f"check soft-once vs soft: loss {losses['soft-once']:.6f} vs {losses['soft']:.6f} (rel diff {rel:.1e})")
    assert rel < (2e-2 if dev.type == "cuda" else 1e-5), "reading each position once changed the loss"

    rows_out = []
    for variant in VARIANTS:
        batches = device_batches(variant, cfg, hosts, dev, chunk, dtype)
        step = make_step(variant, cfg, head, dev, chunk)
        for b, soft in batches[:2]:  # warm-up: compilation, autotuning
            step(b, soft)
        sync(dev)
        t = time.perf_counter()
        for i in range(steps):
            step(*batches[i % len(batches)])
        sync(dev)
        ms = (time.perf_counter() - t) / steps * 1e3
        rows_out.append((variant, ms, sum(lengths) / ms * 1e3))
    base = {v: ms for v, ms, _ in rows_out}
    print(f"\n{'variant':<10} | {'ms/step':>8} | {'tokens/s':>9} | {'vs hard':>7} | {'vs soft':>7}")
    print("-" * 11 + "+" + "-" * 10 + "+" + "-" * 11 + "+" + "-" * 9 + "+" + "-" * 8)
    for variant, ms, tps in rows_out:
        print(f"{variant:<10} | {ms:8.1f} | {tps:9,.0f} | {ms / base['hard']:6.2f}x | {ms / base['soft']:6.2f}x")


if __name__ == "__main__":
    main()
