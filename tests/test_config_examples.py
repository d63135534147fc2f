"""The shipped configs validate against the schema, and the real-run example plans with Snakemake."""

from __future__ import annotations

import copy

import jsonschema
import yaml

from conftest import REPO
from test_audit_gate import snakemake


def merged(*names: str) -> dict:
    cfg: dict = {}

    def merge(a, b):
        for k, v in b.items():
            if isinstance(v, dict) and isinstance(a.get(k), dict):
                merge(a[k], v)
            else:
                a[k] = copy.deepcopy(v)

    for name in names:
        merge(cfg, yaml.safe_load((REPO / "config" / name).read_text()))
    return cfg


def test_configs_validate():
    schema = yaml.safe_load((REPO / "config/schema.yaml").read_text())
    jsonschema.validate(merged("config.yaml"), schema)
    jsonschema.validate(merged("config.yaml", "qwen3-8b.example.yaml"), schema)


def test_example_plans_with_snakemake(tmp_path, tiny_target, demo_raw):
    """The Qwen3-8B example (sglang generation, offline training on 8 GPUs) builds a DAG: inputs and
    model pointed at local stand-ins, the rest of the example unchanged."""
    cfg = merged("qwen3-8b.example.yaml")
    cfg["inputs"] = [str(p) for p in sorted(demo_raw.iterdir())]
    cfg["target"]["model_path"] = str(tiny_target)
    proc = snakemake(tmp_path, "-n", "--resources", "gpu=8", config=cfg, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ingest" in proc.stdout and "manifest" in proc.stdout
