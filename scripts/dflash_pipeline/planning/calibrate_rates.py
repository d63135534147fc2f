"""`dflash-pipeline calibrate-rates`: extraction and training rates measured on the GPU the run will use.

Samples of the run's own token shards go through the stages' own code at the run's settings: `extract_shards`
(one job of two shards of the same size: a warm-up shard, which pays compilation, the allocator's growth and the
first batches, then the measured one, unseen)
and then `train` on the measured shard's hidden states (offline) or tokens (online) for 2 x W steps, logged
every W steps, so that the second record is the rate with the first W steps (warm-up, compilation) left out.
What a job pays before its first token is measured too: the process's age when the target starts loading
(python, torch), the load, and the warm-up's time beyond its tokens at the measured rate. The plan
(planning/rates.py) projects each stage as jobs x start-up + tokens / rate and labels these "measured". The
evaluator's decode steps are timed too (planning/evaluate_rates.py), so that the plan projects evaluation.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import shutil
import time

from dflash_pipeline import cli, storage
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.planning import evaluate_rates
from dflash_pipeline.process_clock import process_age_s

log = logging.getLogger(__name__)
TOKEN_COLUMNS = ["sample_id", "input_ids", "loss_mask", "length", "num_loss_tokens", "truncated"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", nargs="+", required=True, help="the run's token shards (samples are drawn from them)")
    p.add_argument("--model", required=True, help="target model directory")
    p.add_argument("--extract-settings", default="{}", help="the extract rule's --settings JSON")
    p.add_argument("--train-settings", default="{}", help="the train rule's --settings JSON")
    p.add_argument("--shards-per-job", type=int, help="extract.shards_per_job (decides compile=auto)")
    p.add_argument("--encode-threads", type=int, help="the extract jobs' encode threads (their rule's threads)")
    p.add_argument("--measure-tokens", type=int, default=131072, help="tokens of the measured extraction shard")
    p.add_argument("--warmup-tokens", type=int, default=131072,
                   help="tokens of the warm-up shard (not measured; as large as the measured one: a job's first)")
    p.add_argument("--train-steps", type=int, default=8, help="measured training steps (as many warm-up steps first)")
    p.add_argument("--skip-train", action="store_true", help="measure extraction only")
    p.add_argument("--work-dir", required=True, help="scratch directory (removed at the end)")
    p.add_argument("--out", required=True, help="the rates (JSON)")


def draw_samples(paths: list[str], warmup_tokens: int, measure_tokens: int, out_dir: str) -> tuple[str, str]:
    """Two token shards from the run's data (samples with supervised tokens, taken round-robin over the
    shards in file order): `warmup.parquet` and `measure.parquet`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for p in paths:
        with storage.open_binary(p) as fh:
            tables.append(pq.read_table(fh, columns=TOKEN_COLUMNS))
    rows = [t.slice(i, 1) for i in range(max(t.num_rows for t in tables)) for t in tables if i < t.num_rows]
    rows = [r for r in rows if r.column("num_loss_tokens")[0].as_py()]
    parts: list[list] = [[], []]
    total = sum(r.column("length")[0].as_py() for r in rows)
    # a corpus smaller than warm-up + measurement still gets measured: a quarter of it warms up
    need, got = [min(warmup_tokens, total // 4) if total < warmup_tokens + measure_tokens else warmup_tokens,
                 measure_tokens], [0, 0]
    for r in rows:
        k = 0 if got[0] < need[0] else 1
        if got[1] >= need[1]:
            break
        parts[k].append(r)
        got[k] += r.column("length")[0].as_py()
    if not parts[1]:
        raise PipelineError(f"calibrate-rates: {sum(got)} tokens in {len(paths)} shard(s): too few to measure")
    outs = []
    for name, part in zip(("warmup", "measure"), parts):
        path = os.path.join(out_dir, f"{name}.parquet")
        pq.write_table(pa.concat_tables(part or parts[1][:1]), path)
        outs.append(path)
    return outs[0], outs[1]


def measure_extract(args, warm: str, meas: str, model_age_s: float) -> tuple[dict, str]:
    """Extraction's rate and start-up per job, in the mode the run's jobs take: compile=auto decides per job by
    its tokens, which after regeneration the plan knows and this job does not, so on a GPU both modes are timed
    (eager first, then compiled) and the plan picks (rates.extract_rate). The top-level figures are the mode
    these source shards' jobs would take."""
    from dflash_pipeline.hidden_states import extract as ex

    eargs = cli.stage_args("extract", ["--tokens", warm, "--model", args.model, "--out", "x", "--settings",
                                     args.extract_settings, "--encode-threads", str(args.encode_threads)])
    settings = ex.settings_from_args(eargs)
    device = ex.target.resolve_device(settings.device)
    job_tokens = _mean_shard_tokens(args.tokens) * max(1, args.shards_per_job)
    if settings.compile == "auto" and device.startswith("cuda"):
        modes = [False, True]  # eager first: compiling changes the loaded model's layers for good
    else:
        modes = [ex.should_compile(settings.compile, device, job_tokens)]
    t0 = time.perf_counter()
    model = ex.load_target(args.model, settings)
    load_s = time.perf_counter() - t0
    timed, hidden = {}, None
    for compiled in modes:
        name = "compiled" if compiled else "eager"
        # a warm-up shard as large as the measured one, then the measured shard's first pass: a job's shard after
        # its first. Stop 37/38, H100 eager: after a 34K-token warm-up the first pass ran at 78K tok/s and a second
        # pass of the same shard (every batch shape seen) at 235K, where the job's shards ran at 150-165K after
        # its first (117K)
        outs = [os.path.join(args.work_dir, f"{n}-{name}.dfhs") for n in ("warmup", "measure")]
        w, m = ex.extract_shards([warm, meas], args.model, outs, ex.dataclasses.replace(settings, compile=compiled),
                                 model=model)
        rate = m["this_run"]["tokens"] / m["seconds"]  # the whole shard call: batches, encoding, the file's close
        warm_extra = max(0.0, w["seconds"] - w["this_run"]["tokens"] / rate)  # compilation included
        timed[name] = {"tok_s": rate, "startup_s": model_age_s + load_s + warm_extra, "tokens": m["this_run"]["tokens"],
                       "warmup_excess_s": round(warm_extra, 3),
                       "how": f"{m['this_run']['tokens']:,} tokens after a {w['this_run']['tokens']:,}-token warm-up "
                              f"shard, {name}"}
        hidden = outs[1]
    del model
    chosen = "compiled" if ex.should_compile(settings.compile, device, job_tokens) else "eager"
    if chosen not in timed:
        chosen = next(iter(timed))
    return {**timed[chosen], "load_s": round(load_s, 3), "process_start_s": round(model_age_s, 3),
            "compiled": chosen == "compiled", "compile_setting": settings.compile, "modes": timed}, hidden


def _mean_shard_tokens(paths: list[str]) -> float:
    import pyarrow.parquet as pq

    total = 0
    for p in paths:
        with storage.open_binary(p) as fh:
            total += sum(pq.read_table(fh, columns=["length"]).column("length").to_pylist())
    return total / max(1, len(paths))


def measure_train(args, hidden: str, meas: str, process_start_s: float) -> dict:
    """2 x W steps of the real training loop, logged every W: the second record is the steady rate."""
    import pyarrow.parquet as pq

    W = max(1, args.train_steps)
    targs = cli.stage_args("train", ["--inputs", hidden, "--model", args.model, "--out",
                                   os.path.join(args.work_dir, "train"), "--checkpoint-dir",
                                   os.path.join(args.work_dir, "checkpoints"), "--settings", args.train_settings])
    if targs.mode == "online":
        targs.inputs = [meas]
    targs.max_steps, targs.log_every, targs.acceptance_every = 2 * W, W, 0
    targs.checkpoint_every, targs.holdout_fraction, targs.checkpoint_mirror = 10 ** 9, 0.0, ""
    t0 = time.perf_counter()
    targs._run(targs)
    wall = time.perf_counter() - t0
    records = [json.loads(x) for x in open(os.path.join(targs.out, "metrics.jsonl")) if x.strip()]
    steady = next((r for r in records if r["step"] == 2 * W), None)
    if steady is None or not steady.get("tokens_per_s"):
        raise PipelineError("calibrate-rates: the training run logged no steady record")
    rate = float(steady["tokens_per_s"])
    lengths = pq.read_table(meas, columns=["length"]).column("length").to_pylist()
    per_step = targs.batch_size * targs.grad_accum * sum(min(L, targs.max_length) for L in lengths) / len(lengths)
    # a training job starts its own process (python, torch) before it loads anything: as this one did
    return {"tok_s": rate, "startup_s": process_start_s + max(0.0, wall - 2 * W * per_step / rate), "steps": 2 * W,
            "mode": targs.mode, "mfu": steady.get("mfu"),
            "how": f"steps {W + 1}-{2 * W} of {2 * W} ({targs.mode}, batch {targs.batch_size} x {targs.grad_accum}),"
                   f" the first {W} (warm-up, compilation) left out"}


def run(args) -> int:
    age = process_age_s()
    os.makedirs(args.work_dir, exist_ok=True)
    try:
        warm, meas = draw_samples(args.tokens, args.warmup_tokens, args.measure_tokens, args.work_dir)
        extract, hidden = measure_extract(args, warm, meas, age)
        result = {"device": _device_name(), "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  "extract": extract}
        if not args.skip_train:
            _free_gpu()
            result["train"] = measure_train(args, hidden, meas, extract["process_start_s"])
            _free_gpu()
            result["evaluate"] = evaluate_rates.timed_measure(
                args.model, storage.read_json(os.path.join(args.work_dir, "train", "drafter_config.json")), meas)
    finally:
        shutil.rmtree(args.work_dir, ignore_errors=True)
    storage.write_json(args.out, result)
    ev = result.get("evaluate") or {}
    if ev:
        print("calibrate-rates: evaluate " + (ev["error"] if "error" in ev else ", ".join(
            f"batch {b}: plain {1e3 * ev['plain_step_s'][b]:.2f} ms, speculative {1e3 * ev['speculative_step_s'][b]:.2f} "
            "ms a step" for b in ev["plain_step_s"])))
    for stage in ("extract", "train"):
        if stage in result:
            r = result[stage]
            print(f"calibrate-rates: {stage} {r['tok_s']:,.0f} tok/s, start-up {r['startup_s']:.1f} s per job "
                  f"({r['how']}) on {result['device']}")
    return 0


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _free_gpu() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
