"""Helpers for tests that run the real Snakefile: a private copy of the workflow in a temp dir, runs of
`snakemake` as a user types it, and the parsing of what Snakemake planned."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from conftest import BIN, REPO

TINY_CONFIG = REPO / "tests" / "configs" / "tiny.yaml"
WORKFLOW_FILES = ("Snakefile", "rules", "config", "envs", "profiles")


def make_workdir(root: Path, model: Path | None = None) -> Path:
    """A run directory with the workflow sources and the tiny test config; with `model`, the demo's tiny
    target is already in place (resources/demo-target), so the run does not rebuild it."""
    root.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, root / name)
    shutil.copy2(TINY_CONFIG, root / "tiny.yaml")
    if model is not None:
        shutil.copytree(model, root / "resources" / "demo-target")
    return root


def workflow_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def snakemake(workdir: Path, *args: str, env: dict | None = None, check: bool = True, timeout: float = 600,
              profile: str = "profiles/local", configfiles=("tiny.yaml",)) -> subprocess.CompletedProcess:
    """`snakemake [TARGETS/OPTIONS] --profile P --configfile tiny.yaml` in `workdir`."""
    cmd = [str(BIN / "snakemake"), *args, "--profile", profile, "--configfile", *configfiles]
    proc = subprocess.run(cmd, cwd=workdir, env=env or workflow_env(), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-8000:]}")
    return proc


def planned(proc: subprocess.CompletedProcess) -> dict[str, int]:
    """Jobs per rule from the 'Job stats' table of a (dry) run; {} when there is nothing to do."""
    out = proc.stdout + proc.stderr
    if "Nothing to be done" in out:
        return {}
    m = re.search(r"Job stats:\njob\s+count\n[- ]+\n(.*?)\n\s*\n", out, flags=re.S)
    assert m, f"no job stats in:\n{out[-4000:]}"
    counts = {}
    for line in m.group(1).splitlines():
        name, count = line.split()
        if name != "total":
            counts[name] = int(count)
    return counts


def planned_outputs(proc: subprocess.CompletedProcess) -> list[str]:
    """The output files of the jobs a dry run lists (`output: a, b` lines)."""
    outs = []
    for m in re.finditer(r"^\s+output: (.*)$", proc.stdout + proc.stderr, flags=re.M):
        outs.extend(part.strip().split(" (")[0] for part in m.group(1).split(", "))
    return outs


def snapshot(root: Path, under: str = "results") -> dict[str, int]:
    """{relative path: mtime_ns} of every file under root/under (logs and benchmarks left out)."""
    base = root / under
    snap = {}
    for path in base.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and "/logs/" not in rel and "/benchmarks/" not in rel:
            snap[rel] = path.stat().st_mtime_ns
    return snap


def changed(before: dict[str, int], after: dict[str, int]) -> set[str]:
    return {p for p in after if before.get(p) != after[p]}
