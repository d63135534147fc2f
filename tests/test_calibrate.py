"""Generation calibration: the stratified sample, the measured rate against the SGLang-speaking test server
(a simulated decode rate we control), the projection against a measured full run, and the generation gate."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from conftest import run_cli
from dflash_pipeline.data.conversations import SAMPLE_SCHEMA, sample_id
from dflash_pipeline.generation.calibrate import Timed, rate_figures
from dflash_pipeline.planning.calibration_sample import stratified
from generation_helpers import SGLangTestServer, read_summary
from workflow_runs import make_workdir, planned, snakemake

RATE = 2500  # output tokens/s of the simulated server, shared by the requests in flight
FAST = ["--backoff-base", "0.02", "--backoff-max", "0.2", "--progress-interval", "0.5"]


def synthetic_corpus(root: Path, shards=(8, 40, 110), per_shard=100, seed=0):
    """Shards whose prompts differ in length (the instant server answers longer prompts at more length);
    returns (ingested shard paths, token file paths)."""
    rng = random.Random(seed)
    shard_paths, token_paths = [], []
    for k, mean_words in enumerate(shards):
        rows, toks = [], []
        for i in range(per_shard):
            words = max(1, int(rng.gauss(mean_words, mean_words / 3)))
            prompt = f"q{k}.{i} " + " ".join(["word"] * words)
            messages = [{"role": "user", "content": prompt, "reasoning_content": None},
                        {"role": "assistant", "content": "OK.", "reasoning_content": None}]
            sid = sample_id(messages)
            rows.append({"sample_id": sid, "source": "syn", "source_id": None, "messages": messages})
            toks.append({"sample_id": sid, "length": words + 1 + 7, "num_loss_tokens": 7})
        shard = root / "ingest" / f"syn-{k:05d}.parquet"
        tokens = root / "tokens" / f"syn-{k:05d}.parquet"
        for path in (shard, tokens):
            path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA), shard)
        pq.write_table(pa.table({"sample_id": [t["sample_id"] for t in toks],
                                 "length": pa.array([t["length"] for t in toks], pa.int32()),
                                 "num_loss_tokens": pa.array([t["num_loss_tokens"] for t in toks], pa.int32())}),
                       tokens)
        shard_paths.append(shard)
        token_paths.append(tokens)
    return shard_paths, token_paths


def backend_args(url: str) -> list[str]:
    return ["--backend", "servers", "--servers", url, "--max-in-flight", "16", "--max-new-tokens", "512",
            "--temperature", "0"]


# ------------------------------------------------------------------------------------------------------
def test_stratified_sample_spans_prompt_lengths_and_shards():
    rng = random.Random(1)
    population = [(f"s{k}", f"{k}-{i}", int(rng.expovariate(1 / (10 + 100 * k))))
                  for k in range(5) for i in range(2000)]
    measured, warm = stratified(population, 100, 8, seed=3)
    assert len(measured) == 100 and len(warm) == 8
    assert len({m[1] for m in measured} | {w[1] for w in warm}) == 108  # no repeats, warm-up apart
    assert {m[0] for m in measured} == {f"s{k}" for k in range(5)}
    # one draw per equal-count stratum: the sample's quantiles are the corpus's
    lengths = sorted(p[2] for p in population)
    sample = sorted(m[2] for m in measured)
    for q in (0.1, 0.5, 0.9):
        lo, hi = lengths[int((q - 0.02) * len(lengths))], lengths[int((q + 0.02) * len(lengths))]
        assert lo <= sample[int(q * 100)] <= hi
    assert abs(sum(sample) / 100 - sum(lengths) / len(lengths)) < 0.05 * sum(lengths) / len(lengths)
    # the first 100 prompts of the first shard, for contrast, say nothing about the corpus
    assert sum(p[2] for p in population[:100]) / 100 < 0.3 * sum(lengths) / len(lengths)


def test_projection_within_ten_percent_of_the_measured_full_run(tmp_path, tiny_target, monkeypatch):
    """Long-lived servers (backend `servers`): the same endpoints serve the calibration and the full run."""
    monkeypatch.setenv("DFLASH_TEST_SERVER_TOKENS_PER_S", str(RATE))
    monkeypatch.setenv("DFLASH_TEST_SERVER_ANSWER_WORDS_PER_PROMPT_WORD", "1.0")
    shards, tokens = synthetic_corpus(tmp_path)
    sample = tmp_path / "calibration" / "sample.parquet"
    run_cli("calibrate-sample", "--tokens", *tokens, "--shards", *shards, "--samples", "48", "--warmup", "4",
            "--out", sample)
    cal_path = tmp_path / "calibration" / "generation.json"
    with SGLangTestServer(tiny_target, "--reasoning-parser", "qwen3", engine="instant") as server:
        proc = run_cli("calibrate", "--input", sample, "--out", cal_path, *FAST, *backend_args(server.url))
        cal = json.loads(cal_path.read_text())
        cfg = {"generate": {"enabled": True, "max_new_tokens": 512, "shards_per_job": 3, "gpus": 0},
               "tokenize": {"max_length": 4096}, "extract": {"codec": "zstd"}, "drafter": {"num_layers": 2}}
        run_cli("plan", "--tokens", *tokens, "--model", tiny_target, "--config", json.dumps(cfg),
                "--calibration", cal_path, "--json", tmp_path / "plan.json")
        projected = json.loads((tmp_path / "plan.json").read_text())["generation"]
        # the full run: every shard in one job, the same servers and flags
        outs = [tmp_path / "out" / s.name for s in shards]
        full = run_cli("generate", "--input", *shards, "--out", *outs, *FAST, *backend_args(server.url),
                       "--calibration", cal_path)
    assert "CALIBRATION (48 samples from 3 shards" in proc.stdout
    assert 0.9 * RATE < cal["throughput"]["output_tok_s"] < 1.1 * RATE, cal["throughput"]
    assert cal["throughput"]["steady_state"] and cal["output_tokens"]["max"] > 3 * cal["output_tokens"]["p10"]
    assert cal["requests"] == {"samples": 48, "ok": 48, "failed": 0, "attempts": 48, "workers": 16}
    assert cal["window"]["warmup_requests"] == 4 and cal["failure_rate"] == 0
    assert cal["thinking"]["samples_with_thinking"] == 1.0
    summaries = [read_summary(o) for o in outs]
    actual_s = max(s["this_run"]["wall_s"] for s in summaries)
    actual_tokens = sum(s["completion_tokens"] for s in summaries)
    assert abs(projected["expected_output_tokens"] - actual_tokens) < 0.05 * actual_tokens
    # the job's own clock starts after python's start-up and imports, which the projection counts (startup_parts)
    assert projected["drain_s"] == 0  # servers: no fixed-width step
    job_s = projected["wall_hours"] * 3600 - cal["startup_parts"]["process_s"]
    assert abs(job_s - actual_s) < 0.10 * actual_s, (projected, actual_s)
    # the live rate against the calibration, in the progress lines and every shard's summary
    assert "of calibration" in full.stderr
    assert all(s["calibration"]["output_tok_s"] == cal["throughput"]["output_tok_s"] for s in summaries)
    last = max(summaries, key=lambda s: s["this_run"]["wall_s"])  # the whole run's live rate when it ended
    assert 0.85 < last["calibration"]["ratio"] < 1.15, last["calibration"]


def test_workflow_gate_stops_before_generation_and_reruns_do_not_recalibrate(tmp_path, tiny_target):
    """One real Snakemake run (tiny demo config, hf backend on CPU) up to the generation gate."""
    work = make_workdir(tmp_path / "run", model=tiny_target)
    wanted = yaml.safe_load((work / "tiny.yaml").read_text())["generate"]["calibrate"]
    configs = ("tiny.yaml", "limit.yaml")
    (work / "limit.yaml").write_text("generate:\n  max_wall_hours: 1.0e-07\n")
    proc = snakemake(work, "--cores", "2", configfiles=configs, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "GENERATION GATE: STOP before the full generation" in out and "exceeds generate.max_wall_hours" in out
    assert f"CALIBRATION ({wanted['samples']} samples" in out and "what changes it" in out  # figures, alternatives
    assert not list((work / "results").glob("completions/*.parquet")), "nothing may be generated"
    cal = work / "results/calibration/generation.json"
    figures = json.loads(cal.read_text())
    assert figures["requests"]["samples"] == wanted["samples"] and figures["startup_s"] > 0
    assert figures["window"]["warmup_requests"] == wanted["warmup_requests"]
    plan = json.loads((work / "results/plan.json").read_text())
    assert plan["generation"]["wall_hours"] > 1.0e-07 and plan["generation"]["samples"] == plan["samples"]
    stamp = cal.stat().st_mtime_ns
    # a raised limit and other progress settings: the gate and the plan are redone, the calibration is not
    (work / "limit.yaml").write_text("generate:\n  max_wall_hours: 1000\n  progress_interval_s: 3\n")
    rerun = planned(snakemake(work, "-n", configfiles=configs))
    assert "calibrate" not in rerun and "calibration_sample" not in rerun and rerun.get("generation_gate") == 1
    snakemake(work, "--cores", "2", "results/calibration/gate.ok", configfiles=configs)
    assert cal.stat().st_mtime_ns == stamp
    # a sampling or backend change recalibrates (from the same sample)
    (work / "hot.yaml").write_text("generate:\n  temperature: 0.5\n  hf:\n    batch_size: 8\n")
    changed_run = planned(snakemake(work, "-n", configfiles=(*configs, "hot.yaml")))
    assert changed_run.get("calibrate") == 1 and "calibration_sample" not in changed_run, changed_run


def _simulate(lengths: list[int], workers: int, shared_rate: float | None = None, own_rate: float | None = None):
    """Request timings of `workers` clients pulling `lengths` from a queue, against a server that either shares
    `shared_rate` tok/s among the requests in flight or decodes each at `own_rate` (exact event simulation)."""
    queue, now, active, done = list(lengths), 0.0, {}, []
    for w in range(min(workers, len(queue))):
        active[w] = [now, float(queue.pop(0)), 0]
        active[w][2] = int(active[w][1])
    while active:
        speed = shared_rate / len(active) if shared_rate else own_rate
        w = min(active, key=lambda k: active[k][1])
        step = active[w][1] / speed
        now += step
        for k in active:
            active[k][1] -= step * speed
        start, _, tokens = active.pop(w)
        done.append(Timed(start, now, {"completion_tokens": tokens}))
        if queue:
            active[w] = [now, float(queue[0]), queue.pop(0)]
    return done


def test_steady_state_rate_is_exact_for_shared_and_per_request_servers():
    rng = random.Random(5)
    lengths = [int(rng.lognormvariate(5, 1)) + 1 for _ in range(256)]
    shared = rate_figures(_simulate(lengths, 32, shared_rate=3000.0), 32)
    assert shared["steady_state"] and abs(shared["output_tok_s"] - 3000) < 0.005 * 3000
    own = rate_figures(_simulate(lengths, 32, own_rate=50.0), 32)  # 32 slots x 50 tok/s
    assert own["steady_state"] and abs(own["output_tok_s"] - 1600) < 0.01 * 1600
    assert own["output_tok_s_whole_window"] < 0.9 * 1600  # the drain at the end: why the whole window is not used
    # one round of 256 against 256 slots (the default config): the first 10% of answers still measure it
    full_round = rate_figures(_simulate(lengths, 256, own_rate=50.0), 256)
    assert full_round["steady_state"] and abs(full_round["output_tok_s"] - 12_800) < 0.05 * 12_800
    assert full_round["output_tok_s_whole_window"] < 0.1 * 12_800
    # a round of 32: too few requests run with the slots busy: a stated lower bound
    one_round = rate_figures(_simulate(lengths[:32], 32, own_rate=50.0), 32)
    assert not one_round["steady_state"] and "lower bound" in one_round["basis"]
    assert one_round["output_tok_s"] < 1600
    # fewer samples than the job's request slots: the servers ran less loaded than the run will keep them
    partial = rate_figures(_simulate(lengths, 32, own_rate=50.0), 32, capacity=256)
    assert not partial["steady_state"] and "only 32 of the job's 256 request slots" in partial["basis"]


def test_an_engine_count_of_its_saturated_rounds_is_the_steady_rate():
    """An in-process engine's own count (tokens decoded while requests waited for a slot) replaces Little's law,
    which stays in the figures; a count shorter than MIN_ENGINE_S is not used."""
    from dflash_pipeline.generation.calibrate import MIN_ENGINE_S

    rng = random.Random(7)
    timed = _simulate([int(rng.lognormvariate(5, 1)) + 1 for _ in range(256)], 32, own_rate=50.0)
    little = rate_figures(timed, 32)
    counted = rate_figures(timed, 32, engine_saturated=(90_000, 30.0))
    assert counted["output_tok_s"] == 3000.0 and counted["steady_state"]
    assert counted["basis"].startswith("engine-side steady state: 90,000 answer tokens decoded in 30.0 s")
    assert counted["output_tok_s_little"] == little["output_tok_s"] and counted["engine_saturated_s"] == 30.0
    short = rate_figures(timed, 32, engine_saturated=(900, MIN_ENGINE_S / 2))
    assert short["output_tok_s"] == little["output_tok_s"] and "engine_saturated_s" not in short
