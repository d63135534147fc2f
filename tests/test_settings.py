"""One default per setting: the packaged schema states it, every stage's option takes it from there, and a stage's
typed settings object is built from the same schema."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import shutil
import subprocess
import sys
import tomllib
import types
import typing

import pytest

from conftest import REPO
from dflash_pipeline import cli, settings
from dflash_pipeline.settings import typed

# Options named like a config key that are another thing: a new one must say here why it is not that setting.
NOT_THE_SETTING = {
    ("demo-data", "seed"): "the demo corpus's draw; no config key",
    ("tiny-model", "num_layers"): "the tiny target's decoder layers, not the drafter's",
    ("tiny-model", "seed"): "the tiny target's initialisation; no config key",
    ("manifest", "records"): "the ingested files to read (paths)",
    ("shard", "records"): "the ingested file to cut (a path)",
    ("audit", "mode"): "the gate's mode (prompts or full), decided by generate.enabled; not train.mode",
    ("train", "device"): "the job's device; no config key for training",
    ("evaluate", "device"): "the job's device; no config key for evaluation",
    ("evaluate", "seed"): "the untrained drafter's initialisation and the sampling seed; no config key",
}


def _leaf_keys(node: dict, prefix: str = ""):
    for key, prop in (node.get("properties") or {}).items():
        if not isinstance(prop, dict):
            continue
        if prefix:  # keys inside a section; top-level names (results, inputs, train) are sections or paths
            yield key
        yield from _leaf_keys(prop, f"{prefix}{key}.")


def _raw_parser(stage: str) -> argparse.ArgumentParser:
    """The stage's options as its module adds them, before the schema's defaults are applied."""
    spec = cli.STAGES[stage]
    parser = argparse.ArgumentParser()
    getattr(importlib.import_module(spec.module), spec.add_arguments)(parser)
    return parser


@pytest.mark.parametrize("stage", sorted(cli.STAGES))
def test_each_setting_option_takes_the_schema_default_and_states_none(stage):
    parser = _raw_parser(stage)
    dests = cli.option_dests(parser)
    keys = cli.setting_keys(stage, dests)
    copies = {d: dests[d].default for d in keys if dests[d].default is not None}
    assert not copies, f"{stage}: options that repeat the schema's default (leave it to the schema): {copies}"
    cli.apply_settings(parser, stage)
    for dest, path in keys.items():
        assert parser.get_default(dest) == settings.default(path), (stage, dest, path)


@pytest.mark.parametrize("stage", sorted(cli.STAGES))
def test_an_option_named_like_a_setting_is_that_setting_or_says_why(stage):
    names = set(_leaf_keys(settings.schema()))
    dests = cli.option_dests(_raw_parser(stage))
    mapped = cli.setting_keys(stage, dests)
    unexplained = sorted(d for d in dests if d in names and d not in mapped and (stage, d) not in NOT_THE_SETTING)
    assert not unexplained, f"{stage}: map to their config key (Stage sections/aliases) or explain: {unexplained}"
    stale = [d for s, d in NOT_THE_SETTING if s == stage and (d not in dests or d in mapped)]
    assert not stale, f"NOT_THE_SETTING names {stage} options that are gone or mapped: {stale}"


def test_the_schema_is_package_data():
    """An installed package carries the schema: setuptools ships what package-data names."""
    assert settings.SCHEMA_PATH.parent == REPO / "scripts" / "dflash_pipeline" / "settings"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    shipped = pyproject["tool"]["setuptools"]["package-data"]["dflash_pipeline"]
    assert "settings/schema.yaml" in shipped
    assert not (REPO / "rules" / "schemas").exists()  # no second copy beside the rules


def test_a_package_outside_the_checkout_has_the_same_defaults(tmp_path):
    """`dflash-pipeline evaluate` took 32 prompts when installed and 64 in a checkout: the schema was found two
    folders above the package. The package alone, copied away from the checkout, now gives the schema's."""
    shutil.copytree(REPO / "scripts" / "dflash_pipeline", tmp_path / "dflash_pipeline",
                    ignore=shutil.ignore_patterns("__pycache__"))
    calls = {"evaluate": ["--drafter", "d", "--model", "m", "--tokens", "t", "--out", "o", "--plot", "p"],
             "generate": ["--input", "i", "--out", "o"]}
    code = ("import json, sys\nfrom dflash_pipeline import cli\n"
            "argv = sys.argv[1:]\n"
            "print(json.dumps(vars(cli.build_parser(argv[0], argv).parse_args(argv)), default=str))")
    out = {}
    for stage, argv in calls.items():
        proc = subprocess.run([sys.executable, "-c", code, stage, *argv], capture_output=True, text=True,
                              cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
        assert proc.returncode == 0, proc.stderr
        out[stage] = json.loads(proc.stdout)["num_prompts" if stage == "evaluate" else "max_new_tokens"]
    assert out == {"evaluate": settings.default("evaluate.num_prompts"),
                   "generate": settings.default("generate.max_new_tokens")}
    assert out == {"evaluate": 64, "generate": 4096}


def _is_instance(value, kind) -> bool:
    allowed = typing.get_args(kind) if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union \
        else (kind,)
    return isinstance(value, allowed)


@pytest.mark.parametrize("stage", sorted(s for s in cli.STAGES if cli.STAGES[s].sections))
def test_typed_settings_have_the_schema_fields_types_and_defaults(stage):
    parser = _raw_parser(stage)
    cli.apply_settings(parser, stage)
    for action in parser._actions:
        action.required = False  # paths: not settings
    args = parser.parse_args([])
    obj = typed.for_stage(stage, args)
    keys = cli.setting_keys(stage, cli.option_dests(parser))
    assert {f.name for f in dataclasses.fields(obj)} == set(keys)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        assert value is None or _is_instance(value, f.type), (stage, f.name, value, f.type)
        default = settings.default(keys[f.name])
        assert value == (tuple(default) if isinstance(default, list) else default), (stage, f.name)
    with pytest.raises(dataclasses.FrozenInstanceError):
        obj.__setattr__(next(iter(keys)), None)


def test_python_types_of_schema_properties():
    assert typed.python_type({"type": "integer"}) is int
    assert typed.python_type({"type": ["integer", "null"]}) == int | None
    assert typed.python_type({"oneOf": [{"type": "null"}, {"type": "number"}]}) == type(None) | float | int
    assert typed.python_type({"enum": ["a", "b"]}) is str
    assert typed.python_type({"type": "array", "items": {"type": "string"}}) is tuple


def _train_options(*extra: str) -> argparse.Namespace:
    argv = ["train", "--inputs", "t.parquet", "--model", "m", "--out", "o", "--checkpoint-dir", "c", *extra]
    return cli.build_parser("train", argv).parse_args(argv)


def test_train_run_by_hand_may_hold_out_nothing_while_the_workflow_needs_a_split():
    """train's --holdout-fraction is the workflow's evaluate.holdout_fraction (same default), but a stage run by
    hand may hold out nothing (0: every sample trains, no acceptance monitor), as benchmarks/recipe_at_scale.py's
    tiny run does; the workflow's config still needs a held-out split for evaluate."""
    assert _train_options().holdout_fraction == settings.default("evaluate.holdout_fraction")
    cli.check_options(_train_options("--holdout-fraction", "0"), "train")
    cli.apply_settings(_raw_parser("train"), "train", json.dumps({"holdout_fraction": 0}))
    for bad in ("-0.1", "0.6"):
        with pytest.raises(cli.PipelineError, match="--holdout-fraction"):
            cli.check_options(_train_options("--holdout-fraction", bad), "train")
    assert settings.problem(0, settings.prop("evaluate.holdout_fraction")) is not None
    assert settings.problem(0.0, cli.option_prop("evaluate", "holdout_fraction", "evaluate.holdout_fraction"))


def test_stage_bounds_name_options_that_are_settings():
    for stage, spec in cli.STAGES.items():
        keys = cli.setting_keys(stage, cli.option_dests(_raw_parser(stage)))
        assert set(spec.bounds) <= set(keys), (stage, sorted(set(spec.bounds) - set(keys)))
        assert all(set(b) <= set(cli.BOUND_KEYWORDS) for b in spec.bounds.values()), stage


# `.get(<a setting's name>, <literal>)` (or `.get(...) or <literal>`) in the package is a second default unless the
# dict is not a settings section: each such (module, key) says here what it reads instead.
NOT_A_SETTINGS_READ = {
    ("data/audit.py", "samples"): "sample counts of the audit's totals",
    ("hidden_states/extract.py", "samples"): "sample counts of a shard's stats",
    ("report/figures.py", "samples"): "sample counts of the reports",
    ("planning/rates.py", "startup_s"): "a measured start-up of calibrate-rates' output",
    ("planning/rates.py", "device"): "the GPU name calibrate-rates measured on",
    ("planning/projection.py", "startup_s"): "the calibration's measured start-up",
    ("planning/evaluate_rates.py", "device"): "the device the decode steps were timed on",
    ("generation/calibrate.py", "seed"): "the calibration sample's recorded seed (its file's metadata)",
}


def _literal_default_reads(tree, names: set[str]):
    """(line, key) of `x.get("key", <constant>)` and `x.get("key") or <constant>` for keys in `names`."""
    import ast

    def key_of(call):
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "get"
                and call.args and isinstance(call.args[0], ast.Constant) and call.args[0].value in names):
            return call.args[0].value
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and len(node.args) == 2 and isinstance(node.args[1], ast.Constant) and key_of(node):
            yield node.lineno, key_of(node)
        if (isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and len(node.values) == 2
                and key_of(node.values[0]) and isinstance(node.values[1], ast.Constant)):
            yield node.lineno, key_of(node.values[0])


