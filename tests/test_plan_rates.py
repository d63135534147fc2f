"""The plan's GPU rates: a measured rate is used and labelled measured; the cost model on a tiny shape; the
projection adds every job's start-up; calibrate-rates measures through the stages' own code, as a workflow job
before the plan (CPU, tiny target)."""

from __future__ import annotations

import json
import re

import pytest

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


def test_the_plan_takes_the_extraction_mode_its_jobs_will_take():
    """calibrate-rates times eager and compiled extraction on a GPU (compile=auto); the plan projects each job in
    the mode that job will choose by its own tokens (the H100 run of stop 36: calibrated compiled, ran eager)."""
    from dflash_pipeline.hidden_states.compile_choice import COMPILE_MIN_TOKENS

    modes = {"eager": {"tok_s": 120_000.0, "startup_s": 12.0, "how": "eager"},
             "compiled": {"tok_s": 480_000.0, "startup_s": 35.0, "how": "compiled"}}
    rates = {"device": "NVIDIA H100", "extract": {**modes["compiled"], "modes": modes},
             "train": {"tok_s": 250.0, "startup_s": 30.0}}

    def plan(samples, jobs, compile_setting="auto"):
        return make_plan(_tok(samples, 100, 60), SHAPE, [0, 1], generate={"enabled": False},
                         tokenize={"max_length": 3072}, extract={"codec": "zstd", "compile": compile_setting},
                         train={"epochs": 1}, rates=rates, extract_jobs=jobs)

    small = plan(12_000, 6)  # 200K tokens a job: eager
    assert small["extract_tok_s"] == 120_000 and small["extract_startup_s"] == 12.0
    assert abs(small["extract_gpu_hours"] * 3600 - (6 * 12.0 + 1_200_000 / 120_000)) < 1e-9
    big = plan(COMPILE_MIN_TOKENS // 100, 1)  # one job of COMPILE_MIN_TOKENS tokens: compiled
    assert big["extract_tok_s"] == 480_000 and "compiled" in big["extract_tok_s_source"]
    assert plan(COMPILE_MIN_TOKENS // 100, 1, compile_setting=False)["extract_tok_s"] == 120_000


def test_evaluation_is_projected_from_the_measured_decode_steps(tmp_path):
    """Prompt sets in batches, a decoder's set-up per batch and run, max_new_tokens steps a run (tau 1, stated),
    step times linear in the batch between the measured sizes, the speed-up prompts at batch 1, the target's load
    first; without measured steps the plan says why it has no figure."""
    from dflash_pipeline.planning.evaluate_rates import project, step_time

    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(f'{{"question_id": {i}}}\n' for i in range(80)))
    rates = {"device": "NVIDIA H100", "extract": {"tok_s": 1e5, "startup_s": 20.0, "load_s": 6.0,
                                                  "process_start_s": 1.0},
             "train": {"tok_s": 1e4, "startup_s": 30.0},
             "evaluate": {"plain_step_s": {"1": 0.002, "64": 0.004}, "speculative_step_s": {"1": 0.006, "64": 0.010},
                          "setup_s": 0.5}}
    assert step_time(rates["evaluate"]["plain_step_s"], 32) == 0.002 + 0.002 * 31 / 63
    evaluate = {"holdout_fraction": 0.02, "num_prompts": 64, "max_new_tokens": 256, "temperatures": [0, 0.7],
                "speedup_prompts": 4, "prompts_file": str(questions), "batch_size": 32}
    plain, spec = (lambda b: step_time(rates["evaluate"]["plain_step_s"], b),
                   lambda b: step_time(rates["evaluate"]["speculative_step_s"], b))
    # 3,000 samples: 60 held-out prompts (batches of 32 and 28), the file's 80 (32, 32, 16); 4 runs a batch
    batch = lambda b: 5 * 0.5 + 256 * (plain(b) + 4 * spec(b))  # noqa: E731
    want = 7.0 + 3 * batch(32) + batch(28) + batch(16) + 4 * (2 * 0.5 + 256 * (plain(1) + spec(1)))
    got = project(evaluate, 3000, rates)
    assert abs(got["seconds"] - want) < 1e-9 and "ASSUMED tau 1" in got["basis"]
    plan = make_plan(_tok(3000, 100, 60), SHAPE, [0, 1], generate={"enabled": False}, tokenize={"max_length": 3072},
                     extract={"codec": "zstd"}, train={"epochs": 2}, rates=rates, evaluate=evaluate)
    assert abs(plan["evaluate_hours"] * 3600 - want) < 1e-9
    assert f"evaluate: {want / 60:.1f} min (decode steps measured on NVIDIA H100" in render(plan, SHAPE, [0, 1])
    failed = dict(rates, evaluate={"error": "OutOfMemoryError: CUDA out of memory"})
    none = make_plan(_tok(3000, 100, 60), SHAPE, [0, 1], generate={"enabled": False}, tokenize={"max_length": 3072},
                     extract={"codec": "zstd"}, train={"epochs": 2}, rates=failed, evaluate=evaluate)
    assert none["evaluate_hours"] is None
    assert "evaluate: not projected: OutOfMemoryError" in render(none, SHAPE, [0, 1])


@pytest.mark.slow
def test_calibrate_rates_runs_before_the_plan_through_the_workflow(tmp_path, tiny_target):
    """cost.calibrate_rates through the real Snakefile (tiny config, CPU): the rates job measures extraction and
    training with the run's settings, the plan projects both from them ("measured"), and a new learning rate
    (training's outcome, not its speed) measures nothing again while a new batch size does."""
    from workflow_runs import make_workdir, snakemake

    work = make_workdir(tmp_path / "w", model=tiny_target)  # the session's: what the demo's rule builds here
    (work / "rates.yaml").write_text("cost:\n  calibrate_rates: true\n  calibrate_rates_tokens: 2048\n"
                                     "  calibrate_rates_train_steps: 2\n")
    configs = ("tiny.yaml", "rates.yaml")
    snakemake(work, "results/plan.json", "--cores", "2", configfiles=configs)
    rates = json.loads((work / "results/calibration/rates.json").read_text())
    assert rates["device"] == "cpu"
    assert rates["extract"]["tok_s"] > 0 and rates["extract"]["tokens"] > 0 and rates["extract"]["startup_s"] > 0
    assert rates["train"]["tok_s"] > 0 and rates["train"]["steps"] == 4 and "left out" in rates["train"]["how"]
    steps = rates["evaluate"]  # the evaluator's decode steps, timed with an untrained drafter of the run's shape
    assert "error" not in steps, steps["error"]
    assert set(steps["plain_step_s"]) == set(steps["speculative_step_s"]) == {"1", "64"}, steps
    assert min(steps["plain_step_s"].values()) > 0 and steps["setup_s"] >= 0
    plan = (work / "results/plan.txt").read_text()
    assert re.search(r"evaluate: [0-9.]+ min \(decode steps measured on cpu", plan), plan
    assert "at {:,.0f} tok/s (measured on cpu".format(rates["extract"]["tok_s"]) in plan, plan
    assert "at {:,.0f} tok/s (measured on cpu".format(rates["train"]["tok_s"]) in plan, plan

    (work / "lr.yaml").write_text("train:\n  lr: 0.001\n")
    out = snakemake(work, "-n", "results/plan.json", configfiles=(*configs, "lr.yaml"))
    assert "Nothing to be done" in out.stdout + out.stderr, (out.stdout + out.stderr)[-2000:]
    (work / "batch.yaml").write_text("train:\n  batch_size: 3\n")
    out = snakemake(work, "-n", "results/plan.json", configfiles=(*configs, "batch.yaml"))
    assert re.search(r"^calibrate_rates\s+1$", out.stdout + out.stderr, flags=re.M), (out.stdout + out.stderr)[-2000:]


def test_a_corpus_smaller_than_warm_up_plus_measurement_is_still_measured(tmp_path):
    """A small run (fewer tokens than the warm-up alone) gives a quarter of its tokens to the warm-up and
    measures the rest, instead of failing; a large one keeps the asked warm-up."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_pipeline.planning.calibrate_rates import draw_samples

    n, length = 40, 100
    pq.write_table(pa.table({"sample_id": [f"s{i}" for i in range(n)], "input_ids": [[1] * length] * n,
                             "loss_mask": [[1] * length] * n, "length": [length] * n, "num_loss_tokens": [50] * n,
                             "truncated": [False] * n}), tmp_path / "t.parquet")

    def tokens(path):
        return sum(pq.read_table(path, columns=["length"]).column("length").to_pylist())

    warm, measure = draw_samples([str(tmp_path / "t.parquet")], 32768, 131072, str(tmp_path))
    assert (tokens(warm), tokens(measure)) == (1000, 3000)
    warm, measure = draw_samples([str(tmp_path / "t.parquet")], 1000, 1000, str(tmp_path))
    assert (tokens(warm), tokens(measure)) == (1000, 1000)


def test_a_slot_engine_job_pays_its_drain_and_a_server_job_does_not():
    """The hf slot engine's captured step costs the same however few rows remain, so a job loses about half of
    its last round (the longest answer's steps at capacity / rate a step); a job smaller than one round lasts the
    longest answer. Stop 36's H100 shape: 2,048 slots at 30.4K tok/s, answers up to 256 tokens, one job of
    599K tokens."""
    from dflash_pipeline.planning.projection import RunShape, drain_seconds, project_generation

    step = 2048 / 30_400
    assert abs(drain_seconds(2048, 30_400, 256, 599_000) - 0.5 * 256 * step) < 1e-9
    assert abs(drain_seconds(2048, 30_400, 256, 100_000) - (256 * step - 100_000 / 30_400)) < 1e-9
    assert drain_seconds(0, 30_400, 256, 599_000) == 0.0
    cal = {"output_tokens": {"mean": 200.0, "max": 256}, "throughput": {"output_tok_s": 30_400.0},
           "startup_s": 21.0, "requests": {"samples": 2048}, "engine": {"capacity": 2048},
           "settings": {"backend": "hf"}}
    shape = RunShape(samples=3000, jobs=1, parallel_jobs=1, gpus_per_job=1, max_new_tokens=256)
    hf = project_generation(cal, shape)
    assert hf["drain_s"] == drain_seconds(2048, 30_400, 256, 600_000) and hf["startup_s"] == 21.0
    assert abs(hf["job_hours"] * 3600 - (21.0 + hf["drain_s"] + 600_000 / 30_400)) < 1e-9
    served = project_generation({**cal, "settings": {"backend": "sglang"}}, shape)
    assert served["drain_s"] == 0.0 and abs(served["job_hours"] * 3600 - (21.0 + 600_000 / 30_400)) < 1e-9


def test_a_stalled_short_run_is_timed_again_not_an_error(tiny_target, tmp_path, monkeypatch):
    """On a busy machine (a CI worker beside it) a timed run can stall: the evaluator's step time is the fastest of
    the timed runs, each timed after its prefill, and never fails the calibration (two fresh-clone CI runs lost
    their evaluate rates when it was the difference of a short and a long run: the prefill varied more than the
    steps took)."""
    from dataclasses import asdict

    from dflash_pipeline.drafter import batched_decoding
    from dflash_pipeline.drafter.config import DrafterConfig
    from dflash_pipeline.planning import evaluate_rates
    from token_fixtures import write_greedy_token_shard

    shard = tmp_path / "tokens.parquet"
    write_greedy_token_shard(str(tiny_target), str(shard), 4, prompt_len=8, new_tokens=8, seed=0, prefix="p")
    config = asdict(DrafterConfig.from_target(json.loads((tiny_target / "config.json").read_text()), 1, [0, 1], 4, 0))
    monkeypatch.setattr(evaluate_rates, "LADDER", (1, 2))
    original, lengths = batched_decoding.BatchDecoder.run, []

    def stalled_once(self):
        result = original(self)
        lengths.append(self.max_new)
        if len(lengths) == 2:  # the first timed run (after the untimed warm-up): a 5 s stall in its steps
            result.decode_seconds += 5.0
        assert 0 < result.prefill_seconds < result.decode_seconds
        return result

    monkeypatch.setattr(batched_decoding.BatchDecoder, "run", stalled_once)
    steps = evaluate_rates.measure(str(tiny_target), config, str(shard))
    warm, timed = evaluate_rates.WARMUP_STEPS, evaluate_rates.STEPS
    # per batch and kind (plain and speculative at batches 1 and 2): a warm-up, then the timed runs
    assert lengths == [warm, *[timed] * evaluate_rates.TIMED] * 4, lengths
    assert 0 < steps["plain_step_s"][1] < 5.0 / timed  # the stalled run is not the one that counts
    assert all(v > 0 for kind in ("plain_step_s", "speculative_step_s") for v in steps[kind].values()), steps
