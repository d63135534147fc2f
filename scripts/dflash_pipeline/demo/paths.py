"""The demo's own paths. The demo builds its raw files and its tiny target with rules, only at these relative
paths: a target.model_path or an input elsewhere is the user's, read and never written, whatever demo.enabled
says."""

from __future__ import annotations

import os

DATA_DIR = "data/demo"
TARGET_DIR = "resources/demo-target"
# every file `dflash-pipeline tiny-model` writes: all are declared, so under S3 storage the whole model
# directory travels to the jobs that need it (config.json first: a job takes the directory of the first)
TARGET_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja", "demo_target.json")


def is_demo_path(path, demo_dir: str) -> bool:
    """True for the demo's own relative path (or a path under it), never for a user's path."""
    norm = os.path.normpath(str(path))
    return not os.path.isabs(norm) and (norm == demo_dir or norm.startswith(demo_dir + os.sep))


def demo_builds_target(config: dict) -> bool:
    """The workflow builds the target: the demo is on and target.model_path is the demo's own."""
    return bool(config["demo"]["enabled"]) and is_demo_path(config["target"]["model_path"], TARGET_DIR)


def demo_target_files() -> list[str]:
    """The tiny target's files: the demo rule's outputs."""
    return [os.path.join(TARGET_DIR, f) for f in TARGET_FILES]


def demo_data_files(raw_inputs: dict[str, str]) -> list[str]:
    """The configured inputs that the demo builds (those at its own path only)."""
    return [path for path in raw_inputs.values() if is_demo_path(path, DATA_DIR)]
