"""`dflash-pipeline train`: train the DFlash drafter (offline from hidden-state shards, or online).

- offline: `--inputs` are hidden-state shards (features stored by the extract stage);
- online:  `--inputs` are token shards; the target runs beside the drafter and computes the features of
  each batch on the fly (same model, same loss), for data whose hidden states would not fit on disk.

One process per GPU under `torchrun` (DDP; NCCL on GPU, gloo on CPU); the global batch is
`batch_size * grad_accum * world_size` sequences, split over ranks by position. Everything random is drawn
from generators seeded by (seed, epoch, position), so the data position of a run is the optimizer step:
a checkpoint (model, optimizer, scheduler, step, RNG states) every `--checkpoint-every` steps lets a killed
run resume and end with exactly the weights of an uninterrupted run.

Outputs (`--out`, written at the end in one atomic rename): `drafter.safetensors` (drafter weights under the
engines' names, fp32), `drafter_config.json`, `metrics.jsonl` (per logged step: loss, accuracy, lr, and
loss/accuracy per block position), `summary.json` and `per_position.png`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import typing
import logging
import math
import random
import shutil
import time
from dataclasses import dataclass

import torch

from dflash_pipeline import storage
from dflash_pipeline.compile_profile import name_compiled_workload
from dflash_pipeline.drafter.batch import collate, collate_packed, with_scored_index
from dflash_pipeline.drafter.checkpoints import CheckpointStore
from dflash_pipeline.drafter.config import DrafterConfig
from dflash_pipeline.drafter.distributed import Dist
from dflash_pipeline.drafter.features import LABELS, packed_target_features, target_features, target_outputs
from dflash_pipeline.drafter.flops import batch_counts, peak_basis, step_flops
from dflash_pipeline.drafter.heldout import AcceptanceMonitor
from dflash_pipeline.drafter.layer_init import LAYER_INITS, init_from_target
from dflash_pipeline.drafter.loss import NORMALIZATIONS, WEIGHTINGS, block_loss
from dflash_pipeline.drafter.metrics import StepMetrics, append_record, plot_metrics, read_records, summarize
from dflash_pipeline.drafter.model import DFlashDrafter, count_parameters, save_drafter
from dflash_pipeline.drafter.runtime import keeps_torch_threads, make_readable
from dflash_pipeline.drafter.sources import HiddenSource, TokenSource
from dflash_pipeline.drafter.steps import Prefetcher, StepData
from dflash_pipeline.drafter.stop_signals import StopSignals
from dflash_pipeline.drafter.target_head import load_target_head, resolve_mask_token_id
from dflash_pipeline.errors import PipelineError, StoppedBySignal
from dflash_pipeline.progress import Progress
from dflash_pipeline.settings import typed
from dflash_pipeline.settings.added_later import TRAIN_KEYS_ADDED_LATER, set_away_from_default
from dflash_pipeline.settings.train_combinations import train_problems
from dflash_pipeline.target import read_config, text_config
from dflash_pipeline.target_layers import resolve_target_layer_ids
from dflash_pipeline.write_checks import check_output_dirs, named_write_errors

log = logging.getLogger("dflash_pipeline.drafter.train")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=["offline", "online"], required=True)
    p.add_argument("--inputs", nargs="+", required=True,
                   help="hidden-state shards or extraction group directories (offline), token shards (online)")
    p.add_argument("--model", required=True, help="target model directory (embedding, LM head, config; online: all)")
    p.add_argument("--out", required=True, help="output directory (written atomically at the end)")
    p.add_argument("--checkpoint-dir", required=True, help="resumable checkpoints and the live metrics log")
    p.add_argument("--num-layers", type=int, help="drafter decoder layers")
    p.add_argument("--target-layer-ids", type=int, nargs="+", help="default: spread over the target")
    p.add_argument("--block-size", type=int)
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--num-anchors", type=int, help="blocks per sequence (at most)")
    p.add_argument("--gamma", type=float, help="loss decay: w_k = exp(-(k-1)/gamma)")
    p.add_argument("--loss-weighting", choices=list(WEIGHTINGS),
                   help="per block position: decay (exp(-(k-1)/gamma)), dpace (decay x D-PACE), none (see loss.py)")
    p.add_argument("--dpace-alpha", type=float, help="D-PACE smoothing: s = (1 - alpha) q + alpha")
    p.add_argument("--loss-normalization", choices=list(NORMALIZATIONS),
                   help="weights: the weighted CE over the weights' sum; samples: over the micro-batch's samples "
                        "(SpecForge's D-PACE)")
    p.add_argument("--max-length", type=int)
    p.add_argument("--batch-size", type=int, help="sequences per micro-batch per rank")
    p.add_argument("--grad-accum", type=int)
    p.add_argument("--epochs", type=float)
    p.add_argument("--max-steps", type=int, help="stop after this many optimizer steps (0: epochs)")
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup-ratio", type=float)
    p.add_argument("--weight-decay", type=float)
    p.add_argument("--adam-beta1", type=float)
    p.add_argument("--adam-beta2", type=float)
    p.add_argument("--grad-clip", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--checkpoint-every", type=int)
    p.add_argument("--keep-checkpoints", type=int)
    p.add_argument("--checkpoint-mirror",
                   help="s3://bucket/prefix: upload checkpoints there and resume from there on a new machine")
    p.add_argument("--log-every", type=int)
    p.add_argument("--labels", choices=list(LABELS),
                   help="data: the sequence's own next tokens (the recipe); target (online only): the target's "
                        "greedy prediction at each position, for data that is not the target's own output; "
                        "distill (online only): the target's whole next-token distribution (soft CE)")
    p.add_argument("--layer-init", choices=list(LAYER_INITS),
                   help="random (the paper) or target-first / target-last: the drafter's layers start as the "
                        "target's first / last N decoder layers")
    p.add_argument("--holdout-fraction", type=float, help="sample ids kept for evaluation")
    p.add_argument("--acceptance-every", type=int,
                   help="every N steps (and at the end) the simulated acceptance on held-out samples (0: never)")
    p.add_argument("--acceptance-samples", type=int, help="held-out samples it uses")
    p.add_argument("--acceptance-patience", type=int,
                   help="measurements without a gain after which the run says acceptance stopped improving")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--attention", choices=["auto", "sdpa", "flex", "split"],
                   help="auto: flex attention (block-sparse) on GPU, dense-mask SDPA on CPU; split: context "
                        "(flex on GPU) and own-block attention apart, merged by log-sum-exp")
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile the drafter layers (GPU)")
    p.add_argument("--head-chunk", type=int,
                   help="scored block tokens per LM-head/CE chunk (0: all logits at once; head_loss.py)")
    p.add_argument("--layout", choices=["auto", "packed", "padded"],
                   help="packed: a micro-batch's samples end to end in one row, only real blocks computed; padded: "
                        "one row per sample (on GPU padded to --num-anchors blocks). auto: packed on GPU (offline or online) "
                        "with --compile")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="bf16 TFLOP/s the logged MFU is set against (0: the measured rate of a known GPU, "
                        "H200 790; none on CPU)")
    p.add_argument("--cpu-threads", type=int,
                   help="torch threads on CPU (1: tiny models run far faster without OpenMP spinning on shared cores)")
    p.add_argument("--trust-remote-code", action="store_true", default=None,
                   help="let transformers run the target's own model/tokenizer code (target.trust_remote_code)")


def lr_lambda_factory(total_steps: int, warmup_steps: int):
    def fn(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


def recipe_settings(s) -> dict:
    """The recipe choices beyond the paper's (benchmarks/recipe_variants.json measures them)."""
    return {"loss_weighting": s.loss_weighting, "dpace_alpha": s.dpace_alpha,
            "adam_betas": [s.adam_beta1, s.adam_beta2], "warmup_ratio": s.warmup_ratio,
            "weight_decay": s.weight_decay,
            # only when set: the checkpoints of runs from before these settings existed keep their fingerprint
            **set_away_from_default({k: getattr(s, k) for k in TRAIN_KEYS_ADDED_LATER})}


