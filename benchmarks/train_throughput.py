"""Training throughput of the DFlash drafter for a Qwen3-8B-shaped target, on one GPU.

Target features H=4096 from 5 target layers [1, 9, 17, 25, 33] of a 36-layer target, a 5-layer drafter of
Qwen3-8B layer shape, vocab 151936, block size 16, up to 512 anchors per sequence; random bf16 weights built
from the config (no download), random features, AdamW, bf16 autocast, grad clip: the train stage's own
`block_loss` and optimizer step. Prints tokens/s (sequence tokens consumed per second) and model FLOP
utilisation against the datasheet bf16 peak and against a bf16 matmul measured in the same run.

Also checks first that the flex-attention (block-sparse) path gives the same loss and gradients as the
dense-mask SDPA path used on CPU.

    PYTHONPATH=scripts python benchmarks/train_throughput.py [--seq 3072] [--anchors 512] [--steps 10]
"""

from __future__ import annotations

import argparse
import time

import torch

from extract_throughput import matmul_rate  # benchmarks/ is on sys.path when run as a script

from dflash_pipeline.drafter.batch import Batch
from dflash_pipeline.drafter.config import DrafterConfig
from dflash_pipeline.drafter.loss import block_loss
from dflash_pipeline.drafter.model import DFlashDrafter
from dflash_pipeline.drafter.target_head import TargetHead

PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16, datasheet


def qwen3_8b_config(num_layers=5, block_size=16, hidden=4096, inter=12288, heads=32, kv=8, vocab=151936,
                    partial_rotary_factor=1.0):
    tc = {"hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
          "head_dim": hidden // heads, "num_hidden_layers": 36, "vocab_size": vocab, "rms_norm_eps": 1e-6,
          "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0,
                              "partial_rotary_factor": partial_rotary_factor},
          "max_position_embeddings": 40960, "model_type": "qwen3"}
    return DrafterConfig.from_target(tc, num_layers, [1, 9, 17, 25, 33], block_size, vocab - 1)


def make_batch(cfg, b, s, anchors, dev, gen, prompt_frac=0.2):
    ids = torch.randint(0, cfg.vocab_size - 1, (b, s), generator=gen)
    mask = torch.zeros(b, s)
    mask[:, int(s * prompt_frac):] = 1
    anc = []
    for i in range(b):
        valid = torch.nonzero(mask[i, :-1]).flatten()
        pick = valid[torch.randperm(len(valid), generator=gen)[:anchors]].sort().values
        anc.append(pick)
    n = max(len(a) for a in anc)
    a = torch.zeros(b, n, dtype=torch.long)
    v = torch.zeros(b, n, dtype=torch.bool)
    for i, x in enumerate(anc):
        a[i, :len(x)] = x
        v[i, :len(x)] = True
    feats = torch.randn(b, s, len(cfg.target_layer_ids) * cfg.hidden_size, generator=gen).to(torch.bfloat16)
    return Batch(ids, mask, torch.full((b,), s), a, v, feats).to(dev)


