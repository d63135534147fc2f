"""Training speed at the SmolLM2-135M drafter shape, through the train stage's own step, on one GPU.

Shape: a 5-layer drafter of the SmolLM2-135M target (hidden 576, 9 query / 3 kv heads of 64, MLP 1536,
features of target layers [1, 7, 14, 20, 27] of 30, vocab 49,152 tied embedding/head, block 16, up to 512
anchors, max_length 2048), random bf16 weights and features built here (no download). The data goes the way
`dflash-pipeline train` sends it: `StepData` (anchors drawn per sample), `collate_micro` in the `Prefetcher`
thread (packed or padded, pinned), `train_step` (bf16 autocast, block_loss with the flex block mask and the
chunked LM head, backward, grad clip, fused AdamW, LR schedule), `StepMetrics` (the training log's numbers).

Data profiles: `sharegpt`: prompts of 16-1,024 tokens (log-uniform), answers of 64-384 tokens (uniform; the
real-target run's generate.max_new_tokens 384), every answer token supervised: ~230 anchors a sample;
`full`: 2,048-token samples, the last 80% supervised: 512 anchors each (the brief's max shape).

FLOPs (drafter/flops.py, the same count the training log's MFU uses): per trained position (each valid
anchor's 16 block positions) forward + backward (x3) of the 5 layers' projections and MLP and of attention over
the keys it sees (its sample's context before the anchor + its own 16 block keys); per scored position the
frozen LM head's forward and input gradient (2 x 2*576*49,152, no weight gradient); per context token the fc
fusion (forward + weight gradient) and its k/v projections (x3). Padding (blocks or tokens) is never counted.
MFU is set against a bf16 8192^3 matmul measured in the same run (and the 790 TFLOP/s of the device notes).

    PYTHONPATH=scripts python benchmarks/train_small_shape.py [--budget-s 200] [--variants ...]
    PYTHONPATH=scripts python benchmarks/train_small_shape.py --tiny     # CPU smoke test of this script
Variant words (joined by +): padded|packed, eager|compile, b<batch>, c<head_chunk>, sdpa|flex|split,
sharegpt|full, a<n> (packed: every sample starts at a multiple of n tokens, a128: on a key tile), devsel (the loss
selects the scored positions on the device, with host syncs, instead of taking the batch's host-made index).
`split` (drafter/split_attention.py) is first checked against the one-mask path (flex on GPU, SDPA on CPU)
on step 0's first micro-batch with the same weights: column "check" is the max |difference| of the hidden
states / the relative difference of the gradients.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import time

import numpy as np
import torch

from gpu_rates import matmul_rate  # benchmarks/ is on sys.path when run as a script

from dflash_pipeline.drafter.batch import sample_anchors
from dflash_pipeline.drafter.config import DrafterConfig
from dflash_pipeline.drafter.distributed import Dist
from dflash_pipeline.drafter.loss import draft_all_blocks
from dflash_pipeline.drafter.metrics import StepMetrics
from dflash_pipeline.drafter.model import DFlashDrafter
from dflash_pipeline.drafter.steps import Prefetcher, StepData
from dflash_pipeline.drafter.target_head import TargetHead
from dflash_pipeline.drafter.train import (TrainingRun, TrainJob, _wrap_for_training, collate_micro, lr_lambda_factory,
                                          train_step)
from dflash_pipeline.target_layers import default_target_layer_ids

DEVICE_NOTES_BF16 = 790e12
# most telling first (a budget may cut the tail): today's settings, packing, head chunk, eager, batch, anchors
DEFAULT = ("padded+compile+b16+c2048,packed+compile+b16+c8192,packed+eager+b16+c8192,packed+compile+b32+c8192,"
           "packed+compile+b16+c2048,packed+compile+b16+c8192+full,padded+eager+b16+c2048,"
           "padded+compile+b16+c2048+full")
TINY = "padded+eager+b4+c64+sdpa,packed+eager+b4+c64+sdpa,packed+eager+b8+c0+sdpa+full,packed+eager+b4+c64+split"


def smollm2_config(tiny: bool) -> DrafterConfig:
    tc = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
          "num_hidden_layers": 30, "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
          "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, "max_position_embeddings": 8192,
          "model_type": "llama", "tie_word_embeddings": True}
    if tiny:
        tc.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    layers = 2 if tiny else 5
    return DrafterConfig.from_target(tc, layers, default_target_layer_ids(30, layers), 16, 16, tc["vocab_size"])


class SyntheticSource:
    """Samples as HiddenSource gives them (input_ids, loss_mask, features), random, fixed per index."""

    def __init__(self, cfg: DrafterConfig, n: int, profile: str, max_length: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        width = len(cfg.target_layer_ids) * cfg.hidden_size
        # features: windows of one random buffer (their values do not change the speed; generating
        # 100+ x 2048 x 2880 normals per sample would take most of the GPU call)
        base = torch.randn(max_length + n, width, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        self.samples = []
        for i in range(n):
            if profile == "full":
                length, prompt = max_length, max_length // 5
            else:
                prompt = int(math.exp(rng.uniform(math.log(16), math.log(min(1024, max_length // 2)))))
                length = min(max_length, prompt + int(rng.integers(min(64, max_length // 4), min(385, max_length // 2))))
            mask = np.zeros(length, np.uint8)
            mask[prompt:] = 1
            self.samples.append({"sample_id": f"s{i}", "input_ids": rng.integers(0, cfg.vocab_size, length),
                                 "loss_mask": mask, "features": base[i:i + length]})

    def __len__(self):
        return len(self.samples)

    def shard(self, i):
        return 0

    def get(self, i):
        return self.samples[i]


def parse_variant(spec: str, gpu: bool) -> dict:
    words = spec.split("+")
    attention = "split" if "split" in words else "sdpa" if "sdpa" in words or not gpu else "flex"
    v = {"layout": "packed" if "packed" in words else "padded", "compile": "compile" in words and gpu,
         "attention": attention,
         "profile": "full" if "full" in words else "sharegpt", "batch": 16, "head_chunk": 2048, "pack_align": 1,
         "devsel": "devsel" in words}
    for w in words:
        if w[0] in "bca" and w[1:].isdigit():
            v[{"b": "batch", "c": "head_chunk", "a": "pack_align"}[w[0]]] = int(w[1:])
    return v


def make_run(v: dict, cfg, head, source, dist_, args) -> TrainingRun:
    """The train stage's TrainingRun for a variant (the settings of config/smollm2-real.yaml otherwise)."""
    from dflash_pipeline import cli
    from dflash_pipeline.settings import typed

    # the train stage's own settings (schema defaults, the options it parses), so this stays whole as they grow
    argv = ["--mode", "offline", "--inputs", "-", "--model", "-", "--out", "-", "--checkpoint-dir", "-",
            "--num-anchors", args.anchors, "--gamma", 7.0, "--head-chunk", v["head_chunk"], "--loss-weighting",
            "decay", "--grad-clip", 1.0, "--labels", "data", "--layout", v["layout"], "--lr", 6e-4,
            "--attention", v["attention"], *(["--compile"] if v["compile"] else [])]
    targs = typed.for_stage("train", cli.stage_args("train", [str(x) for x in argv]))
    steps = StepData(source, seed=0, batch_size=v["batch"], grad_accum=1, num_anchors=args.anchors, rank=0,
                     world=1, vocab_rows=cfg.vocab_size)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).to(dist_.device)
    gpu = dist_.device.type == "cuda"
    opt = torch.optim.AdamW(drafter.parameters(), lr=6e-4, betas=(0.9, 0.95), fused=gpu or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda_factory(1000, 40))
    model = _wrap_for_training(targs, drafter, dist_)
    job = TrainJob(inputs=[], model="", out="", checkpoint_dir="")  # no files: the benchmark times steps only
    return TrainingRun(targs, job, dist_, cfg, head, source, steps, 1000, drafter, model, opt, sched, None,
                       v["attention"], v["layout"] == "packed", v["pack_align"])


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def run_steps(run, metrics, first: int, n: int, prefetch: Prefetcher) -> tuple[float, float]:
    """n steps of the training loop from step `first` (the next one always prefetched); (seconds, seconds
    spent waiting for data)."""
    wait = 0.0
    t0 = time.perf_counter()
    for step in range(first, first + n):
        tw = time.perf_counter()
        key, micro = prefetch.get()
        wait += time.perf_counter() - tw
        assert key == step % run.steps.steps_per_epoch
        prefetch.start((step + 1) % run.steps.steps_per_epoch)
        train_step(run, micro, metrics)
    sync(run.device)
    return time.perf_counter() - t0, wait


