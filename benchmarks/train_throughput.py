"""Training throughput of the DFlash drafter for a Qwen3-8B-shaped target, on one GPU.

Target features H=4096 from 5 target layers [1, 9, 17, 25, 33] of a 36-layer target, a 5-layer drafter of
Qwen3-8B layer shape, vocab 151936, block size 16, up to 512 anchors per sequence; random bf16 weights built
from the config (no download), random features, AdamW, bf16 autocast, grad clip: the train stage's own
`block_loss` and optimizer step. Prints tokens/s (sequence tokens consumed per second) and model FLOP
utilisation against the datasheet bf16 peak and against a bf16 matmul measured in the same run.

Also checks first that the flex-attention (block-sparse) path gives the same loss and gradients as the
dense-mask SDPA path used on CPU, and that the new paths give the old path's loss and gradients.

Old path vs new, side by side in one run (`--quick`, the default variant list: under 4 minutes on an H200):
- block mask: torch's create_block_mask evaluating the mask on every (query, key) pair (`flex-create`) vs
  the BlockMask built from per-tile visible counts (`tilemask`, masks.tile_block_mask);
- LM head + CE: all logits at once (autograd through [tokens, vocab] fp32) vs chunked with the gradient
  computed in the forward (`chunkce`, head_loss.py; `train.head_chunk`).
First a component table (mask build, head+CE forward/backward, clip+AdamW: ms old / new), then whole steps.

    PYTHONPATH=scripts python benchmarks/train_throughput.py [--quick] [--seq 3072] [--anchors 512] [--steps 10]
    PYTHONPATH=scripts python benchmarks/train_throughput.py --tiny --device cpu   # the script's own smoke test
"""

from __future__ import annotations

import argparse
import time

import torch

from gpu_rates import matmul_rate  # benchmarks/ is on sys.path when run as a script

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


def check_flex_vs_sdpa(dev, quick=False):
    for partial in (1.0,) if quick else (1.0, 0.25):  # Qwen3 rotates the whole head, Qwen3.5 a quarter of it
        check_flex_vs_sdpa_once(dev, partial)


def small_setup(dev, partial_rotary_factor=1.0):
    torch.manual_seed(0)
    cfg = qwen3_8b_config(num_layers=2, hidden=256, inter=512, heads=4, kv=2, vocab=1000,
                          partial_rotary_factor=partial_rotary_factor)
    gen = torch.Generator().manual_seed(1)
    batch = make_batch(cfg, 2, 300, 40, dev, gen)
    batch.lengths[1] = 250
    head = TargetHead(torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02, None).to(dev)
    return cfg, batch, head, DFlashDrafter(cfg).to(dev)


def loss_and_grads(model, head, batch, attention, head_chunk=0):
    model.zero_grad()
    out = block_loss(model, head, batch, batch.features.float(), 7.0, attention=attention,
                     compute_dtype=torch.float32, head_chunk=head_chunk)
    out.loss.backward()
    return out.loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


def rel_diffs(a, b):
    return abs(float(a[0] - b[0])) / abs(float(b[0])), float((a[1] - b[1]).norm() / b[1].norm())


def check_flex_vs_sdpa_once(dev, partial_rotary_factor):
    cfg, batch, head, model = small_setup(dev, partial_rotary_factor)
    res = {attn: loss_and_grads(model, head, batch, attn) for attn in ("sdpa", "flex", "flex-create")}
    for attn in ("flex", "flex-create"):
        dl, dg = rel_diffs(res[attn], res["sdpa"])
        print(f"check {attn} vs sdpa (fp32, rotary {cfg.rotary_dim}/{cfg.head_dim} dims): loss rel diff {dl:.2e}, "
              f"grad rel diff {dg:.2e}")
        assert dl < 1e-3 and dg < 1e-2, f"{attn} attention path disagrees with the dense SDPA path"


