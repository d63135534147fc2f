"""Extraction throughput, end to end (forward + D2H + compression + checksums + writing), on a GPU.

A Qwen3-8B-shaped target with random bf16 weights is built from its config (no download), token shards of
fixed-length and of mixed-length samples are written, and `extract_shard` runs on them with each codec.
Printed against the prefill limit (2 x non-embedding params FLOP per token at the bf16 matmul rate measured
in the same run) and against the ~27K tok/s that SpecForge reports for its SGLang capture on one H200.

    PYTHONPATH=scripts python3 benchmarks/extract_throughput.py --out /tmp/bench-extract
    PYTHONPATH=scripts python3 benchmarks/extract_throughput.py --tiny   # CPU smoke run of the script
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from gpu_rates import matmul_rate  # benchmarks/ is on sys.path when run as a script

from dflash_pipeline.hidden_states.capture import LayerCapture
from dflash_pipeline.hidden_states.extract import ExtractSettings, extract_shard

SPECFORGE_TOK_S = 27_000


def write_tokens(path, lengths, vocab, seed=0):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, vocab, n).astype(np.int32).tolist() for n in lengths]
    masks = [([0] * (n // 4) + [1] * (n - n // 4)) for n in lengths]
    schema = pa.schema([("sample_id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8()))])
    pq.write_table(pa.table({"sample_id": [f"b-{i:06d}" for i in range(len(lengths))], "input_ids": ids,
                             "loss_mask": masks}, schema=schema), path)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/bench-extract")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on CPU (checks the script only)")
    ap.add_argument("--samples", type=int, default=128, help="fixed-length samples (2048 tokens each)")
    ap.add_argument("--token-budget", type=int, default=16384)
    ap.add_argument("--encode-threads", type=int, default=12)
    ap.add_argument("--cases", default="compute,zstd1,zstd3,raw,fp8,mixed-zstd1")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--flush-tokens", type=int, default=262144, help="durable chunk size (fsync + journal)")
    return ap.parse_args()


class Bench:
    """The model, the token shards and the cases of one run."""

    def __init__(self, args):
        from transformers import Qwen3Config, Qwen3ForCausalLM

        self.args, self.dev = args, "cpu" if args.tiny else "cuda"
        if args.tiny:
            cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, vocab_size=1000)
            self.layers, self.seq, self.budget, self.n_fixed = [1, 2, 3, 4, 5], 128, 512, 16
        else:
            cfg = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                              num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960)
            self.layers, self.seq, self.budget, self.n_fixed = [1, 9, 17, 25, 33], 2048, args.token_budget, args.samples
        cfg._attn_implementation = "sdpa"
        self.cfg = cfg
        torch.manual_seed(0)
        self.mm = matmul_rate(self.dev) if self.dev == "cuda" else None
        with torch.device(self.dev):
            self.model = Qwen3ForCausalLM(cfg).to(torch.bfloat16 if self.dev == "cuda" else torch.float32).eval()
        n_params = sum(p.numel() for p in self.model.parameters()) - cfg.vocab_size * cfg.hidden_size
        self.limit = self.mm / (2 * n_params) if self.mm else None
        print(f"device {torch.cuda.get_device_name() if self.dev == 'cuda' else 'cpu'}, torch {torch.__version__}, "
              f"non-embedding params {n_params / 1e9:.2f}B, cpu cores {os.cpu_count()}")
        if self.mm:
            print(f"bf16 matmul {self.mm / 1e12:.0f} TFLOP/s -> prefill limit {self.limit:.0f} tok/s")
        self.compiled = False

    def write_inputs(self):
        out, seq, vocab = self.args.out, self.seq, self.cfg.vocab_size
        os.makedirs(out, exist_ok=True)
        self.fixed = os.path.join(out, "fixed.parquet")
        write_tokens(self.fixed, [seq] * self.n_fixed, vocab)
        rng = np.random.default_rng(1)
        lengths = np.clip(rng.lognormal(np.log(seq / 2), 0.7, self.n_fixed * 2), 64, seq * 3 // 2).astype(int)
        lengths = lengths[: max(1, int(np.searchsorted(np.cumsum(lengths), self.n_fixed * seq)))]
        self.mixed = os.path.join(out, "mixed.parquet")
        write_tokens(self.mixed, lengths.tolist(), vocab, seed=2)
        self.warm = os.path.join(out, "warm.parquet")
        write_tokens(self.warm, [seq] * max(2, self.budget // seq * 2), vocab, seed=3)

    def extract(self, src, out, **kw):
        # compile=False: the compiled cases compile the layers once (compile_layers)
        settings = ExtractSettings(target_layer_ids=self.layers, device=self.dev, token_budget=self.budget, compile=False,
                                   encode_threads=self.args.encode_threads, **kw)
        return extract_shard(src, "random", out, settings, model=self.model)

    def compile_layers(self):
        t = time.perf_counter()
        cap = LayerCapture(self.model, self.layers)
        cap.compile()
        cap.remove()  # the compiled forwards stay on the layers
        self.extract(self.warm, os.path.join(self.args.out, "warm.dfhs"))
        # a few mixed shapes: after the second one dynamo compiles a dynamic-shape graph used for all
        warm_mixed = os.path.join(self.args.out, "warm-mixed.parquet")
        seq = self.seq
        write_tokens(warm_mixed, [seq // 3, seq // 2, seq * 3 // 4, seq - 100] * max(1, self.budget // seq),
                     self.cfg.vocab_size, seed=4)
        self.extract(warm_mixed, os.path.join(self.args.out, "warm.dfhs"), pad_multiple=64)
        print(f"torch.compile of the layers + warm-up: {time.perf_counter() - t:.0f} s")
        self.compiled = True

    def compute_only(self, label):
        """The forward with hooks only (states stay on the GPU): the ceiling for the rest."""
        cap = LayerCapture(self.model, self.layers)
        x = torch.randint(0, self.cfg.vocab_size, (max(1, self.budget // self.seq), self.seq), device=self.dev)
        reps = max(1, self.n_fixed * self.seq // x.numel())
        with torch.inference_mode():
            cap.run(x)
            sync = torch.cuda.synchronize if self.dev == "cuda" else (lambda: None)
            sync()
            t = time.perf_counter()
            for _ in range(reps):
                cap.run(x)
            sync()
            dt = time.perf_counter() - t
        cap.remove()
        return {"case": label + "compute only (hooks, early stop)", "tokens": reps * x.numel(),
                "tok_s": reps * x.numel() / dt, "ratio": None, "padding": 0.0}

    def end_to_end(self, case, label):
        src = self.mixed if case.startswith("mixed") else self.fixed
        name, _, where = case.replace("mixed-", "").partition("@")
        codec, level = ("zstd", int(name[4:])) if name.startswith("zstd") else (name, 3)
        out = os.path.join("/dev/shm" if where == "shm" else self.args.out, f"{case}.dfhs")
        for p in (out, out + ".partial", out + ".journal"):
            if os.path.exists(p):
                os.remove(p)
        s = self.extract(src, out, codec=codec, level=level, flush_tokens=self.args.flush_tokens,
                         pad_multiple=64 if self.compiled else 1)
        os.remove(out)
        kind = "mixed" if src == self.mixed else f"{self.seq}-tok"
        return {"case": label + f"{case} ({kind}{', /dev/shm' if where else ''})", "tokens": s["tokens"],
                "tok_s": s["tokens_per_s"], "ratio": s["compression_vs_bf16"], "padding": s["padding_waste"],
                "file_gb": s["file_bytes"] / 1e9}

    def run_case(self, case):
        if case.startswith("compiled") and not self.compiled:
            self.compile_layers()
        label = "compiled " if self.compiled else ""
        case = case.replace("compiled-", "")
        return self.compute_only(label) if case == "compute" else self.end_to_end(case, label)


def print_table(rows, limit):
    print()
    print(f"{'case':44s} {'tokens':>9s} {'tok/s':>9s} {'% limit':>8s} {'x SpecForge':>11s} {'bytes/bf16':>10s} "
          f"{'pad':>6s}")
    for r in rows:
        pct = f"{100 * r['tok_s'] / limit:7.1f}%" if limit else "      -"
        ratio = f"{r['ratio']:10.3f}" if r["ratio"] is not None else "         -"
        print(f"{r['case']:44s} {r['tokens']:9d} {r['tok_s']:9.0f} {pct:>8s} {r['tok_s'] / SPECFORGE_TOK_S:11.2f} "
              f"{ratio} {100 * r['padding']:5.1f}%")


def main():
    args = parse_args()
    bench = Bench(args)
    bench.write_inputs()
    bench.extract(bench.warm, os.path.join(args.out, "warm.dfhs"))  # warm-up: kernels, allocator, pinned memory
    rows = [bench.run_case(case) for case in args.cases.split(",")]
    print_table(rows, bench.limit)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"matmul_flops": bench.mm, "prefill_limit_tok_s": bench.limit, "rows": rows}, fh, indent=2)
    shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()