def profile_table(run, metrics, first, n, prefetch) -> str:
    from torch.profiler import ProfilerActivity, profile

    gpu = run.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=acts) as prof:
        run_steps(run, metrics, first, n, prefetch)
    key = "self_cuda_time_total" if gpu else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=16, max_name_column_width=58)


def check_split(run) -> dict:
    """Hidden states and gradients of the split path against the one-mask path (flex on GPU, SDPA on CPU),
    same weights and batch (step 0's first micro-batch), the step's dtype; before any training step."""
    gpu = run.device.type == "cuda"
    batch = collate_micro(run, run.steps(0))[0][0].to(run.device)
    got = []
    for attention in ("flex" if gpu else "sdpa", "split"):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=gpu):
            h = draft_all_blocks(run.model, run.head, batch, batch.features, attention,
                                 torch.bfloat16 if gpu else torch.float32).float()
        w = torch.randn(h.shape, generator=torch.Generator().manual_seed(0)).to(h.device)
        (h * w).sum().backward()
        got.append((h.detach(), torch.cat([p.grad.flatten().float() for p in run.drafter.parameters()])))
        run.opt.zero_grad(set_to_none=True)
    (h0, g0), (h1, g1) = got
    return {"check_hidden_max": float((h1 - h0).abs().max()), "check_hidden_ref_max": float(h0.abs().max()),
            "check_hidden_rel": float((h1 - h0).norm() / h0.norm()),
            "check_grad_rel": float((g1 - g0).norm() / g0.norm())}


