"""Train settings added after runs existed: each enters the train rule's params and a checkpoint's fingerprint
only when it is set away from its schema default, so an upgrade neither reruns a finished train job nor sets its
checkpoints aside."""

from __future__ import annotations

from collections.abc import Mapping

from dflash_pipeline import settings

TRAIN_KEYS_ADDED_LATER = ("layer_init", "loss_normalization")


def set_away_from_default(values: Mapping) -> dict:
    """{key: value} of the later train keys in `values` whose value is not the schema's default."""
    return {k: values[k] for k in TRAIN_KEYS_ADDED_LATER
            if k in values and values[k] != settings.default(f"train.{k}")}


def at_default(train: Mapping) -> tuple[str, ...]:
    """The later train keys of a config's train section that are at their default (or absent): left out."""
    return tuple(k for k in TRAIN_KEYS_ADDED_LATER if k not in set_away_from_default(train))
