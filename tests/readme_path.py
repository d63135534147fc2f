"""The README's path (demo -> your model and data -> your cluster -> cost -> run -> resume -> serve) as
commands: every fenced block marked ```` ```bash readme-path ```` is run, in the README's order, in a private copy
of the workflow, so that the README and what the workflow does cannot drift apart."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from conftest import BIN, REPO
from workflow_runs import TINY_CONFIG, planned, workflow_env

README = REPO / "README.md"
EXAMPLE = "config/qwen3-8b.example.yaml"
USER_CONFIG = "config/my-run.yaml"
SETUP = "source .venv/bin/activate"  # the README's line for a new shell; every later command runs after it
BLOCK_RE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```", flags=re.M | re.S)


def path_blocks(text: str | None = None) -> list[str]:
    """The bodies of the README's `bash readme-path` blocks, in order."""
    text = README.read_text() if text is None else text
    return [m["body"] for m in BLOCK_RE.finditer(text) if m["info"].split()[1:2] == ["readme-path"]]


def path_commands(text: str | None = None) -> list[str]:
    """One shell command per non-comment line of the path blocks (continuation lines joined)."""
    cmds = []
    for block in path_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                cmds.append(line)
    return cmds


def serve_draft_paths(text: str | None = None) -> list[str]:
    """The draft model directories the README's serving commands (SGLang, vLLM) load."""
    text = README.read_text() if text is None else text
    paths = re.findall(r"--speculative-draft-model-path (\S+)", text)
    paths += [json.loads(m)["model"] for m in re.findall(r"--speculative-config '(\{.*?\})'", text)]
    return paths


def new_shell_env() -> dict:
    """The environment of a new shell: the project's venv is not on PATH (only `make` puts it there), so a README
    command works only after the setup line the README tells a user to run."""
    env = {k: v for k, v in workflow_env().items() if k != "VIRTUAL_ENV"}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if Path(p) != BIN and p)
    return env


def walk(workdir: Path, timeout: float = 600) -> list[tuple[str, subprocess.CompletedProcess]]:
    """Run the README's path commands in `workdir` as a user types them in a new shell: the README's setup line
    (`source .venv/bin/activate`; `.venv` is the project's) first, then each command. The user's edit of the copied
    example (their inputs and model) is the tiny test config: it is written over `config/my-run.yaml` right after
    the README's `cp` made it. Each command must succeed; returns (command, result) pairs."""
    done = []
    if not (workdir / ".venv").exists():
        (workdir / ".venv").symlink_to(BIN.parent)
    cmds = path_commands()
    assert cmds[0] == SETUP, cmds[:1]
    for cmd in cmds[1:]:
        proc = subprocess.run(["bash", "-c", f"{SETUP} && {cmd}"], cwd=workdir, env=new_shell_env(),
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(f"README command failed ({proc.returncode}): {cmd}\n"
                                 f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
        check_step(workdir, cmd, proc, finished=(workdir / "results/drafter").exists())
        done.append((cmd, proc))
        if cmd.startswith("cp ") and cmd.endswith(USER_CONFIG):
            assert (workdir / USER_CONFIG).read_text() == (workdir / EXAMPLE).read_text()
            (workdir / USER_CONFIG).write_text(TINY_CONFIG.read_text())
    return done


def check_step(workdir: Path, cmd: str, proc: subprocess.CompletedProcess, finished: bool) -> None:
    """What each kind of path command must show: a dry run before the run plans every stage, after it
    nothing; the plan is printed; the run leaves the summary and the drafter that the serving commands load."""
    words = cmd.split()
    if words[0] == "snakemake" and "-n" in words:
        jobs = planned(proc)
        if finished:
            assert jobs == {}, f"{cmd}: work left after the run: {jobs}"
        else:
            # per-shard jobs appear once the manifest (the checkpoint) exists
            assert {"ingest", "manifest", "calibrate", "plan", "train", "export", "evaluate"} <= set(jobs), jobs
    elif words[:2] == ["cat", "results/preview.txt"]:
        assert "samples:" in proc.stdout and "ASSUMED" in proc.stdout, proc.stdout[:1000]
    elif words[:2] == ["dflash-pipeline", "reset"]:  # without --yes: a list, nothing deleted
        assert "would delete" in proc.stdout and "nothing deleted" in proc.stdout, proc.stdout
        assert (workdir / "results/train/drafter").exists()
    elif words[0] == "snakemake" and "--unlock" not in words and not words[1].startswith("results/"):
        assert (workdir / "results/report/summary.html").is_file()
        assert "The run's summary: results/report/summary.html" in proc.stdout  # the console points at it
        for path in serve_draft_paths():
            cfg = json.loads((workdir / path / "config.json").read_text())
            assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["target_layer_ids"]
