"""The plan, printed before any GPU starts: samples, tokens per stage, hidden-state bytes, GPU hours.

It reads the source token shards (they exist before generation), the target's config.json, and the
extract stage's per-shard stats if any shard is done (measured throughput and compression on this target);
otherwise the rates measured on the run's GPU by `calibrate-rates` (--rates), else a cost model marked ASSUMED
(rates.py); training likewise.
When the hidden states would not fit comfortably on a disk it says so and prices the alternatives.

With a generation calibration (`--calibration`, from `dflash-pipeline calibrate`) it projects the full
generation from measured figures (`projection.py`): expected output tokens, wall time, GPU-hours, cost, the
sensitivity and what changes it; and the extraction tokens from the measured answer lengths. Without one,
generation is only bounded by max_new_tokens. `dflash-pipeline generation-gate` stops the run before the
full generation when the projection exceeds generate.max_wall_hours / max_gpu_hours.
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import json
import os

import sys
from collections.abc import Sequence

from dflash_pipeline import settings, storage
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.hidden_states.group_stats import read_shard_stats
from dflash_pipeline.planning import evaluate_rates
from dflash_pipeline.planning.projection import (
    RunShape, assumed_calibration, fmt_hours, gate_failures, project_generation, render_generation,
)
from dflash_pipeline.planning.rates import (
    extract_rates_for_jobs, measured_rate, modelled_extract, modelled_train, stage_time, trained_positions_per_token,
)
from dflash_pipeline.target_layers import resolve_target_layer_ids

DEFAULT_RATIO = {"zstd": 0.69, "raw": 1.0, "fp8": 0.41}
TB = 1e12


def target_shape(model_dir: str) -> dict:
    cfg = storage.read_json(os.path.join(model_dir, "config.json"))
    t = cfg.get("text_config") or cfg
    H, L = int(t["hidden_size"]), int(t["num_hidden_layers"])
    heads = int(t.get("num_attention_heads", 1))
    hd = int(t.get("head_dim") or H // heads)
    kv = int(t.get("num_key_value_heads", heads))
    attn = H * hd * (2 * heads + 2 * kv)
    if t.get("num_experts"):
        inter = int(t.get("moe_intermediate_size", t.get("intermediate_size", 4 * H)))
        mlp = 3 * H * inter * int(t.get("num_experts_per_tok", 1)) + 3 * H * int(t.get("shared_expert_intermediate_size", 0))
    else:
        mlp = 3 * H * int(t.get("intermediate_size", 4 * H))
    return {"hidden_size": H, "num_layers": L, "active_params": L * (attn + mlp),
            "model_type": cfg.get("model_type"), "vocab_size": int(t.get("vocab_size") or cfg.get("vocab_size") or 0),
            "intermediate_size": int(t.get("intermediate_size", 4 * H)), "num_heads": heads, "num_kv_heads": kv,
            "head_dim": hd}


def token_stats(paths) -> dict:
    import pyarrow.parquet as pq

    out = {"samples": 0, "tokens": 0, "loss_tokens": 0, "lengths": [], "prompt_lengths": []}
    for p in paths:
        with storage.open_binary(p) as fh:
            t = pq.read_table(fh, columns=["length", "num_loss_tokens"])
        lengths = t.column("length").to_pylist()
        out["samples"] += len(lengths)
        out["tokens"] += sum(lengths)
        out["loss_tokens"] += sum(t.column("num_loss_tokens").to_pylist())
        out["lengths"].extend(lengths)
        out["prompt_lengths"].extend(a - b for a, b in zip(lengths, t.column("num_loss_tokens").to_pylist()))
    return out


def measured(stats_glob: str | None):
    rows = read_shard_stats(sorted(glob.glob(stats_glob))) if stats_glob else []
    tok = secs = stored = raw = 0
    for _, s in rows:
        tok += (s.get("this_run") or s).get("tokens", 0)  # the tokens of the run that took seconds_extract
        secs += s.get("seconds_extract") or 0
        stored += s.get("stored_bytes", 0)
        raw += s.get("raw_bf16_bytes", 0)
    if not tok or not secs:
        return None
    return {"shards": len(rows), "tok_s": tok / secs, "ratio": stored / raw if raw else None}


def human_bytes(n: float) -> str:
    for unit, size in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def generation_jobs(shards: Sequence[str], shards_per_job: int) -> int:
    """How many generation jobs the workflow makes: consecutive groups of shards_per_job shards per source."""
    groups = set()
    for name in shards:
        src, _, k = name.rpartition("-")
        groups.add((src, int(k) // max(1, shards_per_job) if k.isdigit() else name))
    return max(1, len(groups))


def expected_extract_tokens(prompt_lengths: list[int], output_lengths: list[int], max_len: int) -> float:
    """Sum over samples of E[min(max_len, prompt + answer)], answers drawn from the measured lengths."""
    import numpy as np

    p = np.asarray(prompt_lengths, dtype=np.float64)
    total = sum(float(np.minimum(max_len, p + v).sum()) for v in output_lengths)
    return total / max(len(output_lengths), 1)


def _generation_part(tok: dict, n: float, generate: dict, max_len: int, scale: float, calibration: dict | None,
                     jobs: int, cost: dict | None) -> dict:
    """Generation's numbers: the max_new_tokens bound, and with a calibration the projection and the
    extraction tokens from the measured answer lengths."""
    max_new = int(settings.value(generate, "generate.max_new_tokens"))
    # regenerated samples: each prompt plus at most max_new new tokens, cut at max_length (upper bound)
    bound = sum(min(max_len, p + max_new) for p in tok["prompt_lengths"]) * scale
    part = {"generate_response_tokens_max": n * max_new, "extract_tokens": bound}
    if calibration:
        run_shape = RunShape(samples=n, jobs=max(1, jobs), parallel_jobs=int(settings.value(generate, "generate.parallel_jobs")),
                             gpus_per_job=int(settings.value(generate, "generate.gpus")), max_new_tokens=max_new,
                             gpu_hour_usd=(cost or {}).get("gpu_hour_usd"))
        lengths = calibration["output_tokens"].get("per_sample_all") or [calibration["output_tokens"]["mean"]]
        part.update({"generation": project_generation(calibration, run_shape), "extract_tokens_bound": bound,
                     "extract_tokens": expected_extract_tokens(tok["prompt_lengths"], lengths, max_len) * scale})
    return part


def _training_part(plan: dict, shape: dict, layer_ids, train: dict, usd: float | None, rates: dict | None,
                   block_size: int) -> dict:
    """Training tokens and GPU-hours: the rate measured on this GPU (calibrate-rates), else the cost model
    (rates.py: the drafter's layers and the LM head over the vocabulary per trained position, ASSUMED share of
    the peak); online training without a measurement adds the target's forward at the plan's extraction rate."""
    epochs = int(settings.value(train, "train.epochs"))
    online = train.get("mode") == "online"
    rate = measured_rate(rates, "train")
    if rate is None:
        n = max(plan["samples"], 1e-9)
        mean_tokens = plan["extract_tokens"] / n  # the training data's (regenerated when generation is on)
        per_token = trained_positions_per_token(mean_tokens, max(0.0, mean_tokens - plan["prompt_tokens"] / n),
                                                train, block_size)
        rate = modelled_train(shape, int(train.get("num_layers") or len(layer_ids) or 5), per_token)
        if online:
            rate["tok_s"] = 1 / (1 / rate["tok_s"] + 1 / plan["extract_tok_s"])
    tokens = plan["extract_tokens"] * epochs
    timing = stage_time(tokens, rate, 1)
    hours = timing["gpu_hours"]
    return {"train_tokens": tokens, "train_epochs": epochs, "train_tok_s": rate["tok_s"],
            "train_startup_s": rate["startup_s"], "train_tok_s_source": rate["basis"],
            "train_mode": "online" if online else "offline", "train_gpu_hours": hours,
            "train_cost_usd": hours * usd if usd else None}


def _extract_rate(measured_run: dict | None, rates: dict | None, gpu_tok_s, shape, layer_ids, extract: dict):
    """Measured on this run's shards > measured by calibrate-rates > config extract.assumed_tokens_per_s > the cost
    model; the start-up a job pays comes with it (measured, or the model's)."""
    model = modelled_extract(shape, layer_ids, extract)
    rate = measured_rate(rates, "extract")
    if measured_run:
        startup = rate["startup_s"] if rate else model["startup_s"]
        return {"tok_s": measured_run["tok_s"], "startup_s": startup,
                "basis": f"measured on {measured_run['shards']} extracted shard(s) of this run"}
    if rate:
        return rate
    if gpu_tok_s:
        return {"tok_s": gpu_tok_s, "startup_s": model["startup_s"],
                "basis": "ASSUMED: config extract.assumed_tokens_per_s"}
    return {**model, "basis": f"ASSUMED (cost model, {model['bound']}-bound)"}


def make_plan(tok: dict, shape: dict, layer_ids, *, generate: dict, tokenize: dict, extract: dict,
              train: dict | None = None, measured_run: dict | None = None, scale: float = 1.0,
              gpu_tok_s: float | None = None, calibration: dict | None = None, jobs: int = 1,
              cost: dict | None = None, rates: dict | None = None, extract_jobs: int = 1,
              block_size: int = 16, evaluate: dict | None = None) -> dict:
    """All the numbers of the plan (pure: testable without files). `scale` extrapolates the token files
    to a dataset `scale` times larger (plan a full run from a sample); `jobs`: generation jobs of the whole run."""
    n = tok["samples"] * scale
    max_len = int(settings.value(tokenize, "tokenize.max_length"))
    prompt = (tok["tokens"] - tok["loss_tokens"]) * scale
    response_src = tok["loss_tokens"] * scale
    plan = {"samples": n, "source_tokens": tok["tokens"] * scale, "prompt_tokens": prompt,
            "source_response_tokens": response_src}
    if generate.get("enabled"):
        plan.update(_generation_part(tok, n, generate, max_len, scale, calibration, jobs, cost))
    else:
        plan["extract_tokens"] = sum(min(max_len, L) for L in tok["lengths"]) * scale
    codec = settings.value(extract, "extract.codec")
    ratio = (measured_run or {}).get("ratio") or DEFAULT_RATIO.get(codec, 1.0)
    per_token_raw = len(layer_ids) * shape["hidden_size"] * 2
    plan.update({"codec": codec, "ratio": ratio, "bytes_per_token_raw": per_token_raw,
                 "hidden_bytes_raw": plan["extract_tokens"] * per_token_raw,
                 "hidden_bytes": plan["extract_tokens"] * per_token_raw * ratio,
                 "hidden_bytes_fp8": plan["extract_tokens"] * per_token_raw * DEFAULT_RATIO["fp8"]})
    job_tokens = plan["extract_tokens"] / max(1, extract_jobs)
    job_rates = extract_rates_for_jobs(rates, settings.value(extract, "extract.compile"), job_tokens)
    rate = _extract_rate(measured_run, job_rates, gpu_tok_s, shape, layer_ids, extract)
    timing = stage_time(plan["extract_tokens"], rate, max(1, extract_jobs))
    plan.update({"extract_tok_s": rate["tok_s"], "extract_tok_s_source": rate["basis"],
                 "extract_startup_s": rate["startup_s"], "extract_jobs": timing["jobs"],
                 "extract_gpu_hours": timing["gpu_hours"], "extract_startup_share": timing["startup_share"]})
    usd = (cost or {}).get("gpu_hour_usd")
    plan["gpu_hour_usd"] = usd
    plan["extract_cost_usd"] = plan["extract_gpu_hours"] * usd if usd else None
    plan.update(_training_part(plan, shape, layer_ids, train or {}, usd, rates, block_size))
    plan.update(_evaluation_part(plan, evaluate, rates))
    return plan


def _evaluation_part(plan: dict, evaluate: dict | None, rates: dict | None) -> dict:
    """The evaluation job's hours from the decode steps calibrate-rates timed (planning/evaluate_rates.py), or
    why there is no projection."""
    measured = (rates or {}).get("evaluate") or {}
    if evaluate is None or not measured or "error" in measured:
        why = measured.get("error") or "no decode steps measured (cost.calibrate_rates)"
        why = why.strip().splitlines()[0]  # the error's first line (the whole is in rates.json)
        return {"evaluate_hours": None, "evaluate_basis": f"not projected: {why}"}
    got = evaluate_rates.project(evaluate, plan["samples"], rates)
    return {"evaluate_hours": got["seconds"] / 3600, "evaluate_basis": got["basis"]}


def shard_bytes_warning(plan: dict, shards: float, limit: float) -> list[str]:
    """A shard is one hidden-state file, written and read whole by one job: past `limit` bytes say so, with the
    ingest.shard_size that would fit."""
    if not shards or not limit:
        return []
    per_shard = plan["hidden_bytes"] / shards
    if per_shard <= limit:
        return []
    samples = plan["samples"] / shards
    fit = max(1, int(samples * limit / per_shard))
    return ["", f"  WARNING: a shard's hidden states take {human_bytes(per_shard)} ({samples:,.0f} samples per shard), "
                f"over extract.warn_shard_bytes {human_bytes(limit)}: one job extracts, writes and retries the whole "
                f"file. Set ingest.shard_size to about {fit:,} (or fewer samples of shorter length)."]


def render(plan: dict, shape: dict, layer_ids, disk_warn_bytes: float | None = None) -> str:
    f = lambda x: f"{x:,.0f}"  # noqa: E731
    lines = [
        "PLAN (before any GPU work)",
        f"  target: {shape['model_type']}, {shape['num_layers']} layers, hidden {shape['hidden_size']}, "
        f"~{shape['active_params'] / 1e9:.2f}B active non-embedding params; drafter features from layers {layer_ids}",
        f"  samples: {f(plan['samples'])}",
        f"  source tokens: {f(plan['source_tokens'])} (prompt {f(plan['prompt_tokens'])}, "
        f"response {f(plan['source_response_tokens'])})",
    ]
    if "generation" in plan:
        lines += render_generation(plan["generation"])
    elif "generate_response_tokens_max" in plan:
        lines.append(f"  generate: {f(plan['samples'])} prompts, {f(plan['prompt_tokens'])} prompt tokens, "
                     f"at most {f(plan['generate_response_tokens_max'])} response tokens (no calibration: "
                     "not a projection)")
    how = "expected (the calibration's answer lengths)" if "extract_tokens_bound" in plan else "at most"
    cost = f", ${plan['extract_cost_usd']:,.0f}" if plan.get("extract_cost_usd") is not None else ""
    lines += [
        f"  extract: {how} {f(plan['extract_tokens'])} tokens x {len(layer_ids)} layers x {shape['hidden_size']} "
        f"x 2 bytes = {human_bytes(plan['hidden_bytes_raw'])} raw bf16; stored with codec {plan['codec']} "
        f"(x{plan['ratio']:.2f}): {human_bytes(plan['hidden_bytes'])}",
        f"  extract GPU time: {plan['extract_gpu_hours']:.2f} GPU-hours{cost} at {plan['extract_tok_s']:,.0f} tok/s "
        f"({plan['extract_tok_s_source']}) + {plan['extract_jobs']} job(s) x {plan['extract_startup_s']:.0f} s "
        f"start-up ({plan['extract_startup_share']:.0%} of it)",
        f"  train ({plan['train_mode']}): {f(plan['train_tokens'])} tokens over {plan['train_epochs']} epochs: "
        f"{plan['train_gpu_hours']:,.2f} GPU-hours"
        + (f", ${plan['train_cost_usd']:,.0f}" if plan.get("train_cost_usd") is not None else "")
        + f" at {plan['train_tok_s']:,.0f} tok/s ({plan['train_tok_s_source']}) + {plan['train_startup_s']:.0f} s "
        "start-up",
    ]
    if plan.get("evaluate_hours") is not None:
        lines.append(f"  evaluate: {plan['evaluate_hours'] * 60:.1f} min ({plan['evaluate_basis']})")
    elif plan.get("evaluate_basis"):
        lines.append(f"  evaluate: {plan['evaluate_basis']}")
    if plan["hidden_bytes"] >= settings.value({"warn_bytes": disk_warn_bytes}, "extract.warn_bytes"):
        hb = plan["hidden_bytes"]
        lines += [
            "",
            f"  WARNING: the hidden states take {human_bytes(hb)}"
            + (" - tens of terabytes" if hb >= 10 * TB else "") + ". Before starting, consider:",
            f"    - fewer samples: every 10% fewer samples saves {human_bytes(hb * 0.1)}",
            "    - a lower tokenize.max_length (fewer tokens per sample; long samples dominate)",
            f"    - extract.codec: fp8 (lossy, e4m3 + per-row scale): {human_bytes(plan['hidden_bytes_fp8'])}",
            "    - online training: compute the target's features inside the training step instead of storing them "
            f"(no storage; costs a target forward per sample per epoch, ~{plan['extract_gpu_hours'] * plan['train_epochs']:.0f} "
            "GPU-hours over all epochs)",
        ]
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", nargs="+", required=True, help="token shards (the source dataset)")
    p.add_argument("--model", required=True, help="target model directory (its config.json)")
    p.add_argument("--config", default="{}", help="JSON of the config sections generate, tokenize, extract, drafter, train")
    p.add_argument("--hidden-stats", help="glob of extraction groups' (or shards') .stats.json (measured throughput, "
                                             "compression)")
    p.add_argument("--scale", type=float, default=1.0, help="extrapolate to a dataset this many times larger")
    p.add_argument("--calibration", nargs="?", default=None, help="a generation calibration (`dflash-pipeline "
                   "calibrate`): project the full generation from its measured figures (no value: none)")
    p.add_argument("--assume-generation", action="store_true", help="without a calibration, price generation from "
                   "config generate.assumed (marked ASSUMED): the cost preview, before any GPU")
    p.add_argument("--rates", nargs="?", default=None, help="extraction and training rates measured on the run's "
                   "GPU (`dflash-pipeline calibrate-rates`); without: the cost model, marked ASSUMED")
    p.add_argument("--evaluate-runtime", default=os.environ.get("DFLASH_EVALUATE_RUNTIME", "{}"),
                   help="the evaluation's runtime settings (its batch size; default: the workflow's environment)")
    p.add_argument("--out", help="write the plan text here (it is printed too)")
    p.add_argument("--json", help="write the plan numbers here")


def run(args) -> int:
    cfg = json.loads(args.config)
    shape = target_shape(args.model)
    drafter = cfg.get("drafter") or {}
    layer_ids = resolve_target_layer_ids(drafter.get("target_layer_ids"), drafter.get("num_layers"), shape["num_layers"])
    tok = token_stats(args.tokens)
    extract_cfg = cfg.get("extract") or {}
    gen_cfg = cfg.get("generate") or {}
    calibration = storage.read_json(args.calibration) if args.calibration else None
    if calibration is None and args.assume_generation and gen_cfg.get("enabled"):
        calibration = assumed_calibration(gen_cfg)
    names = [os.path.basename(str(t)).removesuffix(".parquet") for t in args.tokens]
    jobs = generation_jobs(names, int(settings.value(gen_cfg, "generate.shards_per_job")))
    jobs = round(jobs * args.scale)
    plan = make_plan(tok, shape, layer_ids, generate=gen_cfg, tokenize=cfg.get("tokenize") or {},
                     extract=extract_cfg, train=cfg.get("train"), measured_run=measured(args.hidden_stats),
                     scale=args.scale, gpu_tok_s=extract_cfg.get("assumed_tokens_per_s"), calibration=calibration,
                     jobs=jobs, cost=cfg.get("cost"), rates=storage.read_json(args.rates) if args.rates else None,
                     extract_jobs=round(generation_jobs(names, int(settings.value(extract_cfg, "extract.shards_per_job"))) * args.scale),
                     block_size=int(settings.value(cfg.get("drafter"), "drafter.block_size")),
                     evaluate=({**cfg["evaluate"], **json.loads(args.evaluate_runtime or "{}")}
                               if cfg.get("evaluate") else None))
    text = render(plan, shape, layer_ids, disk_warn_bytes=float(settings.value(extract_cfg, "extract.warn_bytes")))
    mask = mask_token(args.model, cfg.get("drafter") or {}, bool(cfg.get("trust_remote_code")))
    text += f"  drafter mask token: {mask['description']}\n"
    warning = shard_bytes_warning(plan, len(args.tokens) * args.scale,
                                  float(settings.value(extract_cfg, "extract.warn_shard_bytes")))
    if warning:
        text += "\n".join(warning) + "\n"
    print(text, end="")
    if args.out:
        with storage.atomic_open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
    if args.json:
        # stamped: a plan rerun always rewrites the file with other bytes, so the generation gate (a checkpoint
        # reading it) always decides again. Rewritten with the same bytes, it was pending before the plan ran and
        # not to be run after, and Snakemake 9.27 then never released the jobs that wait for it: evaluation ran on
        # the old drafter before training (tests/test_online_workflow.py; a checkpoint behind a checkpoint,
        # snakemake/snakemake#3862, open)
        stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="microseconds")
        storage.write_json(args.json, {**plan, "target": shape, "target_layer_ids": layer_ids, "mask_token": mask,
                                       "planned_at": stamp})
    return 0


