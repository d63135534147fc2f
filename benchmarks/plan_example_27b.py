"""The plan for the incident's scale, from ASSUMED calibration figures: 914K samples, a 27B hybrid target.

Not a measurement: every figure below marked ASSUMED is an assumption stated for the README's example (the
incident measured ~400 output tok/s per GPU after it had started, against ~750 planned). The numbers the plan
prints are computed by the pipeline's own code (`planning.plan.make_plan` + `render`) from them. Run:

    python benchmarks/plan_example_27b.py
"""

from __future__ import annotations

import random

from dflash_pipeline.planning.plan import make_plan, render
from dflash_pipeline.planning.projection import gate_failures

SAMPLES = 914_000
SHAPE_27B = {"hidden_size": 5120, "num_layers": 64, "active_params": 25.0e9, "model_type": "qwen3_5",
             "vocab_size": 151_936, "intermediate_size": 17_408, "num_heads": 64, "num_kv_heads": 8, "head_dim": 128}
LAYER_IDS = [1, 16, 31, 46, 61]
ASSUMED = {
    "output_tok_s_per_gpu": 400,       # ASSUMED: the incident's measured rate (27B, bf16, one H200 per server)
    "mean_output_tokens": 5_000,       # ASSUMED: thinking included
    "startup_s": 300,                  # ASSUMED: server start-up (weights load + CUDA graphs)
    "max_new_tokens": 16_384,
    "gpus_per_job": 1,                 # tp 1: 27B bf16 fits one 141 GB H200
    "jobs": 8,                         # 224 shards of 4,096 samples, generate.shards_per_job 28
    "parallel_jobs": 8,                # 8 GPUs
    "gpu_hour_usd": 3.00,              # ASSUMED price
    "max_wall_hours": 168,             # a week
}


def assumed_calibration(rng: random.Random) -> dict:
    """A calibration result as `dflash-pipeline calibrate` writes it, filled with the ASSUMED figures."""
    # answer lengths: log-normal around the assumed mean, cut at max_new_tokens (256 "measured" samples)
    lengths = sorted(min(ASSUMED["max_new_tokens"], int(rng.lognormvariate(8.2, 0.7))) for _ in range(256))
    scale = ASSUMED["mean_output_tokens"] / (sum(lengths) / len(lengths))
    lengths = sorted(min(ASSUMED["max_new_tokens"], round(v * scale)) for v in lengths)
    return {
        "throughput": {"output_tok_s": ASSUMED["output_tok_s_per_gpu"] * ASSUMED["gpus_per_job"], "steady_state": True},
        "output_tokens": {"mean": sum(lengths) / len(lengths), "per_sample_all": lengths},
        "startup_s": ASSUMED["startup_s"], "requests": {"samples": 256}, "assumed": True,
        "finish_length_rate": sum(v >= ASSUMED["max_new_tokens"] for v in lengths) / len(lengths),
        "failure_rate": 0.0,
    }


def corpus(rng: random.Random, n: int = 1000) -> dict:
    """Token statistics of a 1,000-sample stand-in for the corpus (the plan scales it to 914K)."""
    prompts = [min(3072, int(rng.lognormvariate(6.0, 0.9))) for _ in range(n)]
    answers = [6] * n  # the incident's placeholder answers: what regeneration replaces
    return {"samples": n, "tokens": sum(prompts) + sum(answers), "loss_tokens": sum(answers),
            "lengths": [p + a for p, a in zip(prompts, answers)], "prompt_lengths": prompts}


def main() -> None:
    rng = random.Random(0)
    cal = assumed_calibration(rng)
    generate = {"enabled": True, "max_new_tokens": ASSUMED["max_new_tokens"], "gpus": ASSUMED["gpus_per_job"],
                "parallel_jobs": ASSUMED["parallel_jobs"]}
    plan = make_plan(corpus(rng), SHAPE_27B, LAYER_IDS, generate=generate, tokenize={"max_length": 3072},
                     extract={"codec": "zstd"}, train={"epochs": 6}, scale=SAMPLES / 1000, calibration=cal,
                     jobs=ASSUMED["jobs"], cost={"gpu_hour_usd": ASSUMED["gpu_hour_usd"]})
    print(render(plan, SHAPE_27B, LAYER_IDS), end="")
    for failure in gate_failures(plan["generation"], ASSUMED["max_wall_hours"], None):
        print(f"GENERATION GATE: STOP - {failure}")


if __name__ == "__main__":
    main()
