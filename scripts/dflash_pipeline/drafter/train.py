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
import json
import logging
import math
import os
import random
import shutil
import signal
import threading
import time
from pathlib import Path
from queue import Queue

import torch

from dflash_pipeline import storage
from dflash_pipeline.drafter.data import keeps_torch_threads
from dflash_pipeline.errors import PipelineError

log = logging.getLogger("dflash_pipeline.drafter.train")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=["offline", "online"], required=True)
    p.add_argument("--inputs", nargs="+", required=True, help="hidden-state shards (offline) or token shards (online)")
    p.add_argument("--model", required=True, help="target model directory (embedding, LM head, config; online: all)")
    p.add_argument("--out", required=True, help="output directory (written atomically at the end)")
    p.add_argument("--checkpoint-dir", required=True, help="resumable checkpoints and the live metrics log")
    p.add_argument("--num-layers", type=int, default=5, help="drafter decoder layers")
    p.add_argument("--target-layer-ids", default=None, help="comma-separated; default: spread over the target")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--num-anchors", type=int, default=512, help="blocks per sequence (at most)")
    p.add_argument("--gamma", type=float, default=7.0, help="loss decay: w_k = exp(-(k-1)/gamma)")
    p.add_argument("--max-length", type=int, default=3072)
    p.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch per rank")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--epochs", type=float, default=6)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0: epochs)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup-ratio", type=float, default=0.04)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--keep-checkpoints", type=int, default=2)
    p.add_argument("--checkpoint-mirror", default="",
                   help="s3://bucket/prefix: upload checkpoints there and resume from there on a new machine")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--labels", choices=["data", "target"], default="data",
                   help="data: the sequence's own next tokens (the recipe); target (online only): the target's "
                        "greedy prediction at each position, for data that is not the target's own output")
    p.add_argument("--holdout-fraction", type=float, default=0.0, help="sample ids kept for evaluation")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--attention", choices=["auto", "sdpa", "flex"], default="auto",
                   help="auto: flex attention (block-sparse) on GPU, dense-mask SDPA on CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile the drafter layers (GPU)")
    p.add_argument("--cpu-threads", type=int, default=1,
                   help="torch threads on CPU (1: tiny models run far faster without OpenMP spinning on shared cores)")
    p.add_argument("--debug-kill-at-step", type=int, default=0, help=argparse.SUPPRESS)


# ---------------------------------------------------------------------------------------------------------