def mask_token(model_dir: str, drafter: dict, trust_remote_code: bool) -> dict:
    """The mask token training will use (drafter/target_head.py decides), or why it cannot be told yet."""
    from dflash_pipeline.drafter.target_head import choose_mask_token, target_vocab_rows  # torch: only here

    try:
        vocab_rows = target_vocab_rows(model_dir)
        choice = choose_mask_token(model_dir, drafter.get("mask_token_id"), vocab_rows, trust_remote_code)
    except PipelineError as exc:
        return {"id": None, "token": None, "description": f"not decided: {exc}"}
    return {"id": choice.token_id, "token": choice.token, "description": choice.describe()}


# --------------------------------------------------------------------------------------------------------
# the generation gate
# --------------------------------------------------------------------------------------------------------
def add_generation_gate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", required=True, help="plan.json (written by `dflash-pipeline plan --calibration`)")
    p.add_argument("--max-wall-hours", type=float, help="config generate.max_wall_hours (none: no limit)")
    p.add_argument("--max-gpu-hours", type=float, help="config generate.max_gpu_hours (none: no limit)")
    p.add_argument("--out", required=True, help="written only when the projection is within the limits")


def run_generation_gate(args) -> int:
    plan = storage.read_json(args.plan)
    proj = plan.get("generation")
    if proj is None:
        raise PipelineError(f"{args.plan}: no generation projection (the plan ran without --calibration)")
    failures = gate_failures(proj, args.max_wall_hours, args.max_gpu_hours)
    if failures:
        print("\nGENERATION GATE: STOP before the full generation (nothing was generated).", file=sys.stderr)
        for msg in failures:
            print(f"  - {msg}", file=sys.stderr)
        print("  measured figures and what would change them:", file=sys.stderr)
        print("\n".join("  " + line for line in render_generation(proj)), file=sys.stderr)
        print("  Change the settings (the calibration reruns when backend, target or sampling change) or raise "
              "the limit, then rerun.", file=sys.stderr)
        return 1
    storage.write_json(args.out, {"wall_hours": proj["wall_hours"], "gpu_hours": proj["gpu_hours"],
                                  "max_wall_hours": args.max_wall_hours, "max_gpu_hours": args.max_gpu_hours})
    print(f"generation gate: passed (projected {fmt_hours(proj['wall_hours'])}, {proj['gpu_hours']:,.1f} GPU-hours)")
    return 0