def measure(spec: str, cfg, head, sources, dist_, args, peak) -> dict:
    v = parse_variant(spec, dist_.device.type == "cuda")
    run = make_run(v, cfg, head, sources[v["profile"]], dist_, args)
    check = check_split(run) if v["attention"] == "split" else {}
    if check:
        print(f"check {spec}: {json.dumps(check)}", flush=True)
    metrics = StepMetrics(cfg.block_size, dist_.device, peak)
    def micro(step):
        batches = collate_micro(run, run.steps(step))
        # devsel: the loss finds the scored positions itself (boolean selections: device syncs), as before
        # with_scored_index gave it the host's index
        return [(dataclasses.replace(b, scored_index=None), c) for b, c in batches] if v["devsel"] else batches

    prefetch = Prefetcher(micro)
    prefetch.start(0)
    if dist_.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    # warm-up steps one at a time: a cold process's first steps show what compilation (and each recompile for a
    # new shape) costs before the steady state, the start-up a short training job pays
    warm_steps = [run_steps(run, metrics, i, 1, prefetch)[0] for i in range(args.warmup)]
    warm = sum(warm_steps)
    metrics.record(dist_, 0, 0.0, 0.0, 0.0)  # resets the sums: the record below covers the timed steps only
    dt, wait = run_steps(run, metrics, args.warmup, args.steps, prefetch)
    rec = metrics.record(dist_, 1, 0.0, 0.0, torch.tensor(0.0))
    prof = profile_table(run, metrics, args.warmup + args.steps, args.profile_steps, prefetch) \
        if args.profile_steps else ""
    prefetch.get()
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if dist_.device.type == "cuda" else float("nan")
    row = {"variant": spec, "ms_step": dt / args.steps * 1e3, "data_wait_ms": wait / args.steps * 1e3,
           "positions_per_s": rec["positions_per_s"], "tokens_per_s": rec["tokens_per_s"], "tflops": rec["tflops"],
           "mfu_measured": rec["mfu"], "mfu_790": rec["tflops"] * 1e12 / DEVICE_NOTES_BF16, "warmup_s": warm,
           "warmup_step_s": [round(x, 3) for x in warm_steps],
           "peak_gib": peak_gib, "loss": rec["loss"], **check, "profile": prof}
    print("row", json.dumps({k: x for k, x in row.items() if k != "profile"}), flush=True)
    return row


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variants", default=None, help=f"comma-separated (default: {DEFAULT})")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant (compilation, new shapes)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    p.add_argument("--profile-steps", type=int, default=2, help="steps under torch.profiler per variant (0: none)")
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--samples", type=int, default=128, help="distinct synthetic samples per profile")
    p.add_argument("--budget-s", type=float, default=0, help="start no variant after this many seconds (0: no limit)")
    p.add_argument("--out", default=os.environ.get("OUT", ""), help="directory for the JSON results and profiles")
    p.add_argument("--tiny", action="store_true", help="a tiny drafter on CPU (smoke test of this script)")
    args = p.parse_args()
    if args.tiny:
        args.anchors, args.max_length, args.samples, args.warmup, args.steps = 24, 128, 16, 1, 2
        args.profile_steps = min(args.profile_steps, 1)
    args.variants = args.variants or (TINY if args.tiny else DEFAULT)
    return args