def run_fingerprint(s, dcfg: DrafterConfig, total_steps: int, global_batch: int, source) -> dict:
    """What a checkpoint must match to be resumed from: settings that change the weights, and the data."""
    return {
        "drafter": dcfg.to_dict(), "seed": s.seed, "lr": s.lr, "total_steps": total_steps,
        "global_batch": global_batch, "samples": len(source), "gamma": s.gamma, "num_anchors": s.num_anchors,
        "max_length": s.max_length, "mode": s.mode, "labels": s.labels,
        "recipe": recipe_settings(s),
        "holdout_fraction": s.holdout_fraction, "data": source.identity(),
    }


# ---------------------------------------------------------------------------------------------------------
# Run setup
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainJob:
    """What one train job reads and writes, and where it runs: the options that are not config settings."""

    inputs: list[str]
    model: str
    out: str
    checkpoint_dir: str
    device: str = "auto"
    peak_tflops: float = 0.0

    @classmethod
    def from_args(cls, args) -> "TrainJob":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


@dataclass
class TrainingRun:
    """Everything one training run holds, built by `setup_run`."""

    settings: typing.Any  # the stage's typed settings (settings.typed.for_stage("train", ...))
    job: TrainJob
    dist: Dist
    dcfg: DrafterConfig
    head: torch.nn.Module
    source: object
    steps: StepData
    total_steps: int
    drafter: DFlashDrafter
    model: torch.nn.Module  # the drafter, or its DDP wrapper
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    target: torch.nn.Module | None
    attention: str
    packed: bool = False
    pack_align: int = 1  # packed samples start at multiples of this (benchmarks' `a128`; not a setting yet)

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def gpu(self) -> bool:
        return self.dist.device.type == "cuda"


