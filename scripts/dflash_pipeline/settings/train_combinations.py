"""Train settings that are valid one by one but not together. The schema checks each key; these need two. The
workflow's preflight reports them before any job (a `snakemake -n` says so), and `dflash-pipeline train` refuses
them before any work, with the same words."""

from __future__ import annotations


def train_problems(mode: str, labels: str) -> list[str]:
    """One line per combination that cannot train (empty: fine)."""
    problems = []
    if labels != "data" and mode != "online":
        problems.append(f"train.labels: {labels} needs train.mode: online (--labels, --mode): the target's "
                        "predictions are not in the hidden-state shards")
    return problems
