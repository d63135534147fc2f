"""Training metrics: per-step statistics summed over micro-batches and ranks, the live metrics log
(`metrics.jsonl`: loss, accuracy, lr, loss/accuracy per block position, and the speed: data tokens/s, trained
positions/s, model TFLOP/s and MFU counted as flops.py says), the summary and the plot."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from dflash_pipeline.drafter.runtime import save_figure

log = logging.getLogger("dflash_pipeline.drafter.train")


class StepMetrics:
    """Sums of the loss statistics since the last logged step, on the training device."""

    def __init__(self, block_size: int, device: torch.device, peak_flops: float | None = None):
        self.bs, self.device, self.peak = block_size, device, peak_flops
        # count, correct, ce | loss*w, w | tokens, trained positions, TFLOP (host sums, added at record)
        self.stats = torch.zeros(3 * block_size + 5, device=device)
        self.host = [0.0, 0.0, 0.0]
        self.t_last = time.perf_counter()

    def add(self, out, num_tokens: int, positions: int = 0, flops: float = 0.0) -> None:
        bs = self.bs
        self.stats[:bs] += out.count
        self.stats[bs:2 * bs] += out.correct
        self.stats[2 * bs:3 * bs] += out.ce_sum
        self.stats[3 * bs:3 * bs + 2] += torch.stack([out.weighted_sum, out.weight_sum])
        for k, x in enumerate((num_tokens, positions, flops / 1e12)):
            self.host[k] += float(x)

    def record(self, dist_, step: int, epoch: float, lr: float, grad_norm) -> dict:
        """The log record of `step` (sums over all ranks); resets the sums."""
        bs = self.bs
        self.stats[3 * bs + 2:] += torch.tensor(self.host, device=self.device)
        stats = dist_.all_sum(self.stats.clone())
        cnt, cor, ce = stats[:bs], stats[bs:2 * bs], stats[2 * bs:3 * bs]
        lsum, wsum, toks, positions, tflop = (stats[3 * bs + k] for k in range(5))
        elapsed = max(time.perf_counter() - self.t_last, 1e-9)
        self.stats.zero_()
        self.host = [0.0, 0.0, 0.0]
        self.t_last = time.perf_counter()
        tflops = float(tflop) / elapsed
        return {
            "step": step, "epoch": round(epoch, 3), "lr": lr,
            "loss": float(lsum / wsum.clamp(min=1e-9)),
            "accuracy": float(cor[1:].sum() / cnt[1:].sum().clamp(min=1)),
            "grad_norm": float(grad_norm),
            "tokens_per_s": float(toks) / elapsed,
            "positions_per_s": float(positions) / elapsed,
            "tflops": tflops,  # model TFLOP/s over all ranks (flops.py)
            "mfu": None if not self.peak else tflops * 1e12 / (self.peak * dist_.world),
            "acc_per_position": [None if c == 0 else float(a / c) for a, c in zip(cor.tolist(), cnt.tolist())],
            "loss_per_position": [None if c == 0 else float(e / c) for e, c in zip(ce.tolist(), cnt.tolist())],
            "count_per_position": [int(c) for c in cnt.tolist()],
        }


def append_record(path: Path, rec: dict, total_steps: int) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(rec) + "\n")
    mfu = "" if rec.get("mfu") is None else f" MFU {100 * rec['mfu']:.1f}%"
    log.info("step %d/%d epoch %.2f loss %.4f acc %.3f lr %.2e %.0f tok/s %.0f positions/s %.1f TFLOP/s%s",
             rec["step"], total_steps, rec["epoch"], rec["loss"], rec["accuracy"], rec["lr"], rec["tokens_per_s"],
             rec.get("positions_per_s", 0.0), rec.get("tflops", 0.0), mfu)


def read_records(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


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
        "heldout_acceptance": heldout_summary(records, getattr(args, "acceptance_patience", 0)),
    }


def heldout_summary(records: list[dict], patience: int) -> dict | None:
    """The held-out acceptance curve's verdict: last and best tau, and whether it stopped improving."""
    from dflash_pipeline.drafter.heldout import stalled

    history = [(r["step"], r["heldout_tau"]) for r in records if r.get("heldout_tau") is not None]
    if not history:
        return None
    return {"last_step": history[-1][0], "last_tau": history[-1][1], "measurements": len(history),
            **stalled(history, patience)}


def plot_metrics(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    held = [r for r in records if r.get("heldout_tau") is not None]
    axes[3].plot([r["step"] for r in held], [r["heldout_tau"] for r in held], marker="o")
    axes[3].set_title("held-out acceptance (simulated tau, greedy)")
    axes[3].set_xlabel("step")
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
    for ax in axes[1:3]:
        ax.set_xlabel("position in block (k)")
        ax.legend()
    save_figure(fig, path)