def _drafter_config(s, job: TrainJob, dev: torch.device):
    """The drafter's config (target shapes, layer ids, mask token) and the target's frozen embedding/head."""
    tcfg = read_config(job.model)
    n_target = int(text_config(tcfg)["num_hidden_layers"])
    # the workflow passes the plan's ids; by hand without them, the plan's resolver
    layer_ids = resolve_target_layer_ids(s.target_layer_ids, s.num_layers, n_target)
    head = load_target_head(job.model, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32).to(dev)
    mask_id = resolve_mask_token_id(job.model, s.mask_token_id, head.vocab_rows, s.trust_remote_code)
    head.check_mask_token(mask_id)
    dcfg = DrafterConfig.from_target(tcfg, s.num_layers, layer_ids, s.block_size, mask_id, head.vocab_rows)
    return dcfg, head


def _open_source(s, job: TrainJob, dcfg: DrafterConfig, keep: str = "train"):
    if s.mode == "offline":
        source = HiddenSource(job.inputs, dcfg.target_layer_ids, s.holdout_fraction, s.max_length, keep)
        if source.hidden_size and source.hidden_size != dcfg.hidden_size:
            raise PipelineError(f"hidden-state shards have hidden size {source.hidden_size}, the target "
                                f"{dcfg.hidden_size}: were they extracted from another model?")
    else:
        source = TokenSource(job.inputs, s.holdout_fraction, s.max_length, keep=keep)
    if keep == "holdout":
        return source
    if len(source) == 0:
        raise PipelineError("no training samples (all inputs empty or held out)")
    return source


def _online_target(s, job: TrainJob, dev: torch.device):
    """online mode: the target itself, frozen, beside the drafter (it computes the features)."""
    if s.mode != "online":
        return None
    from dflash_pipeline.target import load_model

    target = load_model(job.model, device=str(dev), dtype="bfloat16" if dev.type == "cuda" else "float32",
                        trust_remote_code=s.trust_remote_code)
    return target.requires_grad_(False)


# what decides the shapes the compiled layers see (not the step count, the inputs or the output paths)
SHAPE_SETTINGS = ("attention", "batch_size", "num_anchors", "max_length", "head_chunk", "loss_weighting", "labels",
                  "layout", "mode")


def _wrap_for_training(s, drafter: DFlashDrafter, dist_: Dist) -> torch.nn.Module:
    gpu = dist_.device.type == "cuda"
    if gpu:  # one compiled kernel per padded shape (max_length / 256 buckets): allow that many recompiles
        import torch._dynamo as dynamo  # (a plain `import torch._dynamo` would make `torch` local here)

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, max(64, getattr(dynamo.config, name)))
    if s.compile and gpu:
        # calibrate-rates' steps and this job share the name: the job compiles the dynamic graphs at once, cached
        name_compiled_workload("train", {"drafter": drafter.config.to_dict(),
                                         **{k: getattr(s, k) for k in SHAPE_SETTINGS}})
        for layer in drafter.layers:
            layer.compile()
    if dist_.world == 1:
        return drafter
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(drafter, device_ids=[dist_.device.index] if gpu else None)


