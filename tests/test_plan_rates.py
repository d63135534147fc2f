"""The plan's GPU rates: a measured rate is used and labelled measured; the cost model on a tiny shape; the
projection adds every job's start-up; calibrate-rates measures through the stages' own code (CPU, tiny target)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from conftest import run_cli
from dflash_pipeline.planning.plan import make_plan, render
from dflash_pipeline.planning.rates import (
    ASSUMED, modelled_extract, modelled_train, stage_time, train_flops_per_position, trained_positions_per_token,
)

SHAPE = {"hidden_size": 8, "num_layers": 4, "active_params": 4000, "model_type": "llama", "vocab_size": 100,
         "intermediate_size": 16, "num_heads": 2, "num_kv_heads": 1, "head_dim": 4}


def _tok(samples, length, loss):
    return {"samples": samples, "tokens": samples * length, "loss_tokens": samples * loss,
            "lengths": [length] * samples, "prompt_lengths": [length - loss] * samples}


def test_cost_model_counts_layers_lm_head_and_start_up():
    # one drafter layer: attention 8 x 4 x (2x2 + 2x1) = 192, MLP 3 x 8 x 16 = 384; the LM head 4 x 8 x 100
    assert train_flops_per_position(SHAPE, 2) == 6 * 2 * (192 + 384) + 4 * 8 * 100
    # 10 anchors x block 4 over 100 tokens (answers of 60 tokens, anchors fewer than answer tokens)
    assert trained_positions_per_token(100, 60, {"num_anchors": 10, "max_length": 3072}, 4) == 0.4
    train = modelled_train(SHAPE, 2, 0.4)
    assert abs(train["tok_s"] - ASSUMED["peak_tflops"] * 1e12 * ASSUMED["train_mfu"] / (0.4 * 10112)) < 1e-3
    ext = modelled_extract(SHAPE, [0, 1], {"token_budget": 100, "encode_threads": 1})
    gpu_s = 100 * 2 * 4000 * 2 / 4 / (ASSUMED["peak_tflops"] * 1e12 * ASSUMED["extract_mfu"]) + 2 * ASSUMED[
        "launch_s_per_layer"]
    host = ASSUMED["encode_bytes_per_s_per_thread"] / (2 * 8 * 2)
    assert abs(ext["tok_s"] - min(100 / gpu_s, host)) < 1e-6 and ext["basis"].startswith("ASSUMED")
    assert stage_time(1000, {"tok_s": 100, "startup_s": 5}, 3) == {
        "jobs": 3, "job_seconds": 25.0, "gpu_hours": 25 / 3600, "startup_share": 0.6}


def test_measured_rates_are_used_and_labelled():
    rates = {"device": "NVIDIA H200", "extract": {"tok_s": 1000.0, "startup_s": 10.0, "how": "x"},
             "train": {"tok_s": 250.0, "startup_s": 30.0, "how": "y"}}
    plan = make_plan(_tok(10, 100, 60), SHAPE, [0, 1], generate={"enabled": False}, tokenize={"max_length": 3072},
                     extract={"codec": "zstd"}, train={"epochs": 2}, rates=rates, extract_jobs=4)
    assert plan["extract_tok_s"] == 1000 and plan["extract_tok_s_source"] == "measured on NVIDIA H200 (x)"
    assert abs(plan["extract_gpu_hours"] * 3600 - (4 * 10 + 1000 / 1000)) < 1e-9
    assert plan["train_tok_s"] == 250 and plan["train_tok_s_source"].startswith("measured on NVIDIA H200")
    assert abs(plan["train_gpu_hours"] * 3600 - (30 + 2000 / 250)) < 1e-9
    text = render(plan, SHAPE, [0, 1])
    assert "measured on NVIDIA H200 (x)) + 4 job(s) x 10 s start-up" in text
    modelled = make_plan(_tok(10, 100, 60), SHAPE, [0, 1], generate={"enabled": False},
                         tokenize={"max_length": 3072}, extract={"codec": "zstd"}, train={"epochs": 2})
    assert "ASSUMED (cost model" in render(modelled, SHAPE, [0, 1])


def test_calibrate_rates_measures_extract_and_train_on_cpu(tiny_target, tmp_path):
    rng = np.random.default_rng(0)
    rows = {k: [] for k in ("sample_id", "input_ids", "loss_mask", "length", "num_loss_tokens", "truncated")}
    for i in range(40):
        n = int(rng.integers(20, 80))
        rows["sample_id"].append(f"s-{i}")
        rows["input_ids"].append(rng.integers(0, 1000, n).tolist())
        rows["loss_mask"].append([0] * (n // 2) + [1] * (n - n // 2))
        rows["length"].append(n)
        rows["num_loss_tokens"].append(n - n // 2)
        rows["truncated"].append(False)
    pq.write_table(pa.table(rows), tmp_path / "t-00000.parquet")
    train = {"device": "cpu", "batch_size": 2, "max_length": 128, "num_anchors": 4, "num_layers": 2,
             "target_layer_ids": "1,3"}
    run_cli("calibrate-rates", "--tokens", tmp_path / "t-00000.parquet", "--model", tiny_target,
            "--extract-settings", json.dumps({"device": "cpu", "target_layer_ids": "1,3"}),
            "--train-settings", json.dumps(train), "--measure-tokens", 800, "--warmup-tokens", 200,
            "--train-steps", 2, "--work-dir", tmp_path / "work", "--out", tmp_path / "rates.json")
    rates = json.loads((tmp_path / "rates.json").read_text())
    assert rates["device"] == "cpu" and not (tmp_path / "work").exists()
    assert rates["extract"]["tok_s"] > 0 and rates["extract"]["tokens"] >= 800 and rates["extract"]["startup_s"] > 0
    assert rates["train"]["tok_s"] > 0 and rates["train"]["steps"] == 4 and "left out" in rates["train"]["how"]
