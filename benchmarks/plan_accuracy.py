"""Does the plan predict extraction and training? Projected (from `calibrate-rates`, and from the cost model
alone) vs the actual wall time of one extraction job over every shard and of one training run, through the
package's own commands, on one machine.

Target: the SmolLM2-135M shape with random weights (the project's tiny tokenizer; `--tiny`: a small shape for
a CPU check). Data: random token ids with ShareGPT-like lengths (log-normal, answer = second half).

    PYTHONPATH=scripts python benchmarks/plan_accuracy.py [--tiny] [--tokens 600000] [--out DIR]

Prints one table (stage, projected from the measured rates, from the cost model, actual, actual/projected)
and writes the figures as JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

CLI = [sys.executable, "-c", "import sys; from dflash_pipeline.cli import main; sys.exit(main(sys.argv[1:]))"]
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000,
               tie_word_embeddings=True, rms_norm_eps=1e-5)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=4096, max_position_embeddings=2048, rope_theta=10000,
            tie_word_embeddings=True, rms_norm_eps=1e-5)


def cli(*args, log: Path | None = None) -> float:
    t0 = time.perf_counter()
    out = open(log, "w") if log else None
    subprocess.run([*CLI, *map(str, args)], check=True, stdout=out, stderr=subprocess.STDOUT if out else None,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(
                       ["scripts", *filter(None, [os.environ.get("PYTHONPATH")])])})
    return time.perf_counter() - t0


def build_target(work: Path, shape: dict) -> Path:
    """The tiny model's directory (tokenizer, chat template) with the weights replaced by `shape`, random."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = work / "target"
    cli("tiny-model", "--out", out, "--pretrain-steps", "0")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16)
    for f in out.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(out)
    return out


def token_shards(work: Path, total: int, shards: int, vocab: int, max_len: int) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    paths, per = [], total // shards
    for s in range(shards):
        rows = {k: [] for k in ("sample_id", "input_ids", "loss_mask", "length", "num_loss_tokens", "truncated")}
        got = 0
        while got < per:
            n = int(min(max_len, max(16, rng.lognormal(6.2, 0.8))))
            mask = [0] * (n // 2) + [1] * (n - n // 2)
            rows["sample_id"].append(f"s{s}-{len(rows['length'])}")
            rows["input_ids"].append(rng.integers(0, vocab, n).tolist())
            rows["loss_mask"].append(mask)
            rows["length"].append(n)
            rows["num_loss_tokens"].append(n - n // 2)
            rows["truncated"].append(False)
            got += n
        path = work / f"bench-{s:05d}.parquet"
        pq.write_table(pa.table(rows), path)
        paths.append(path)
    return paths


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="a small shape on CPU (a check of the script)")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/plan_accuracy"))
    a = ap.parse_args()
    work = Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    shape = TINY if a.tiny else SMOLLM2
    tokens = a.tokens or (6000 if a.tiny else 600_000)
    device = "cpu" if a.tiny else "cuda"
    target = build_target(work, shape)
    shards = token_shards(work, tokens, a.shards, 2000, 256 if a.tiny else 2048)
    layers = 3 if a.tiny else 5  # drafter layers (and target layers captured)
    ex = {"device": device, "token_budget": 2048 if a.tiny else 65536, "encode_threads": 8,
          "num_layers": layers}
    tr = {"device": device, "batch_size": 2 if a.tiny else 16, "max_length": 256 if a.tiny else 2048,
          "num_anchors": 16 if a.tiny else 512, "epochs": 1, "num_layers": layers, "acceptance_every": 0, "mode": "offline"}
    rates = work / "rates.json"
    cal_s = cli("calibrate-rates", "--tokens", *shards, "--model", target, "--extract-settings", json.dumps(ex),
                "--train-settings", json.dumps(tr), "--shards-per-job", a.shards,
                "--measure-tokens", 4000 if a.tiny else 131072, "--warmup-tokens", 4000 if a.tiny else 131072,
                "--train-steps", 2 if a.tiny else 8, "--work-dir", work / "cal", "--out", rates,
                log=work / "calibrate.log")
    cfg = {"generate": {"enabled": False}, "tokenize": {"max_length": tr["max_length"]},
           "extract": {"codec": "zstd", "shards_per_job": a.shards, "token_budget": ex["token_budget"]},
           "drafter": {"num_layers": layers}, "train": {k: tr[k] for k in ("epochs", "mode", "num_anchors", "max_length")}}
    plans = {}
    for name, extra in (("measured", ["--rates", rates]), ("model", [])):
        cli("plan", "--tokens", *shards, "--model", target, "--config", json.dumps(cfg), "--json",
            work / f"plan-{name}.json", *extra, log=work / f"plan-{name}.log")
        plans[name] = json.loads((work / f"plan-{name}.json").read_text())
    hidden = [work / "hidden" / f"{p.stem}.dfhs" for p in shards]
    ex_s = cli("extract", "--tokens", *shards, "--model", target, "--out", *hidden, "--settings",
               json.dumps({k: v for k, v in ex.items() if k != "encode_threads"}), log=work / "extract.log")
    tr_s = cli("train", "--inputs", *hidden, "--model", target, "--out", work / "train", "--checkpoint-dir",
               work / "ckpt", "--settings", json.dumps(tr), "--checkpoint-every", 10 ** 9, log=work / "train.log")
    actual = {"extract": ex_s, "train": tr_s}
    rows = []
    for stage in ("extract", "train"):
        proj = {n: plans[n][f"{stage}_gpu_hours"] * 3600 for n in plans}
        rates_of = {n: plans[n][f"{stage}_tok_s"] for n in plans}
        rows.append({"stage": stage, "projected_measured_s": proj["measured"], "projected_model_s": proj["model"],
                     "actual_s": actual[stage], "ratio_measured": actual[stage] / proj["measured"],
                     "ratio_model": actual[stage] / proj["model"], "rate_measured": rates_of["measured"],
                     "rate_model": rates_of["model"]})
    (work / "plan_accuracy.json").write_text(json.dumps({"rows": rows, "rates": json.loads(rates.read_text()),
                                                          "calibrate_rates_s": cal_s, "tokens": tokens}, indent=1))
    print(f"\nplan accuracy, {'tiny CPU' if a.tiny else 'SmolLM2-135M shape'}, {tokens:,} tokens in {a.shards} shards "
          f"(calibrate-rates took {cal_s:.1f} s)")
    print(f"{'stage':8} {'projected (measured rates)':>27} {'projected (cost model)':>23} {'actual':>8} "
          f"{'actual/proj meas.':>18} {'actual/proj model':>18}")
    for r in rows:
        print(f"{r['stage']:8} {r['projected_measured_s']:>9.1f} s @ {r['rate_measured']:>9,.0f}/s "
              f"{r['projected_model_s']:>7.1f} s @ {r['rate_model']:>9,.0f}/s {r['actual_s']:>7.1f}s "
              f"{r['ratio_measured']:>18.2f} {r['ratio_model']:>18.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