def model_flops(cfg, batch) -> float:
    """Model FLOPs of one training step (forward + backward), counting only matmuls and attention."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hq, hk, d, L, bs = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers, cfg.block_size
    b, s = batch.input_ids.shape
    ctx = float(batch.lengths.sum())
    nblk = float(batch.block_valid.sum())
    q = nblk * bs
    fc = 2 * ctx * len(cfg.target_layer_ids) * H * H
    ctx_kv = L * 2 * ctx * H * 2 * hk * d
    blk = L * 2 * q * (H * hq * d * 2 + H * 2 * hk * d + 3 * H * I)
    visible = float(((batch.anchors.float() + bs) * batch.block_valid).sum()) * bs  # (context < anchor + own block) per query
    attn = L * 4 * visible * hq * d
    scored = nblk * (bs - 1)
    head = 2 * scored * H * V
    return 3 * (fc + ctx_kv + blk + attn) + 2 * head  # frozen LM head: input gradient only


def check_flex_vs_sdpa(dev):
    for partial in (1.0, 0.25):  # Qwen3 rotates the whole head, Qwen3.5 a quarter of it
        check_flex_vs_sdpa_once(dev, partial)


def check_flex_vs_sdpa_once(dev, partial_rotary_factor):
    torch.manual_seed(0)
    cfg = qwen3_8b_config(num_layers=2, hidden=256, inter=512, heads=4, kv=2, vocab=1000,
                          partial_rotary_factor=partial_rotary_factor)
    gen = torch.Generator().manual_seed(1)
    batch = make_batch(cfg, 2, 300, 40, dev, gen)
    batch.lengths[1] = 250
    head = TargetHead(torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02, None).to(dev)
    model = DFlashDrafter(cfg).to(dev)
    res = {}
    for attn in ("sdpa", "flex"):
        model.zero_grad()
        out = block_loss(model, head, batch, batch.features.float(), 7.0, attention=attn, compute_dtype=torch.float32)
        out.loss.backward()
        res[attn] = (out.loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]))
    dl = abs(float(res["flex"][0] - res["sdpa"][0])) / abs(float(res["sdpa"][0]))
    dg = float((res["flex"][1] - res["sdpa"][1]).norm() / res["sdpa"][1].norm())
    print(f"check flex vs sdpa (fp32, rotary {cfg.rotary_dim}/{cfg.head_dim} dims): loss rel diff {dl:.2e}, "
          f"grad rel diff {dg:.2e}")
    assert dl < 1e-3 and dg < 1e-2, "flex attention path disagrees with the dense SDPA path"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=3072)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--variants", default="flex,flex+compile,online+flex+compile")
    args = p.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        check_flex_vs_sdpa(dev)
    except Exception as exc:  # noqa: BLE001 - the throughput numbers still come
        print(f"CHECK FAILED: {type(exc).__name__}: {exc}")

    mm = matmul_rate(dev)
    print(f"bf16 matmul measured: {mm / 1e12:.0f} TFLOP/s")

    cfg = qwen3_8b_config()
    gen = torch.Generator().manual_seed(0)
    head = TargetHead((torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.02).to(torch.bfloat16),
                      (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.02).to(torch.bfloat16)).to(dev)
    rows = []
    for variant in args.variants.split(","):
        try:
            rows.append(run_variant(variant, cfg, head, args, dev, gen, mm))
        except Exception as exc:  # noqa: BLE001 - report and go on with the other variants
            print(f"variant {variant} failed: {type(exc).__name__}: {exc}")
        torch.cuda.empty_cache()
    n_blocks = min(args.anchors, int(args.seq * 0.8) - 1)
    print(f"\nQwen3-8B-shaped drafter (5 layers, H=4096, 5 target layers, vocab 151936), seq {args.seq} x batch "
          f"{args.batch}, {n_blocks} blocks of 16 per sequence, bf16 autocast, AdamW, {args.steps} timed steps")
    print(f"{'variant':18s} {'ms/step':>8s} {'tokens/s':>9s} {'TFLOP/s':>8s} {'MFU(989)':>9s} {'%matmul':>8s} "
          f"{'peak GiB':>9s} {'warmup s':>9s} {'loss':>7s}")
    for r in rows:
        print(f"{r[0]:18s} {r[1]:8.1f} {r[2]:9.0f} {r[3]:8.1f} {r[4]:8.1f}% {r[5]:7.1f}% {r[6]:9.1f} {r[7]:9.1f} {r[8]:7.3f}")


_TARGET = {}


def qwen3_8b_target(dev):
    """A random bf16 Qwen3-8B (for the online variant: the target computes the features every step)."""
    if "m" not in _TARGET:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        tc = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                         attn_implementation="sdpa")
        with torch.device(dev):
            _TARGET["m"] = Qwen3ForCausalLM(tc).to(torch.bfloat16).eval().requires_grad_(False)
    return _TARGET["m"]


def run_variant(variant, cfg, head, args, dev, gen, mm):
    online = "online" in variant
    target = qwen3_8b_target(dev) if online else None
    if True:
        torch.manual_seed(0)
        model = DFlashDrafter(cfg).to(dev)
        if "compile" in variant:
            for layer in model.layers:
                layer.compile()
        attention = "flex" if "flex" in variant else "sdpa"
        opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), fused=True)
        batches = [make_batch(cfg, args.batch, args.seq, args.anchors, dev, gen) for _ in range(3)]
        flops = sum(model_flops(cfg, bt) for bt in batches) / len(batches)

        if online:  # the target's forward every step replaces the stored features (8B: 2 * 7.57e9 FLOP/token)
            from dflash_pipeline.drafter.features import target_features

            flops += 2 * 7.57e9 * args.batch * args.seq

        def step(bt):
            feats = bt.features
            if online:
                feats = target_features(target, bt.input_ids, bt.lengths, cfg.target_layer_ids)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = block_loss(model, head, bt, feats, 7.0, attention=attention, compute_dtype=torch.bfloat16)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return out

        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for i in range(3):
            step(batches[i % 3])
        torch.cuda.synchronize()
        warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(args.steps):
            out = step(batches[i % 3])
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.steps
        tok = args.batch * args.seq / dt
        row = (variant, dt * 1e3, tok, flops / dt / 1e12, flops / dt / PEAK_BF16 * 100, flops / dt / mm * 100,
               torch.cuda.max_memory_allocated() / 2**30, warm, float(out.loss))
        print("row", row, flush=True)
        return row


if __name__ == "__main__":
    main()