def check_chunked_head(dev):
    """The chunked LM head/CE gives the plain path's loss and gradients (fp32; tf32 matmuls on the GPU)."""
    cfg, batch, head, model = small_setup(dev)
    plain = loss_and_grads(model, head, batch, "sdpa")
    chunked = loss_and_grads(model, head, batch, "sdpa", head_chunk=100)
    dl, dg = rel_diffs(chunked, plain)
    print(f"check chunked head+CE vs plain (fp32): loss rel diff {dl:.2e}, grad rel diff {dg:.2e}")
    assert dl < 1e-5 and dg < 2e-3, "chunked head/CE disagrees with the plain path"


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev, reps=5):
    """ms per call of fn after one warm-up call, and peak GiB allocated during the calls (GPU)."""
    fn()
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(dev)
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
    return (time.perf_counter() - t) / reps * 1e3, peak


def profile_components(cfg, head, args, dev, gen):
    """The step's suspects timed alone, old vs new: block mask build, LM head + CE, clip + AdamW."""
    from dflash_pipeline.drafter.head_loss import head_cross_entropy
    from dflash_pipeline.drafter.masks import flex_block_mask, tile_block_mask

    bt = make_batch(cfg, args.batch, args.seq, args.anchors, dev, gen)
    s = bt.input_ids.shape[1]
    rows = []
    m = [timed(lambda f=f: f(bt.anchors, bt.block_valid, s, cfg.block_size), dev) for f in (flex_block_mask,
                                                                                          tile_block_mask)]
    rows.append(("block mask build", m[0], m[1]))
    t = int(bt.block_valid.sum()) * (cfg.block_size - 1)
    hid = (torch.randn(t, cfg.hidden_size, device=dev) * 0.5).to(torch.bfloat16 if dev.type == "cuda" else
                                                                  torch.float32).requires_grad_()
    y = torch.randint(0, cfg.vocab_size, (t,), device=dev)
    w = torch.rand(t, device=dev)

    def head_ce(chunk):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            ce, _ = head_cross_entropy(hid, head.lm_head.weight, y, chunk)
            ((ce * w).sum() / w.sum()).backward()
        hid.grad = None

    rows.append((f"LM head + CE fwd/bwd ({t} tokens)", timed(lambda: head_ce(0), dev),
                 timed(lambda: head_ce(args.head_chunk), dev)))
    model = DFlashDrafter(cfg).to(dev)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), fused=dev.type == "cuda" or None)

    def opt_step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    o = timed(opt_step, dev)
    rows.append(("clip + AdamW step", o, o))
    del model, opt
    print(f"\n{'component':34s} {'old ms':>8s} {'new ms':>8s} {'old/new':>8s} {'old GiB':>8s} {'new GiB':>8s}")
    for name, (a, ga), (b, gb) in rows:
        print(f"{name:34s} {a:8.2f} {b:8.2f} {a / b:7.2f}x {ga:8.2f} {gb:8.2f}")


QUICK = "flex+compile,flex+compile+tilemask+chunkce,flex+compile+tilemask"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"checks, component table and whole steps old to new ({QUICK}), 10 timed steps: "
                        "under 4 minutes on one H200 (torch.compile warm-up included)")
    p.add_argument("--seq", type=int, default=3072)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--head-chunk", type=int, default=2048, help="scored tokens per LM-head chunk (chunkce)")
    p.add_argument("--variants", default=None,
                   help="comma-separated; words joined by +: flex (old mask build) | tilemask, compile, chunkce, "
                        f"online. Default: {QUICK},online+flex+compile+tilemask+chunkce")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a small drafter shape (CPU smoke test of this script)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after each variant's timed steps, N steps under torch.profiler: the top ops by device time")
    args = p.parse_args()
    if args.variants is None:
        args.variants = QUICK if args.quick else QUICK + ",online+flex+compile+tilemask+chunkce"
    return args


def main():
    args = parse_args()
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    for check in (lambda d: check_flex_vs_sdpa(d, args.quick), check_chunked_head):
        try:
            check(dev)
        except Exception as exc:  # noqa: BLE001 - the throughput numbers still come
            print(f"CHECK FAILED: {type(exc).__name__}: {exc}")
    mm = matmul_rate(dev) if dev.type == "cuda" else PEAK_BF16
    print(f"bf16 matmul measured: {mm / 1e12:.0f} TFLOP/s")
    if args.tiny:
        cfg = qwen3_8b_config(num_layers=2, hidden=256, inter=512, heads=4, kv=2, vocab=4096)
        args.seq, args.anchors, args.steps = 512, 64, 2
    else:
        cfg = qwen3_8b_config()
    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    head = TargetHead((torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.02).to(dt),
                      (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.02).to(dt)).to(dev)
    profile_components(cfg, head, args, dev, gen)
    rows = []
    for variant in args.variants.split(","):
        try:
            rows.append(run_variant(variant, cfg, head, args, dev, mm))
        except Exception as exc:  # noqa: BLE001 - report and go on with the other variants
            print(f"variant {variant} failed: {type(exc).__name__}: {exc}")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print_table(rows, cfg, args)


