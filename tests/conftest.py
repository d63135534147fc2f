"""Shared fixtures: the tiny target model is built once per test session (a few seconds)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run_cli(*args: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """Run `dflash-pipeline ARGS` as a user would, capturing its output."""
    cmd = [str(BIN / "dflash-pipeline"), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """A tiny random Qwen3 target with the project's tokenizer and chat template."""
    out = tmp_path_factory.mktemp("models") / "tiny-target"
    run_cli("tiny-model", "--out", out)
    return out


@pytest.fixture(scope="session")
def demo_raw(tmp_path_factory) -> Path:
    """The three demo raw files."""
    out = tmp_path_factory.mktemp("demo-raw")
    run_cli("demo-data", "--out", out)
    return out


@pytest.fixture(autouse=True)
def _no_hub(monkeypatch):
    # nothing may come from a model hub: fail fast instead of hanging on the network
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", os.environ.get("TOKENIZERS_PARALLELISM", "true"))
