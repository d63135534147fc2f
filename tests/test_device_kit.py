"""The recipe-at-scale kit carries what the GPU machine's image lacks: every runtime dependency of the package is
on the image, in the kit's wheels, or never imported by the in-process stages (a kit without jsonschema stopped the
first device call of 2026-12-06 at argument parsing)."""

import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def test_every_runtime_dependency_reaches_the_device():
    import real_target_side_by_side as sbs
    import recipe_at_scale as ras

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {_norm(re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0]) for d in deps}
    covered = {_norm(n) for n in sbs.IMAGE_HAS | ras.IMAGE_ML | set(ras.BASE_WHEELS)}
    skipped = {n for n in names if any(n.startswith(_norm(p)) for p in ras.NOT_ON_DEVICE)}
    assert names - covered - skipped == set(), "add these to recipe_at_scale.BASE_WHEELS (or say why not)"

