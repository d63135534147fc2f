"""The package's shape: stages are subpackages that match the workflow's rule files, no stage reaches into
another stage's private names, every CLI stage resolves to real functions, and no function is too long to hold
in one's head."""

from __future__ import annotations

import ast
import importlib

from conftest import REPO

PKG = REPO / "scripts" / "dflash_pipeline"
STAGE_PACKAGES = {"data", "generation", "hidden_states", "planning", "drafter", "cluster", "demo", "report",
                  "target_import"}
SHARED_PACKAGES = {"settings"}  # the config schema and the typed settings every stage reads
SHARED_MODULES = {"cli", "errors", "progress", "storage", "target", "target_layers", "package_paths",
                  "write_checks", "workflow_files", "compile_profile", "process_clock", "sample_ids"} | SHARED_PACKAGES
MAX_FUNCTION_LINES = 80


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _package_of(path) -> str:
    rel = path.relative_to(PKG).parts
    return rel[0] if len(rel) > 1 else path.stem


def test_top_level_is_stage_packages_plus_shared_modules():
    packages = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in PKG.glob("*.py")} - {"__init__"}
    assert packages == STAGE_PACKAGES | SHARED_PACKAGES, packages
    assert modules == SHARED_MODULES - SHARED_PACKAGES, modules


def test_no_stage_imports_another_stages_private_names():
    offences = []
    for path, tree in _modules():
        own = _package_of(path)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("dflash_pipeline."):
                continue
            target = node.module.split(".")[1]
            if target == own or target in SHARED_MODULES:
                continue
            private = [a.name for a in node.names if a.name.startswith("_")]
            if private or any(part.startswith("_") for part in node.module.split(".")):
                offences.append(f"{path.relative_to(REPO)}:{node.lineno} imports {node.module}: {private}")
    assert not offences, "\n".join(offences)


def test_shared_modules_import_no_stage():
    for path, tree in _modules():
        if _package_of(path) not in SHARED_MODULES or path.stem == "cli":
            continue  # cli is the registry of stages: it names them, lazily
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash_pipeline."):
                assert node.module.split(".")[1] in SHARED_MODULES, f"{path.name} imports {node.module}"


def test_every_cli_stage_names_real_functions():
    from dflash_pipeline.cli import STAGES

    for name, stage in STAGES.items():
        module = importlib.import_module(stage.module)
        assert callable(getattr(module, stage.add_arguments)), name
        assert callable(getattr(module, stage.run)), name
        if stage.module.startswith("dflash_pipeline."):
            assert stage.module.split(".")[1] in STAGE_PACKAGES, name


def test_rule_files_match_stage_packages():
    # common, verdicts: input functions only; console: no rules, hooks
    rules = {p.stem for p in (REPO / "rules").glob("*.smk")} - {"common", "verdicts", "console"}
    # each rule file's stage lives in one subpackage (evaluate/train/export are the drafter's rules)
    home = {"demo": "demo", "ingest": "data", "tokenize": "data", "audit": "data", "generate": "generation",
            "calibrate": "generation", "extract": "hidden_states", "train": "drafter", "evaluate": "drafter",
            "report": "report", "target": "target_import"}
    assert rules <= set(home), rules - set(home)
    assert {home[r] for r in rules} <= STAGE_PACKAGES


def test_no_function_is_longer_than_80_lines():
    long = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {n} lines")
    assert not long, "\n".join(long)


def test_every_module_is_used_by_the_pipeline():
    """A module that only tests or benchmarks import belongs in tests/support, not in the package (and its
    dependencies out of the pipeline's)."""
    from dflash_pipeline.cli import STAGES

    used = {spec.module for spec in STAGES.values()} | {"dflash_pipeline.cli"}
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash_pipeline"):
                used.add(node.module)
                used.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
            elif isinstance(node, ast.Import):
                used.update(a.name for a in node.names)
    for smk in (REPO / "rules").glob("*.smk"):  # the rules import helpers too
        for line in smk.read_text().splitlines():
            if line.startswith("from dflash_pipeline"):
                module, names = line[5:].split(" import ")
                used.add(module)
                used.update(f"{module}.{n.strip()}" for n in names.split(","))
    modules = {".".join(("dflash_pipeline",) + p.relative_to(PKG).with_suffix("").parts)
               for p in PKG.rglob("*.py") if p.name != "__init__.py"}
    assert not sorted(modules - used), sorted(modules - used)