def packed_layout(s, dev: torch.device) -> bool:
    """Pack a micro-batch's samples into one row? auto: on GPU with --compile, offline or online (online, the
    target runs on the samples as a padded batch and its features are put into the row: features.py). Not on CPU
    (the dense SDPA mask of a packed row grows with its square) nor without compile (flex attention is compiled
    per static shape and a packed row has a new one every step). A padded GPU batch computes --num-anchors blocks
    per row: at ShareGPT lengths ~2.5x the blocks it trains (the H100 run of 2026-12-06, online)."""
    return s.layout == "packed" or (s.layout == "auto" and dev.type == "cuda" and bool(s.compile))


def setup_run(s, job: TrainJob) -> TrainingRun:
    dist_ = Dist(job.device)
    dev = dist_.device
    if dev.type == "cpu":
        torch.set_num_threads(max(1, s.cpu_threads))
    torch.manual_seed(s.seed)
    random.seed(s.seed)
    dcfg, head = _drafter_config(s, job, dev)
    source = _open_source(s, job, dcfg)
    steps = StepData(source, seed=s.seed, batch_size=s.batch_size, grad_accum=s.grad_accum,
                     num_anchors=s.num_anchors, rank=dist_.rank, world=dist_.world, vocab_rows=head.vocab_rows)
    if steps.steps_per_epoch == 0:
        raise PipelineError(f"{len(source)} samples are fewer than one global batch of {steps.global_batch}")
    total_steps = s.max_steps or max(1, int(round(s.epochs * steps.steps_per_epoch)))
    torch.manual_seed(s.seed)
    drafter = DFlashDrafter(dcfg)
    init_from_target(drafter, job.model, s.layer_init)
    drafter = drafter.to(dev)
    opt = torch.optim.AdamW(drafter.parameters(), lr=s.lr, weight_decay=s.weight_decay,
                            betas=(s.adam_beta1, s.adam_beta2), fused=dev.type == "cuda" or None)
    warmup = int(math.ceil(s.warmup_ratio * total_steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda_factory(total_steps, warmup))
    attention = s.attention if s.attention != "auto" else ("flex" if dev.type == "cuda" else "sdpa")
    run = TrainingRun(s, job, dist_, dcfg, head, source, steps, total_steps, drafter,
                      _wrap_for_training(s, drafter, dist_), opt, sched, _online_target(s, job, dev), attention,
                      packed_layout(s, dev))
    if dist_.main:
        log.info("drafter: %d layers, %.1fM trainable parameters, target layers %s, mask token %d, %s attention; "
                 "%d samples, %d steps (%d per epoch), global batch %d, world %d, device %s, %s layout",
                 dcfg.num_hidden_layers, count_parameters(drafter) / 1e6, dcfg.target_layer_ids,
                 dcfg.mask_token_id, attention, len(source), total_steps, steps.steps_per_epoch,
                 steps.global_batch, dist_.world, dev, "packed" if run.packed else "padded")
    return run


# ---------------------------------------------------------------------------------------------------------
# One optimizer step
# ---------------------------------------------------------------------------------------------------------


class _DDPCall:
    """Routes block_loss's drafter calls through the DDP wrapper (gradient sync) while exposing `.config`."""

    def __init__(self, ddp):
        self.ddp = ddp
        self.config = ddp.module.config

    def __call__(self, *a, **kw):
        return self.ddp(*a, **kw)


def _features_and_labels(run: TrainingRun, batch):
    """Stored features (offline), or the target's (online), and the labels (None: the data's own tokens; the
    target's tokens, or for `distill` its final hidden states: features.target_outputs)."""
    if batch.features is not None:
        return batch.features, None
    if batch.sample_spans is not None:  # a packed row: the target sees each sample alone, padded
        return packed_target_features(run.target, batch, run.dcfg.target_layer_ids, run.settings.labels,
                                      pad_multiple=256 if run.gpu else 1)
    return target_outputs(run.target, batch.input_ids, batch.lengths, run.dcfg.target_layer_ids, run.settings.labels)


def acceptance_monitor(run: TrainingRun) -> AcceptanceMonitor | None:
    """The held-out acceptance measurement (rank 0), or None when off or without held-out samples."""
    s = run.settings
    if not run.dist.main or s.acceptance_every <= 0 or s.holdout_fraction <= 0:
        return None
    monitor = AcceptanceMonitor(_open_source(s, run.job, run.dcfg, keep="holdout"), s.acceptance_samples,
                                s.batch_size, s.seed, s.acceptance_patience)
    if not monitor:
        log.info("no held-out samples with a block to score: acceptance is not measured while training")
        return None
    return monitor


def measure_acceptance(run: TrainingRun, monitor: AcceptanceMonitor, step: int) -> dict:
    """The held-out acceptance record fields at `step` (features stored, or computed by the target)."""
    def features(batch):
        if batch.features is not None:
            return batch.features
        return target_features(run.target, batch.input_ids, batch.lengths, run.dcfg.target_layer_ids)

    rec = monitor.measure(run, features)
    verdict = monitor.observe(step, rec["heldout_tau"])
    log.info("step %d held-out acceptance: tau %.3f over %d blocks (best %.3f at step %d)", step, rec["heldout_tau"],
             rec["heldout_blocks"], verdict["best_tau"], verdict["best_step"])
    return {**rec, "heldout_stopped_improving": verdict["stopped_improving"]}


def collate_micro(run: TrainingRun, micro) -> list:
    """One step's micro-batches as (batch on the host, StepCounts) pairs: collated, packed or padded, and
    pinned on GPU runs (built in the prefetch thread, so the copy to the GPU is all the step waits for)."""
    out = []
    for samples, anchors in micro:
        if run.packed:
            batch = collate_packed(samples, anchors, sample_multiple=run.pack_align)
        else:  # fixed padded shapes on GPU, so compiled kernels see few distinct shapes
            batch = collate(samples, anchors, pad_multiple=256 if run.gpu else 1,
                            num_blocks=run.settings.num_anchors if run.gpu else 0)
        # the loss then selects without a device sync (and with soft labels reads each position's distribution once)
        batch = with_scored_index(batch, run.dcfg.block_size,
                                  run.settings.head_chunk if run.settings.labels == "distill" else None)
        counts = batch_counts(batch, run.dcfg.block_size)
        out.append((batch.pin_memory() if run.gpu else batch, counts))
    return out


def train_step(run: TrainingRun, micro, metrics: StepMetrics) -> torch.Tensor:
    """Forward/backward of every micro-batch (gradients synced on the last), clip, optimizer step; the grad norm.
    `micro`: collate_micro's (batch, counts) pairs."""
    run.model.train()
    ddp = run.dist.world > 1
    drafter_call = _DDPCall(run.model) if ddp else run.model
    for m, (host_batch, counts) in enumerate(micro):
        batch = host_batch.to(run.device)
        feats, labels = _features_and_labels(run, batch)
        soft, labels = (labels, None) if run.settings.labels == "distill" else (None, labels)
        sync = run.model.no_sync() if ddp and m < len(micro) - 1 else contextlib.nullcontext()
        with sync, torch.autocast("cuda", dtype=torch.bfloat16, enabled=run.gpu):
            out = block_loss(drafter_call, run.head, batch, feats, run.settings.gamma, attention=run.attention,
                             compute_dtype=torch.bfloat16 if run.gpu else torch.float32, labels=labels,
                             head_chunk=run.settings.head_chunk, weighting=run.settings.loss_weighting,
                             dpace_alpha=run.settings.dpace_alpha, soft=soft,
                             normalization=run.settings.loss_normalization)
            (out.loss / len(micro)).backward()
        metrics.add(out, counts.context, counts.positions, step_flops(run.dcfg, counts, soft_labels=soft is not None))
    if run.settings.grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(run.drafter.parameters(), run.settings.grad_clip)
    else:
        grad_norm = torch.tensor(0.0)
    run.opt.step()
    run.sched.step()
    run.opt.zero_grad(set_to_none=True)
    return grad_norm


# ---------------------------------------------------------------------------------------------------------
# Outputs and the loop
# ---------------------------------------------------------------------------------------------------------


def write_outputs(run: TrainingRun, metrics_path, wall: float, start_step: int) -> None:
    """drafter.safetensors, drafter_config.json, metrics.jsonl, summary.json, per_position.png: one rename."""
    s, job = run.settings, run.job
    with storage.atomic_dir(job.out) as tmp:
        save_drafter(tmp, run.drafter)
        shutil.copyfile(metrics_path, tmp / "metrics.jsonl")
        records = read_records(metrics_path)
        summary = summarize(records, run.dcfg, s, run.total_steps, len(run.source), wall, start_step)
        storage.write_json(tmp / "summary.json", summary)
        plot_metrics(records, tmp / "per_position.png")
        make_readable(tmp)
    log.info("drafter written to %s", job.out)


RESUME = "rerun: training resumes from its last complete checkpoint"


def _run(args) -> int:
    return train(typed.for_stage("train", args), TrainJob.from_args(args))


def train(s, job: TrainJob) -> int:
    """One training run: `s` the typed train settings (config train: and drafter: keys), `job` its files."""
    problems = train_problems(s.mode, s.labels)
    if problems:
        raise PipelineError("; ".join(problems))
    check_output_dirs("train", checkpoint_dir=job.checkpoint_dir, out=job.out)  # before any work, not after it
    # setup: shapes from the target, data, drafter, optimizer; resume from this run's newest valid checkpoint
    run = setup_run(s, job)
    fp = run_fingerprint(s, run.dcfg, run.total_steps, run.steps.global_batch, run.source)
    store = CheckpointStore(job.checkpoint_dir, fp, s.keep_checkpoints, run.dist, s.checkpoint_mirror)
    start_step = store.restore(run.drafter, run.opt, run.sched, run.device)
    peak, basis = peak_basis(run.device, job.peak_tflops)
    if run.dist.main and peak:
        log.info("MFU against %.0f TFLOP/s per GPU: the %s", peak / 1e12, basis)
    metrics = StepMetrics(run.dcfg.block_size, run.device, peak)
    monitor = acceptance_monitor(run)
    if monitor and store.metrics_path.exists():
        monitor.load_history(read_records(store.metrics_path))
    t_start = time.perf_counter()
    prefetch = Prefetcher(lambda step: collate_micro(run, run.steps(step)))
    progress = Progress("train", run.total_steps, "steps", log, start=start_step)  # elapsed and ETA
    if start_step < run.total_steps:
        prefetch.start(start_step)
    with StopSignals() as stop:
        train_loop(s, job, run, store, prefetch, progress, metrics, monitor, start_step, stop)
    # outputs: the last checkpoint is on S3 (if mirrored), then rank 0 writes the drafter directory
    store.finish()
    if run.dist.main:
        with named_write_errors("train", job.out, RESUME):
            write_outputs(run, store.metrics_path, time.perf_counter() - t_start, start_step)
    run.dist.barrier()
    run.dist.close()
    return 0


def train_loop(s, job: TrainJob, run: TrainingRun, store: CheckpointStore, prefetch: Prefetcher, progress: Progress,
               metrics: StepMetrics, monitor: AcceptanceMonitor | None, start_step: int, stop: StopSignals) -> None:
    """The steps from start_step: data, forward/backward, logs, checkpoints; a stop signal ends it after the step
    it arrived in, with that step's checkpoint (StoppedBySignal)."""
    for step in range(start_step, run.total_steps):
        # data: this step's micro-batches were built in the background; start on the next step's
        key, micro = prefetch.get()
        assert key == step
        if step + 1 < run.total_steps:
            prefetch.start(step + 1)
        # forward/backward over the micro-batches, optimizer step
        grad_norm = train_step(run, micro, metrics)
        done = step + 1
        if run.dist.main:
            progress.update()
        # log: statistics summed over ranks since the last logged step, and the held-out acceptance when due
        accept = done == run.total_steps or (s.acceptance_every > 0 and done % s.acceptance_every == 0)
        if done % s.log_every == 0 or done == run.total_steps or accept:
            rec = metrics.record(run.dist, done, done / run.steps.steps_per_epoch, run.sched.get_last_lr()[0],
                                 grad_norm)
            if monitor and accept:
                rec.update(measure_acceptance(run, monitor, done))
            if run.dist.main:
                append_record(store.metrics_path, rec, run.total_steps)
        # checkpoint: a killed run resumes here with exactly this state; a stop signal forces one (ranks agree at
        # each step alone, else at the logged steps: the agreement is a collective)
        due = done % s.checkpoint_every == 0 or done == run.total_steps
        signum = stop.requested(run.dist) if run.dist.world == 1 or done % s.log_every == 0 or due else 0
        if due or signum:
            with named_write_errors("train", job.checkpoint_dir, RESUME):  # a full disk: one line, the path
                store.save(done, run.drafter, run.opt, run.sched, run.device)
        if signum and done < run.total_steps:
            store.finish()
            raise StoppedBySignal("train", signum, f"after step {done}, its checkpoint written")


run = keeps_torch_threads(_run)
