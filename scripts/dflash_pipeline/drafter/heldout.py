"""Acceptance while training: every `acceptance_every` steps, the drafter's greedy block predictions on
held-out samples against their data continuation, as speculative decoding would accept them.

A drafter can reach a high training accuracy and still accept little when served; this measures what
serving rewards. For each held-out block anchored at p, the drafter's argmax at positions k = 1..bs-1 is
compared with token p + k; the block's accepted length is 1 (the bonus token) + the leading run of matches
(a label outside the sequence or unsupervised ends the run). Reported: the mean accepted length (`tau`, the
evaluation's measure, without the target in the loop) and the fraction of blocks reaching each position.
The held-out samples are the evaluation hold-out (never trained on), a fixed subset, with fixed anchors.
"""

from __future__ import annotations

import logging

import torch

from dflash_pipeline.drafter.batch import collate, sample_anchors, scored_mask
from dflash_pipeline.drafter.loss import draft_all_blocks

log = logging.getLogger("dflash_pipeline.drafter.train")

ANCHORS_PER_SAMPLE = 32
MIN_GAIN = 0.01  # tau: a smaller rise over the best so far is not an improvement


def block_acceptance(drafter, head, batch, features, attention: str, compute_dtype, chunk: int = 4096):
    """(blocks, sum of accepted lengths, blocks reaching each position [bs]) of one batch, greedy."""
    bs = drafter.config.block_size
    hidden = draft_all_blocks(drafter, head, batch, features, attention, compute_dtype)
    flat = hidden.reshape(-1, hidden.shape[-1])
    w = head.lm_head.weight
    pred = torch.cat([(flat[i:i + chunk].to(w.dtype) @ w.T).argmax(-1) for i in range(0, flat.shape[0], chunk)])
    b, n = batch.anchors.shape
    pred = pred.view(b, n, bs)
    pos = batch.anchors[:, :, None] + torch.arange(bs, device=pred.device)
    safe = pos.clamp(max=batch.input_ids.shape[1] - 1).view(b, -1)
    label = batch.input_ids.gather(1, safe).view(b, n, bs)
    match = (pred == label) & scored_mask(batch, bs).view(b, n, bs)  # the positions the loss scores
    run = torch.cumprod(match[:, :, 1:].long(), dim=-1)[batch.block_valid]     # [blocks, bs-1]
    reach = torch.cat([torch.full((1,), run.shape[0], device=run.device), run.sum(0)]).float()
    return run.shape[0], float(run.sum()) + run.shape[0], reach


class AcceptanceMonitor:
    """Fixed held-out batches, the measurement, and the history that says when acceptance stops improving."""

    def __init__(self, holdout_source, num_samples: int, batch_size: int, seed: int, patience: int):
        n = min(num_samples, len(holdout_source))
        samples = [holdout_source.get(i) for i in range(n)]
        g = torch.Generator().manual_seed(seed)
        anchors = [sample_anchors(x["loss_mask"], ANCHORS_PER_SAMPLE, g) for x in samples]
        keep = [i for i in range(n) if len(anchors[i])]
        self.micro = [([samples[i] for i in keep[j:j + batch_size]], [anchors[i] for i in keep[j:j + batch_size]])
                      for j in range(0, len(keep), max(1, batch_size))]
        self.patience = patience
        self.history: list[tuple[int, float]] = []

    def __bool__(self) -> bool:
        return bool(self.micro)

    def load_history(self, records: list[dict]) -> None:
        """A resumed run continues the history of its metrics log."""
        self.history = [(r["step"], r["heldout_tau"]) for r in records if r.get("heldout_tau") is not None]

    @torch.no_grad()
    def measure(self, run, features_fn) -> dict:
        """The held-out acceptance record of the drafter now (`features_fn(batch)`: stored or the target's)."""
        was_training = run.drafter.training
        run.drafter.eval()
        blocks, accepted, reach = 0, 0.0, None
        for samples, anchors in self.micro:
            batch = collate(samples, anchors, pad_multiple=256 if run.gpu else 1,
                            num_blocks=ANCHORS_PER_SAMPLE if run.gpu else 0).to(run.device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=run.gpu):
                nb, acc, r = block_acceptance(run.drafter, run.head, batch, features_fn(batch), run.attention,
                                              torch.bfloat16 if run.gpu else torch.float32)
            blocks, accepted = blocks + nb, accepted + acc
            reach = r if reach is None else reach + r
        run.drafter.train(was_training)
        tau = accepted / max(1, blocks)
        return {"heldout_tau": tau, "heldout_blocks": blocks,
                "heldout_reach_per_position": [float(x) / max(1, blocks) for x in reach.tolist()]}

    def observe(self, step: int, tau: float) -> dict:
        """Add a measurement; log and return the verdict (best so far, whether it stopped improving)."""
        self.history.append((step, tau))
        verdict = stalled(self.history, self.patience)
        if verdict["stopped_improving"]:
            log.warning("held-out acceptance has not improved for %d measurements: best tau %.3f at step %d, "
                        "now %.3f at step %d", self.patience, verdict["best_tau"], verdict["best_step"], tau, step)
        return verdict


def stalled(history: list[tuple[int, float]], patience: int) -> dict:
    """Best (step, tau) so far, and whether the last `patience` measurements all failed to beat the best
    before them by MIN_GAIN."""
    best_step, best_tau, last_gain = None, float("-inf"), 0
    for i, (step, tau) in enumerate(history):
        if i == 0 or tau > best_tau + MIN_GAIN:
            last_gain = i
        if tau > best_tau:
            best_step, best_tau = step, tau
    since = len(history) - 1 - last_gain
    return {"best_step": best_step, "best_tau": None if best_step is None else best_tau,
            "measurements_since_gain": since, "stopped_improving": patience > 0 and since >= patience}
