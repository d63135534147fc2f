"""Bytes per token of hidden-state storage options, against raw bf16, on states captured from a model.

    PYTHONPATH=scripts python benchmarks/hidden_state_compression.py --model resources/demo-target   # CPU demo
    PYTHONPATH=scripts python3 benchmarks/hidden_state_compression.py --qwen3-8b-random               # GPU

The demo target is a tiny randomly initialised Qwen3 (fed text from this repository through its tokenizer);
--qwen3-8b-random builds a Qwen3-8B-shaped model with random bf16 weights (random token ids). Neither is a
trained model: trained models have larger outliers and a wider exponent spread, so treat the ratios as
indicative and measure again on the real target (the extract stage's stats do, per shard).
"""

from __future__ import annotations

import argparse
import glob
import time

import numpy as np
import torch
import zstandard

from dflash_pipeline.hidden_states.capture import LayerCapture
from dflash_pipeline.hidden_states.codec import Codec
from dflash_pipeline.target import load_model


def capture(args):
    if args.qwen3_8b_random:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, vocab_size=151936)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda")
        layers, what = [1, 9, 17, 25, 33], "Qwen3-8B-shaped, random bf16 weights, random token ids (H200)"
    else:
        from transformers import AutoTokenizer

        model = load_model(args.model, "cpu")
        tok = AutoTokenizer.from_pretrained(args.model)
        files = sorted(glob.glob("README.md") + glob.glob("scripts/dflash_pipeline/**/*.py", recursive=True))
        text = " ".join(open(p, encoding="utf-8").read() for p in files)
        ids = torch.tensor(tok(text)["input_ids"][: args.batch * args.seq]).view(args.batch, -1)
        n = model.config.num_hidden_layers
        layers, what = [1, 2, 3, 4, 5][: max(1, n - 3)], f"demo target ({args.model}, random fp32 weights, repo text)"
    cap = LayerCapture(model, layers)
    with torch.inference_mode():
        feats = cap.run(ids)
    return feats.to(torch.bfloat16).cpu(), what


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resources/demo-target")
    ap.add_argument("--qwen3-8b-random", action="store_true")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    args = ap.parse_args()
    feats, what = capture(args)
    B, S, L, H = feats.shape
    samples = [feats[b] for b in range(B)]
    raw = sum(s.numel() * 2 for s in samples)
    tokens = B * S
    print(f"states: {what}; {tokens} tokens x {L} layers x {H} = {raw / tokens / 1024:.1f} KiB/token raw bf16")

    rows = []

    def bench(name, fn):
        t = time.perf_counter()
        n = sum(fn(s) for s in samples)
        dt = time.perf_counter() - t
        rows.append((name, n / tokens, n / raw, raw / dt / 1e9))

    def plain(level):
        c = zstandard.ZstdCompressor(level=level)
        return lambda s: len(c.compress(s.contiguous().view(torch.int16).numpy().tobytes()))

    def planes_no_rotation(level):
        c = zstandard.ZstdCompressor(level=level)

        def f(s):
            b = s.contiguous().view(torch.int16).numpy().view(np.uint8).reshape(-1, 2)
            return len(c.compress(np.ascontiguousarray(b[:, 1]))) + b.shape[0]
        return f

    def codec(name, level, **kw):
        c = Codec(name, level, "bfloat16", **kw)

        def f(s):
            e = c.encode("x", np.zeros(s.shape[0], np.int32), np.zeros(s.shape[0], np.uint8), s)
            return sum(len(memoryview(p).cast("B")) for p, _ in e.sections[:-2])
        return f

    bench("raw bf16 (codec raw)", codec("raw", 0))
    bench("zstd-3 on bf16 bytes", plain(3))
    bench("byte planes, high zstd-3, low raw", planes_no_rotation(3))
    for level in (1, 3, 9):
        bench(f"codec zstd level {level} (sign rotated, exponent plane)", codec("zstd", level))
    bench("codec zstd level 3, mantissa plane zstd too", codec("zstd", 3, compress_mantissa=True))
    bench("codec fp8 e4m3 + row scale, level 0 (lossy)", codec("fp8", 0))
    bench("codec fp8 e4m3 + row scale, zstd-3 (lossy)", codec("fp8", 3))
    print(f"\n{'option':58s} {'bytes/token':>12s} {'vs bf16':>8s} {'GB/s 1 thread':>14s}")
    for name, per_tok, ratio, speed in rows:
        print(f"{name:58s} {per_tok:12.0f} {ratio:8.3f} {speed:14.2f}")
    # the exponent plane's entropy: the lossless floor of this scheme with a perfect coder
    bits = feats.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)
    exp = ((bits >> 7) & 0xFF).astype(np.int64)
    p = np.bincount(exp, minlength=256) / exp.size
    ent = -(p[p > 0] * np.log2(p[p > 0])).sum()
    print(f"exponent entropy {ent:.2f} bits -> floor of (8 + {ent:.2f}) / 16 = {(8 + ent) / 16:.3f} x bf16 "
          f"with the mantissa stored raw")


if __name__ == "__main__":
    main()
