"""`dflash-pipeline STAGE --help` shows each option's default, and for a stage with a config section those are
the schema's defaults (the values a stage run by hand takes)."""

from __future__ import annotations

import pytest
from conftest import run_cli

from dflash_pipeline.cli import schema_defaults


@pytest.mark.parametrize("stage, section, keys", [
    ("tokenize", "tokenize", ["max_length", "batch_size"]),
    ("train", "train", ["epochs", "num_anchors", "lr", "mode"]),
    ("extract", "extract", ["codec", "token_budget"]),
    ("generate", "generate", ["max_new_tokens", "temperature", "backend"]),
])
def test_stage_help_shows_the_schema_defaults(stage, section, keys):
    out = " ".join(run_cli(stage, "--help").stdout.split("options:", 1)[1].split())
    defaults = schema_defaults(section)
    for key in keys:
        option = "--" + key.replace("_", "-")
        assert f"(default: {defaults[key]})" in out.split(option + " ", 1)[1].split(" --", 1)[0], (key, out)