def test_no_module_writes_a_settings_default_of_its_own():
    import ast

    names = set(_leaf_keys(settings.schema()))
    package = REPO / "scripts" / "dflash_pipeline"
    found, allowed_seen = [], set()
    for path in sorted(package.rglob("*.py")):
        module = path.relative_to(package).as_posix()
        for line, key in _literal_default_reads(ast.parse(path.read_text()), names):
            if (module, key) in NOT_A_SETTINGS_READ:
                allowed_seen.add((module, key))
            else:
                found.append(f"{module}:{line} {key!r}")
    assert not found, f"defaults written beside the schema's (use settings.value / settings.default): {found}"
    assert allowed_seen == set(NOT_A_SETTINGS_READ), f"stale exceptions: {set(NOT_A_SETTINGS_READ) - allowed_seen}"


def test_the_literal_default_scan_finds_a_second_default():
    import ast

    src = 'def f(cfg, s):\n    a = cfg.get("max_new_tokens", 2048)\n    b = s.get("block_size") or 16\n    return cfg.get("x", 1)\n'
    assert list(_literal_default_reads(ast.parse(src), {"max_new_tokens", "block_size"})) == [
        (2, "max_new_tokens"), (3, "block_size")]


def _setting_fields():
    """(class, field, dotted key) of every dataclass field in the package that takes a schema default."""
    import importlib
    import inspect
    import pkgutil

    import dflash_pipeline

    found = []
    for mod in pkgutil.walk_packages(dflash_pipeline.__path__, "dflash_pipeline."):
        if mod.name.endswith(".live_kernels"):
            continue  # the Triton kernels: importable only where triton is, and no settings in them
        module = importlib.import_module(mod.name)
        for _, cls in inspect.getmembers(module, dataclasses.is_dataclass):
            if cls.__module__ == mod.name:
                found += [(cls, f, f.metadata["setting"]) for f in dataclasses.fields(cls) if "setting" in f.metadata]
    return found


def _members(kind) -> set:
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        return set().union(*(_members(k) for k in typing.get_args(kind)))
    return {typing.get_origin(kind) or kind}


def test_hand_written_stage_settings_agree_with_the_schema():
    """The stages whose options object is written out (extract, generation) rather than generated (typed.py):
    each field that takes its default from the schema accepts every type the schema allows, and its default."""
    found = _setting_fields()
    assert {c.__name__ for c, _, _ in found} >= {"ExtractSettings", "SamplingParams", "Policy"}, found
    for cls, f, key in found:
        hint = typing.get_type_hints(cls)[f.name]
        allowed = _members(hint) | ({int} if float in _members(hint) else set())  # PEP 484: float takes an int
        assert _members(typed.python_type(settings.prop(key))) <= allowed, (cls.__name__, f.name, key, hint)
        assert _is_instance(settings.default(key), tuple(allowed - {typing.Any}) or object), (cls.__name__, f.name)
