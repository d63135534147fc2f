"""Train settings that are valid one by one but not together. The schema checks each key; these need two. The
workflow's preflight reports them before any job (a `snakemake -n` says so), and `dflash-pipeline train` refuses
them before any work, with the same words."""

from __future__ import annotations


def train_problems(mode: str, labels: str, loss_weighting: str) -> list[str]:
    """One line per combination that cannot train (empty: fine)."""
    problems = []
    if labels != "data" and mode != "online":
        problems.append(f"train.labels: {labels} needs train.mode: online (--labels, --mode): the target's "
                        "predictions are not in the hidden-state shards")
    if labels == "distill" and loss_weighting == "dpace":
        problems.append("train.labels: distill with train.loss_weighting: dpace (the default; --labels, "
                        "--loss-weighting): D-PACE reads exp(-CE) of one label as an acceptance estimate, which a "
                        "soft CE is not; set train.loss_weighting: decay (the paper's, with gamma 7) or none")
    return problems