def print_table(rows, cfg, args, mm):
    print(f"\nSmolLM2-135M drafter shape ({cfg.num_hidden_layers} layers, H {cfg.hidden_size}, vocab {cfg.vocab_size}, "
          f"block {cfg.block_size}), up to {args.anchors} anchors, max_length {args.max_length}, {args.steps} timed "
          f"steps; bf16 matmul measured {mm / 1e12:.0f} TFLOP/s")
    print(f"{'variant':40s} {'ms/step':>8s} {'data ms':>8s} {'pos/s':>10s} {'data tok/s':>10s} {'TFLOP/s':>8s} "
          f"{'MFU meas':>8s} {'MFU 790':>8s} {'warmup s':>8s} {'GiB':>6s} {'vs first':>8s} {'check':>17s}")
    for r in rows:
        mfu = "-" if r["mfu_measured"] is None else f"{100 * r['mfu_measured']:.1f}%"
        check = f"{r['check_hidden_max']:.1e}/{r['check_grad_rel']:.1e}" if "check_grad_rel" in r else "-"
        print(f"{r['variant']:40s} {r['ms_step']:8.1f} {r['data_wait_ms']:8.1f} {r['positions_per_s']:10.0f} "
              f"{r['tokens_per_s']:10.0f} {r['tflops']:8.1f} {mfu:>8s} {100 * r['mfu_790']:7.1f}% "
              f"{r['warmup_s']:8.1f} {r['peak_gib']:6.1f} {r['positions_per_s'] / rows[0]['positions_per_s']:7.2f}x "
              f"{check:>17s}")


def main():
    args = parse_args()
    t_start = time.perf_counter()
    dist_ = Dist("cpu" if args.tiny else "cuda")
    dev = dist_.device
    torch.backends.cuda.matmul.allow_tf32 = True
    mm = matmul_rate(dev) if dev.type == "cuda" else 1e12
    cfg = smollm2_config(args.tiny)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    head = TargetHead((torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02).to(dt), None).to(dev)
    sources = {p: SyntheticSource(cfg, args.samples, p, args.max_length) for p in ("sharegpt", "full")}
    print(f"set-up {time.perf_counter() - t_start:.1f}s; bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    rows = []

    def stop(*_):  # `timeout` ends the call: report what was measured
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    for spec in args.variants.split(","):
        if args.budget_s and time.perf_counter() - t_start > args.budget_s:
            print(f"variant {spec} skipped: over the {args.budget_s:.0f} s budget")
            continue
        try:
            rows.append(measure(spec, cfg, head, sources, dist_, args, mm if dev.type == "cuda" else None))
        except KeyboardInterrupt:
            print(f"variant {spec} stopped (time limit)")
            break
        except Exception as exc:  # noqa: BLE001 - report and go on with the other variants
            print(f"variant {spec} failed: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    report(rows, cfg, args, mm)
    return 0 if rows else 1  # every variant failed: a failed benchmark, not an empty table


def report(rows, cfg, args, mm):
    if not rows:
        print("no variant ran")
        return
    best = max(rows, key=lambda r: r["positions_per_s"])
    for r in (rows[0], best) if best is not rows[0] else (rows[0],):
        if r["profile"]:
            print(f"\nprofile of {r['variant']} ({args.profile_steps} steps), top ops by device time:\n{r['profile']}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "train_small_shape.json"), "w") as fh:
            json.dump({"matmul_tflops": mm / 1e12, "rows": rows}, fh, indent=1)
    print_table(rows, cfg, args, mm)


if __name__ == "__main__":
    sys.exit(main())
