"""How many jobs each change of the README table "what you change -> what reruns" makes Snakemake run.

One full run of the workflow (the demo config by default), then each change in a copy of that finished run:
`snakemake` once, counting the jobs it ran (and the GPU-tagged ones among them: calibrate, generate, extract,
train, evaluate), then `snakemake` again for what the first invocation left behind, until nothing is left
(at most three invocations). Run it on two trees to compare them, e.g. before and after a change:

    .venv/bin/python benchmarks/rerun_scope.py [--workflow DIR] [--config tests/configs/tiny.yaml] [--only NAME...]

`--workflow DIR` takes the Snakefile, rules and package from DIR (PYTHONPATH=DIR/scripts), so an older
checkout can be measured with this script and its changes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from rerun_scenarios import TABLE, copy_run, ran  # noqa: E402

BIN = Path(sys.executable).parent
GPU_RULES = ("calibrate", "generate", "extract", "train", "evaluate")


def snakemake(work: Path, tree: Path, configfiles, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", PYTHONPATH=str(tree / "scripts"),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [str(BIN / "snakemake"), *args, "--profile", "profiles/local", "--cores", "2"]
    if configfiles:
        cmd += ["--configfile", *configfiles]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {work}:\n{proc.stderr[-3000:]}")
    return proc


def measure(base: Path, tree: Path, configfiles, change, root: Path) -> list[dict[str, int]]:
    work = copy_run(base, root / change.__name__)
    configs = change(work, tuple(configfiles))
    invocations = []
    for _ in range(3):
        jobs = ran(snakemake(work, tree, configs))
        if not jobs:
            break
        invocations.append(jobs)
    return invocations


def describe(jobs: dict[str, int]) -> str:
    gpu = sum(n for rule, n in jobs.items() if rule in GPU_RULES)
    return f"{sum(jobs.values())} ({gpu} GPU)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workflow", type=Path, default=REPO, help="the tree whose workflow and package run")
    ap.add_argument("--config", help="a config file merged over config/config.yaml (default: the demo as it is)")
    ap.add_argument("--only", nargs="*", help="names of the changes to measure (default: all)")
    ap.add_argument("--keep", type=Path, help="work here and keep the run directories")
    args = ap.parse_args()
    tree = args.workflow.resolve()
    root = args.keep or Path(tempfile.mkdtemp(prefix="rerun-scope-"))
    base = root / "base"
    base.mkdir(parents=True, exist_ok=True)
    for name in ("Snakefile", "rules", "config", "envs", "profiles"):
        (shutil.copytree if (tree / name).is_dir() else shutil.copy2)(tree / name, base / name)
    configfiles = []
    if args.config:
        shutil.copy2(args.config, base / "user.yaml")
        configfiles = ["user.yaml"]
    t0 = time.monotonic()
    full = ran(snakemake(base, tree, configfiles))
    print(f"full run: {describe(full)} jobs in {time.monotonic() - t0:.0f} s ({tree})", flush=True)
    print("| change | 1st invocation: jobs (GPU) | 2nd | 3rd |\n|---|---|---|---|", flush=True)
    for label, _, change in TABLE:
        if args.only and change.__name__ not in args.only:
            continue
        runs = measure(base, tree, configfiles, change, root)
        cells = [describe(jobs) for jobs in runs] + ["-"] * (3 - len(runs))
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
        for i, jobs in enumerate(runs, 1):
            print(f"    invocation {i}: {dict(sorted(jobs.items()))}", file=sys.stderr, flush=True)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