class Dist:
    def __init__(self, device_arg: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = torch.cuda.is_available() and device_arg != "cpu"
        if device_arg.startswith("cuda") and not torch.cuda.is_available():
            raise PipelineError(f"--device {device_arg}: no CUDA device is visible")
        if use_cuda:
            idx = int(device_arg.split(":")[1]) if ":" in device_arg else self.local_rank
            self.device = torch.device("cuda", idx)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if self.world > 1:
            import torch.distributed as dist

            dist.init_process_group("nccl" if use_cuda else "gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def barrier(self):
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self):
        if self.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def lr_lambda_factory(total_steps: int, warmup_steps: int):
    def fn(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = sorted(ckpt_dir.glob("step-*.pt"))
    return found[-1] if found else None


def _fingerprint(args, drafter_cfg, total_steps: int, global_batch: int, n_samples: int) -> dict:
    return {
        "drafter": drafter_cfg.to_dict(), "seed": args.seed, "lr": args.lr, "total_steps": total_steps,
        "global_batch": global_batch, "samples": n_samples, "gamma": args.gamma, "num_anchors": args.num_anchors,
        "max_length": args.max_length, "mode": args.mode, "labels": args.labels,
    }


def _batches(source, order, positions, args, epoch, dist_, micro_batches):
    """(micro-batch index, samples, anchors) for this rank's part of one optimizer step, prefetched in a thread."""
    from dflash_pipeline.drafter.data import derived_seed, sample_anchors

    def build(m):
        mine = positions[dist_.rank::dist_.world]
        idxs = mine[m * args.batch_size:(m + 1) * args.batch_size]
        samples, anchors = [], []
        for pos in idxs:
            x = source.get(order[pos])
            g = torch.Generator().manual_seed(derived_seed(args.seed, epoch, pos, 2))
            samples.append(x)
            anchors.append(sample_anchors(x["loss_mask"], args.num_anchors, g))
        return samples, anchors

    return [build(m) for m in range(micro_batches)]


class Prefetcher:
    """Builds the next step's micro-batches (shard reads, decoding, collation) while the GPU works."""

    def __init__(self, fn):
        self.fn = fn
        self.q: Queue = Queue(maxsize=1)
        self.thread = None

    def start(self, key):
        def work():
            try:
                self.q.put((key, self.fn(key), None))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                self.q.put((key, None, exc))

        self.thread = threading.Thread(target=work, daemon=True)
        self.thread.start()

    def get(self):
        key, value, exc = self.q.get()
        if exc is not None:
            raise exc
        return key, value


def _run(args) -> int:
    from safetensors.torch import save_file

    from dflash_pipeline.drafter.data import (
        HiddenSource, TokenSource, block_loss, collate, epoch_order, target_features,
        target_features_and_predictions,
    )
    from dflash_pipeline.drafter.model import (
        DFlashDrafter, DrafterConfig, count_parameters, load_target_head, make_readable, read_target_config,
        resolve_mask_token_id,
    )
    from dflash_pipeline.target_layers import default_target_layer_ids, validate_target_layer_ids

    if args.labels == "target" and args.mode != "online":
        raise PipelineError("--labels target needs --mode online (the target's predictions are not in the shards)")
    dist_ = Dist(args.device)
    dev = dist_.device
    if dev.type == "cpu":
        torch.set_num_threads(max(1, args.cpu_threads))
    gpu = dev.type == "cuda"
    attention = args.attention if args.attention != "auto" else ("flex" if gpu else "sdpa")
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    tcfg = read_target_config(args.model)
    n_target = int((tcfg.get("text_config") or tcfg)["num_hidden_layers"])
    if args.target_layer_ids:
        layer_ids = validate_target_layer_ids([int(x) for x in str(args.target_layer_ids).split(",")], n_target)
    else:
        layer_ids = default_target_layer_ids(n_target, args.num_layers)
    head_dtype = torch.bfloat16 if gpu else torch.float32
    head = load_target_head(args.model, dtype=head_dtype).to(dev)
    mask_id = resolve_mask_token_id(args.model, args.mask_token_id, head.vocab_rows)
    head.check_mask_token(mask_id)
    dcfg = DrafterConfig.from_target(tcfg, args.num_layers, layer_ids, args.block_size, mask_id, head.vocab_rows)

    target = None
    if args.mode == "offline":
        source = HiddenSource(args.inputs, layer_ids, args.holdout_fraction, args.max_length)
        if source.hidden_size and source.hidden_size != dcfg.hidden_size:
            raise PipelineError(f"hidden-state shards have hidden size {source.hidden_size}, the target "
                                f"{dcfg.hidden_size}: were they extracted from another model?")
    else:
        source = TokenSource(args.inputs, args.holdout_fraction, args.max_length)
    if len(source) == 0:
        raise PipelineError("no training samples (all inputs empty or held out)")

    global_batch = args.batch_size * args.grad_accum * dist_.world
    steps_per_epoch = len(source) // global_batch
    if steps_per_epoch == 0:
        raise PipelineError(f"{len(source)} samples are fewer than one global batch of {global_batch}")
    total_steps = args.max_steps or max(1, int(round(args.epochs * steps_per_epoch)))
    warmup = int(math.ceil(args.warmup_ratio * total_steps))

    torch.manual_seed(args.seed)
    drafter = DFlashDrafter(dcfg).to(dev)
    if dist_.main:
        log.info("drafter: %d layers, %.1fM trainable parameters, target layers %s, mask token %d, %s attention; "
                 "%d samples, %d steps (%d per epoch), global batch %d, world %d, device %s",
                 dcfg.num_hidden_layers, count_parameters(drafter) / 1e6, layer_ids, mask_id, attention,
                 len(source), total_steps, steps_per_epoch, global_batch, dist_.world, dev)
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                            betas=(0.9, 0.95), fused=gpu or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda_factory(total_steps, warmup))

    ckpt_dir = Path(args.checkpoint_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = ckpt_dir / "metrics.jsonl"
    fp = _fingerprint(args, dcfg, total_steps, global_batch, len(source))
    start_step = 0
    mirror = None
    if args.checkpoint_mirror:
        from dflash_pipeline.drafter.checkpoint_mirror import CheckpointMirror

        mirror = CheckpointMirror(args.checkpoint_mirror, args.keep_checkpoints)
        if latest_checkpoint(ckpt_dir) is None:  # a new machine: bring the newest checkpoint back
            mirror.fetch_latest(ckpt_dir)
        dist_.barrier()
    last = latest_checkpoint(ckpt_dir)
    if last is not None:
        state = torch.load(last, map_location="cpu", weights_only=True)
        if json.loads(state["fingerprint"]) != json.loads(json.dumps(fp)):
            # other settings or data (a config change reruns the rule): never mix runs; keep the old files
            dist_.barrier()
            if dist_.main:
                aside = ckpt_dir / f"stale-{time.strftime('%Y%m%d-%H%M%S')}"
                aside.mkdir()
                for f in list(ckpt_dir.glob("step-*.pt")) + [metrics_path]:
                    if f.exists():
                        f.rename(aside / f.name)
                log.warning("%s was written by a run with other settings; moved to %s, starting at step 0",
                            last, aside)
            dist_.barrier()
            state = None
    if last is not None and state is not None:
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start_step = int(state["step"])
        _set_rng_state(state["rng"], dev)
        if dist_.main:
            log.info("resumed from %s at step %d", last, start_step)
    if dist_.main:  # the live metrics log continues from the checkpoint: drop lines of lost steps
        lines = metrics_path.read_text().splitlines() if metrics_path.exists() and start_step else []
        kept = [ln for ln in lines if ln.strip() and json.loads(ln)["step"] <= start_step]
        metrics_path.write_text("".join(ln + "\n" for ln in kept))

    if args.mode == "online":
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(args.model, dtype=head_dtype).to(dev).eval()
        target.requires_grad_(False)
    if gpu:  # one compiled kernel per padded shape (max_length / 256 buckets): allow that many recompiles
        import torch._dynamo as dynamo  # (a plain `import torch._dynamo` would make `torch` local here)

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, max(64, getattr(dynamo.config, name)))
    model = drafter
    if args.compile and gpu:
        for layer in drafter.layers:
            layer.compile()
    if dist_.world > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(drafter, device_ids=[dev.index] if gpu else None)

    orders: dict[int, list[int]] = {}

    def order_for(epoch):
        if epoch not in orders:
            orders.clear()
            orders[epoch] = epoch_order(source, args.seed, epoch)
        return orders[epoch]

    def step_data(step):
        epoch, off = divmod(step, steps_per_epoch)
        order = order_for(epoch)
        positions = list(range(off * global_batch, (off + 1) * global_batch))
        return _batches(source, order, positions, args, epoch, dist_, args.grad_accum)

    bs = dcfg.block_size
    acc_count = torch.zeros(bs, device=dev)
    acc_correct = torch.zeros(bs, device=dev)
    acc_ce = torch.zeros(bs, device=dev)
    acc_loss = torch.zeros(2, device=dev)  # weighted loss sum, weights
    acc_tokens = 0
    t_log = time.perf_counter()
    t_start = t_log
    prefetch = Prefetcher(step_data)
    if start_step < total_steps:
        prefetch.start(start_step)
    for step in range(start_step, total_steps):
        key, micro = prefetch.get()
        assert key == step
        if step + 1 < total_steps:
            prefetch.start(step + 1)
        model.train()
        for m, (samples, anchors) in enumerate(micro):
            batch = collate(samples, anchors, pad_multiple=256 if gpu else 1,
                            num_blocks=args.num_anchors if gpu else 0).to(dev)
            labels = None
            if batch.features is None and args.labels == "target":
                feats, labels = target_features_and_predictions(target, batch.input_ids, batch.lengths, layer_ids)
            elif batch.features is None:
                feats = target_features(target, batch.input_ids, batch.lengths, layer_ids)
            else:
                feats = batch.features
            sync_ctx = model.no_sync() if (dist_.world > 1 and m < len(micro) - 1) else _null()
            with sync_ctx, torch.autocast("cuda", dtype=torch.bfloat16, enabled=gpu):
                out = block_loss(model if dist_.world == 1 else _DDPCall(model), head, batch, feats, args.gamma,
                                 attention=attention, compute_dtype=torch.bfloat16 if gpu else torch.float32,
                                 labels=labels)
                (out.loss / len(micro)).backward()
            acc_count += out.count
            acc_correct += out.correct
            acc_ce += out.ce_sum
            acc_loss += torch.stack([out.loss.detach() * out.weight_sum, torch.tensor(out.weight_sum, device=dev)])
            acc_tokens += batch.num_tokens
        if args.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), args.grad_clip)
        else:
            grad_norm = torch.tensor(0.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        if done % args.log_every == 0 or done == total_steps:
            stats = dist_.all_sum(torch.cat([acc_count, acc_correct, acc_ce, acc_loss,
                                             torch.tensor([float(acc_tokens)], device=dev)]))
            cnt, cor, ce = stats[:bs], stats[bs:2 * bs], stats[2 * bs:3 * bs]
            lsum, wsum, toks = stats[3 * bs], stats[3 * bs + 1], stats[3 * bs + 2]
            elapsed = time.perf_counter() - t_log
            rec = {
                "step": done, "epoch": round(done / steps_per_epoch, 3), "lr": sched.get_last_lr()[0],
                "loss": float(lsum / wsum.clamp(min=1e-9)),
                "accuracy": float(cor[1:].sum() / cnt[1:].sum().clamp(min=1)),
                "grad_norm": float(grad_norm),
                "tokens_per_s": float(toks) / max(elapsed, 1e-9),
                "acc_per_position": [None if c == 0 else float(a / c) for a, c in zip(cor.tolist(), cnt.tolist())],
                "loss_per_position": [None if c == 0 else float(e / c) for e, c in zip(ce.tolist(), cnt.tolist())],
                "count_per_position": [int(c) for c in cnt.tolist()],
            }
            if dist_.main:
                with open(metrics_path, "a") as fh:
                    fh.write(json.dumps(rec) + "\n")
                log.info("step %d/%d epoch %.2f loss %.4f acc %.3f lr %.2e %.0f tok/s", done, total_steps,
                         rec["epoch"], rec["loss"], rec["accuracy"], rec["lr"], rec["tokens_per_s"])
            acc_count.zero_(); acc_correct.zero_(); acc_ce.zero_(); acc_loss.zero_()
            acc_tokens = 0
            t_log = time.perf_counter()
        if done % args.checkpoint_every == 0 or done == total_steps:
            if dist_.main:
                saved = _save_checkpoint(ckpt_dir, done, drafter, opt, sched, fp, dev, args.keep_checkpoints)
                if mirror is not None:
                    mirror.upload(saved)
            dist_.barrier()
        if args.debug_kill_at_step and done == args.debug_kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)  # tests: a hard kill, nothing flushed or cleaned up

    if mirror is not None:
        mirror.wait()  # the last checkpoint is on S3 before the job reports success
    if dist_.main:
        wall = time.perf_counter() - t_start
        with storage.atomic_dir(args.out) as tmp:
            save_file(drafter.engine_state_dict(), str(tmp / "drafter.safetensors"))
            storage.write_json(tmp / "drafter_config.json", dcfg.to_dict())
            shutil.copyfile(metrics_path, tmp / "metrics.jsonl")
            records = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
            summary = summarize(records, dcfg, args, total_steps, len(source), wall, start_step)
            storage.write_json(tmp / "summary.json", summary)
            plot_metrics(records, tmp / "per_position.png")
            make_readable(tmp)
        log.info("drafter written to %s", args.out)
    dist_.barrier()
    dist_.close()
    return 0


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _DDPCall:
    """Routes block_loss's drafter calls through the DDP wrapper (gradient sync) while exposing `.config`."""

    def __init__(self, ddp):
        self.ddp = ddp
        self.config = ddp.module.config

    def __call__(self, *a, **kw):
        return self.ddp(*a, **kw)


