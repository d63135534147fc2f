"""Does `extract.compile: auto` pick the faster way? Whole-shard wall time (compilation included) of `extract_shard`
with eager and with compiled layers, for a target shape and several shard sizes, beside what `auto` picks.

Each case builds a fresh target (random bf16 weights, from its config: no download) so that no compiled code
is reused across cases, as in a real extract job, one shard per process. Shards hold ShareGPT-like lengths
(log-normal, median ~400 tokens, 32..2048).

    PYTHONPATH=scripts python3 benchmarks/extract_compile_auto.py --shape smollm2-135m --samples 640,4000,16000
    PYTHONPATH=scripts python3 benchmarks/extract_compile_auto.py --tiny     # CPU smoke run of the script
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
import torch

from dflash_pipeline.hidden_states.capture import find_decoder_layers
from dflash_pipeline.hidden_states.compile_choice import COMPILE_MIN_TOKENS, should_compile
from dflash_pipeline.hidden_states.extract import ExtractSettings, extract_shard

SHAPES = {  # transformers config kwargs; the 135M is SmolLM2-135M-Instruct's (issue 17's real target)
    "smollm2-135m": ("LlamaConfig", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                                         rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192)),
    "qwen3-8b": ("Qwen3Config", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                     max_position_embeddings=40960)),
    "tiny": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, vocab_size=1000)),
}


def write_shard(path: str, n: int, vocab: int, max_len: int, seed: int = 0) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(400), 0.8, n), 32, max_len).astype(int)
    ids = [rng.integers(0, vocab, k).astype(np.int32).tolist() for k in lengths]
    masks = [[0] * (k // 3) + [1] * (k - k // 3) for k in lengths]
    schema = pa.schema([("sample_id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8()))])
    pq.write_table(pa.table({"sample_id": [f"s-{i:06d}" for i in range(n)], "input_ids": ids, "loss_mask": masks},
                            schema=schema), path)
    return int(lengths.sum())


def build(shape: str, device: str):
    import transformers

    cls_name, kw = SHAPES[shape]
    cfg = getattr(transformers, cls_name)(**kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16 if device == "cuda" else torch.float32).eval()


def run_case(shape, device, shard, tokens, compile_, tmp, layer_ids) -> dict:
    import torch._inductor.config

    model = build(shape, device)
    torch._dynamo.reset()  # no compiled code carried over from the last case, nor Inductor's on-disk cache:
    torch._inductor.config.fx_graph_cache = False  # each case compiles as a fresh extract job on a fresh node does
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = os.path.join(tmp, f"c{int(compile_)}.dfhs")
    settings = ExtractSettings(target_layer_ids=layer_ids, device=device, compile=compile_, token_budget=65536,
                               encode_threads=8, codec="zstd", level=1)
    stats = extract_shard(shard, "random", out, settings, model=model)
    wall = time.perf_counter() - t
    for p in os.listdir(tmp):
        if p.startswith(f"c{int(compile_)}.dfhs"):
            os.remove(os.path.join(tmp, p))
    return {"compile": compile_, "wall_s": wall, "tok_s_whole_shard": tokens / wall, "tokens": stats["tokens"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m", choices=list(SHAPES))
    ap.add_argument("--samples", default="640,4000,16000", help="shard sizes (samples) to time")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run (tiny shape, small shards)")
    ap.add_argument("--json")
    args = ap.parse_args()
    shape, device = ("tiny", "cpu") if args.tiny else (args.shape, "cuda")
    sizes = [16, 32] if args.tiny else [int(x) for x in args.samples.split(",")]
    model = build(shape, "cpu" if args.tiny else "meta")
    params = sum(p.numel() for layer in find_decoder_layers(model) for p in layer.parameters())
    n_layers = SHAPES[shape][1]["num_hidden_layers"]
    layer_ids = sorted({1, n_layers // 2, n_layers - 3})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            shard = os.path.join(tmp, f"shard{n}.parquet")
            tokens = write_shard(shard, n, SHAPES[shape][1]["vocab_size"], 2048)
            eager = run_case(shape, device, shard, tokens, False, tmp, layer_ids)
            compiled = run_case(shape, device, shard, tokens, True, tmp, layer_ids) if not args.tiny else None
            auto = should_compile("auto", "cuda", tokens)
            faster = compiled is not None and compiled["wall_s"] < eager["wall_s"]
            rows.append({"samples": n, "tokens": tokens, "eager": eager, "compiled": compiled, "auto_compiles": auto,
                         "auto_right": (auto == faster) if compiled else None})
    print(f"\nshape {shape}: {params / 1e6:.0f}M layer parameters; auto compiles a shard of >= {COMPILE_MIN_TOKENS:,} tokens")
    print(f"{'samples':>8s} {'tokens':>10s} {'eager s':>8s} {'tok/s':>9s} {'compiled s':>10s} {'tok/s':>9s} "
          f"{'auto':>8s} {'right':>6s}")
    for r in rows:
        c = r["compiled"] or {"wall_s": float("nan"), "tok_s_whole_shard": float("nan")}
        print(f"{r['samples']:8d} {r['tokens']:10d} {r['eager']['wall_s']:8.1f} {r['eager']['tok_s_whole_shard']:9.0f} "
              f"{c['wall_s']:10.1f} {c['tok_s_whole_shard']:9.0f} {'compile' if r['auto_compiles'] else 'eager':>8s} "
              f"{str(r['auto_right']):>6s}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"shape": shape, "layer_params": params, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