def print_table(rows, cfg, args):
    n_blocks = min(args.anchors, int(args.seq * 0.8) - 1)
    print(f"\nQwen3-8B-shaped drafter ({cfg.num_hidden_layers} layers, H={cfg.hidden_size}, "
          f"{len(cfg.target_layer_ids)} target layers, vocab {cfg.vocab_size}), seq {args.seq} x batch "
          f"{args.batch}, {n_blocks} blocks of {cfg.block_size} per sequence, bf16 autocast, AdamW, "
          f"{args.steps} timed steps")
    print(f"{'variant':38s} {'ms/step':>8s} {'tokens/s':>9s} {'TFLOP/s':>8s} {'MFU(989)':>9s} {'%matmul':>8s} "
          f"{'peak GiB':>9s} {'warmup s':>9s} {'loss':>7s} {'vs first':>8s}")
    for r in rows:
        print(f"{r[0]:38s} {r[1]:8.1f} {r[2]:9.0f} {r[3]:8.1f} {r[4]:8.1f}% {r[5]:7.1f}% {r[6]:9.1f} {r[7]:9.1f} "
              f"{r[8]:7.3f} {rows[0][1] / r[1]:7.2f}x")


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


def variant_step(variant, cfg, head, args, dev):
    """(one training step function, the drafter's FLOPs adjustment) of a variant."""
    online = "online" in variant
    target = qwen3_8b_target(dev) if online else None
    torch.manual_seed(0)
    model = DFlashDrafter(cfg).to(dev)
    gpu = dev.type == "cuda"
    if "compile" in variant and gpu:
        for layer in model.layers:
            layer.compile()
    attention = ("flex" if "tilemask" in variant else "flex-create") if gpu else "sdpa"
    chunk = args.head_chunk if "chunkce" in variant else 0
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), fused=gpu or None)

    def step(bt):
        feats = bt.features
        if online:
            from dflash_pipeline.drafter.features import target_features

            feats = target_features(target, bt.input_ids, bt.lengths, cfg.target_layer_ids)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=gpu):
            out = block_loss(model, head, bt, feats, 7.0, attention=attention,
                             compute_dtype=torch.bfloat16 if gpu else torch.float32, head_chunk=chunk)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    # online: the target's forward every step replaces the stored features (8B: 2 * 7.57e9 FLOP/token)
    return step, (2 * 7.57e9 * args.batch * args.seq if online else 0.0)


def profile_steps(step, batches, n, dev, variant):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for i in range(n):
            step(batches[i % len(batches)])
        sync(dev)
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    print(f"\nprofile of {variant}, {n} steps, top ops by {key}:")
    print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))


def run_variant(variant, cfg, head, args, dev, mm):
    step, extra_flops = variant_step(variant, cfg, head, args, dev)
    gen = torch.Generator().manual_seed(1)  # every variant trains on the same batches
    batches = [make_batch(cfg, args.batch, args.seq, args.anchors, dev, gen) for _ in range(3)]
    flops = sum(model_flops(cfg, bt) for bt in batches) / len(batches) + extra_flops
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(3):
        step(batches[i % 3])
    sync(dev)
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(args.steps):
        out = step(batches[i % 3])
    sync(dev)
    dt = (time.perf_counter() - t0) / args.steps
    if args.profile:
        profile_steps(step, batches, args.profile, dev, variant)
    tok = args.batch * args.seq / dt
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
    row = (variant, dt * 1e3, tok, flops / dt / 1e12, flops / dt / PEAK_BF16 * 100, flops / dt / mm * 100,
           peak, warm, float(out.loss.detach()))
    print("row", row, flush=True)
    return row


if __name__ == "__main__":
    main()