def _save_checkpoint(ckpt_dir: Path, step: int, drafter, opt, sched, fp: dict, dev, keep: int) -> Path:
    path = ckpt_dir / f"step-{step:08d}.pt"
    state = {
        "model": drafter.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
        "step": step, "rng": _rng_state(dev), "fingerprint": json.dumps(fp),
    }
    with storage.atomic_path(path) as tmp:
        torch.save(state, tmp)
    for old in sorted(ckpt_dir.glob("step-*.pt"))[:-max(1, keep)]:
        old.unlink(missing_ok=True)
    log.info("checkpoint %s", path)
    return path


def summarize(records: list[dict], dcfg, args, total_steps: int, n_samples: int, wall: float, start_step: int) -> dict:
    last = records[-max(1, min(len(records), 5)):]
    cnt = [sum(r["count_per_position"][k] for r in last) for k in range(dcfg.block_size)]

    def avg(key, k):
        num = sum((r[key][k] or 0.0) * r["count_per_position"][k] for r in last)
        return None if cnt[k] == 0 else num / cnt[k]

    return {
        "mode": args.mode, "labels": args.labels, "steps": total_steps, "samples": n_samples, "target_layer_ids": dcfg.target_layer_ids,
        "num_layers": dcfg.num_hidden_layers, "block_size": dcfg.block_size, "mask_token_id": dcfg.mask_token_id,
        "final_loss": records[-1]["loss"] if records else None,
        "final_accuracy": records[-1]["accuracy"] if records else None,
        "final_acc_per_position": [avg("acc_per_position", k) for k in range(dcfg.block_size)],
        "final_loss_per_position": [avg("loss_per_position", k) for k in range(dcfg.block_size)],
        "wall_seconds_this_run": round(wall, 2), "resumed_from_step": start_step,
    }


def plot_metrics(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    if records:
        steps = [r["step"] for r in records]
        axes[0].plot(steps, [r["loss"] for r in records], label="loss (decay-weighted)")
        axes[0].plot(steps, [r["accuracy"] for r in records], label="accuracy")
        axes[0].set_xlabel("step")
        axes[0].legend()
        axes[0].set_title("training")
        picks = sorted({0, len(records) // 2, len(records) - 1})
        for i in picks:
            r = records[i]
            ks = [k for k, v in enumerate(r["acc_per_position"]) if v is not None]
            axes[1].plot(ks, [r["acc_per_position"][k] for k in ks], marker="o", label=f"step {r['step']}")
            axes[2].plot(ks, [r["loss_per_position"][k] for k in ks], marker="o", label=f"step {r['step']}")
    axes[1].set_title("accuracy per block position")
    axes[2].set_title("cross-entropy per block position")
    for ax in axes[1:]:
        ax.set_xlabel("position in block (k)")
        ax.legend()
    fig.tight_layout()
    with storage.atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=90)
    plt.close(fig)


run = keeps_torch_threads(_run)
