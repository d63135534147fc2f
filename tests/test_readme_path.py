"""The README leads a user from the demo to their own drafter: its path commands exist for each step and are
the ones `tests/test_incremental.py` runs (its full run is the README's path, walked by `readme_path.walk`),
each section is listed in the contents, and every link between the README and docs/ resolves."""

from __future__ import annotations

import re
import subprocess

from conftest import BIN, REPO
from readme_path import README, SETUP, USER_CONFIG, new_shell_env, path_blocks, path_commands, serve_draft_paths

LINK_RE = re.compile(r"\]\((?P<target>[^)\s]+)\)")
FENCE_RE = re.compile(r"^```.*?^```", flags=re.M | re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path) -> set[str]:
    text = FENCE_RE.sub("", path.read_text())
    return {_slug(m) for m in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def test_the_two_commands_open_the_readme():
    head = README.read_text()[:1500]
    assert "make demo   # sets up .venv and runs the whole pipeline on the bundled demo data" in head
    assert "make test   # sets up .venv and runs the test suite" in head


def test_every_step_of_the_path_has_commands_on_the_users_config():
    text = README.read_text()
    steps = re.split(r"^### ", text.split("## The path", 1)[1].split("\n## ", 1)[0], flags=re.M)[1:]
    titles = [s.splitlines()[0] for s in steps]
    assert [t.split(".")[0] for t in titles] == [str(i) for i in range(1, 8)], titles
    for step in steps:
        title = step.splitlines()[0]
        if title.startswith(("1.", "7.")):  # make demo is above; serving needs a GPU engine
            continue
        assert path_blocks(step), f"step '{title}' has no readme-path block"
    cmds = path_commands()
    assert cmds[:2] == [SETUP, f"cp config/qwen3-8b.example.yaml {USER_CONFIG}"]
    snakemakes = [c for c in cmds if c.startswith("snakemake")]
    assert snakemakes and all(f"--configfile {USER_CONFIG}" in c for c in snakemakes), snakemakes
    # targets must precede --configfile, which takes every following word as a config file
    assert all(c.split(f"--configfile {USER_CONFIG}")[1].split()[:1] in ([], ["-n"]) for c in snakemakes)
    assert any("profiles/slurm" in c for c in snakemakes) and any("--unlock" in c for c in snakemakes)
    assert serve_draft_paths() == ["results/drafter", "results/drafter"]


def test_the_readme_names_what_a_first_real_run_needs():
    text = README.read_text()
    for needed in ("config/qwen3-8b.example.yaml", "--configfile", "inputs:", "model_path:", "profiles/kubernetes",
                   "gpu_hour_usd", "results/preview.txt", "dflash-pipeline reset", "--unlock", "sglang.launch_server", "vllm serve", "results/report/summary.html"):
        assert needed in text, needed


def test_every_section_is_in_the_contents():
    text = README.read_text()
    contents = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    linked = {m["target"][1:] for m in LINK_RE.finditer(contents) if m["target"].startswith("#")}
    body = FENCE_RE.sub("", text.split("## Contents", 1)[1].split("\n## ", 1)[1])
    sections = {_slug(h) for h in re.findall(r"^#{2,3} (.*)$", body, flags=re.M)} - {"the-path"}
    assert sections <= linked, sections - linked
    docs = {m["target"].split("#")[0] for m in LINK_RE.finditer(contents) if m["target"].startswith("docs/")}
    assert docs == {p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")}


def test_links_between_the_readme_and_docs_resolve():
    broken = []
    for page in [README, *sorted((REPO / "docs").glob("*.md"))]:
        for m in LINK_RE.finditer(FENCE_RE.sub("", page.read_text())):
            target = m["target"]
            if target.startswith(("http://", "https://")):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            if not dest.exists() or (anchor and anchor not in _anchors(dest)):
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken


def test_a_new_shell_runs_the_readme_commands_after_the_setup_line_it_names(tmp_path):
    """Issue 27: every command after the demo failed in a new shell (`snakemake: command not found`): the venv is
    on PATH only inside `make`. The README says near the top what to run first, and the path test runs its
    commands in a new shell's environment after that line (`readme_path.walk`)."""
    assert SETUP in README.read_text()[:2500]
    (tmp_path / ".venv").symlink_to(BIN.parent)
    for cmd in ("snakemake --version", "dflash-pipeline --help"):
        bare = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=new_shell_env(), capture_output=True, text=True)
        assert bare.returncode == 127 and "command not found" in bare.stderr, bare.stderr
        ready = subprocess.run(["bash", "-c", f"{SETUP} && {cmd}"], cwd=tmp_path, env=new_shell_env(),
                               capture_output=True, text=True, timeout=120)
        assert ready.returncode == 0, ready.stderr
