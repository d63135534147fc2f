"""`dflash-pipeline STAGE --help` shows each option's default, and for a stage with a config section those are
the schema's defaults (the values a stage run by hand takes)."""

from __future__ import annotations

import pytest
from conftest import run_cli

from dflash_pipeline.settings import defaults as schema_defaults


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


# Each workflow job starts one `dflash-pipeline STAGE`: a stage that only reads and writes files must not pay for
# importing torch (seconds per job; the tiny pipeline runs a dozen such jobs).
TORCH_FREE = ("ingest", "manifest", "shard", "tokenize", "audit", "gate", "calibrate-sample", "plan",
              "generation-gate", "evaluate-gate", "with-gpus", "launch-torchrun", "report-figures", "reset")


def test_file_only_stages_do_not_import_torch():
    import json
    import subprocess
    import sys

    code = ("import importlib, json, sys\nfrom dflash_pipeline.cli import STAGES\n"
            f"for name in {TORCH_FREE!r}:\n"
            "    importlib.import_module(STAGES[name].module)\n"
            "print(json.dumps('torch' in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(proc.stdout) is False, proc.stdout
