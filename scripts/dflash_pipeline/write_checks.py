"""Output paths checked before a stage works, and failed writes named by their path.

A stage that writes a directory (train's `--out` and `--checkpoint-dir`, export's `--out`) refuses a path that is a
file, or lies under one, before any work (train found out only after training). A write that fails (a full disk, a
file-size limit) is one line naming the path and the reason, instead of torch's `RuntimeError ... unexpected pos`
or safetensors' `SafetensorError` traceback, which name neither.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Iterator

from dflash_pipeline.errors import PipelineError


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def output_dir_problem(path: str | os.PathLike, option: str) -> str | None:
    """Why `path` cannot become (or be) a directory this process writes, or None."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        return f"{option} {path}: is a file, not a directory; name a directory (it is created if missing)"
    base = _existing_ancestor(path)
    if not base.is_dir():
        return f"{option} {path}: {base} is a file, so no directory can be made under it"
    if not os.access(base, os.W_OK | os.X_OK):
        return f"{option} {path}: {base} is not writable by this user"
    return None


def check_output_dirs(stage: str, **options: str | os.PathLike | None) -> None:
    """Every problem of the stage's output directories in one line, before any work (`--out=...` as out=...)."""
    problems = [p for name, path in options.items() if path
                for p in [output_dir_problem(path, "--" + name.replace("_", "-"))] if p]
    if problems:
        raise PipelineError(f"{stage}: " + "; ".join(problems))


def _write_reason(exc: BaseException) -> str | None:
    """What went wrong in a write, or None for an exception that is not a failed write."""
    if isinstance(exc, OSError) and exc.errno:
        return f"{os.strerror(exc.errno)} ({errno.errorcode.get(exc.errno, exc.errno)})"
    if type(exc).__name__ == "SafetensorError":
        return f"safetensors: {exc}"
    text = str(exc)
    if isinstance(exc, RuntimeError) and any(s in text for s in ("unexpected pos", "PytorchStreamWriter",
                                                                   "file write failed")):
        return f"the file could not be written completely (torch: {text.strip().splitlines()[-1][:120]})"
    return None


@contextlib.contextmanager
def named_write_errors(stage: str, path: str | os.PathLike, then: str = "rerun") -> Iterator[None]:
    """A failed write under `path` becomes one line: the path, the reason, the space left there, what to do."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - safetensors' error type is not importable by name
        reason = _write_reason(exc)
        if reason is None:
            raise
        try:
            free = f"{shutil.disk_usage(_existing_ancestor(Path(path))).free / 1e6:,.1f} MB free there"
        except OSError:
            free = "free space unknown"
        raise PipelineError(f"{stage}: writing {path} failed: {reason}; {free} (a full disk, a quota or a file-size "
                            f"limit `ulimit -f`): make room, then {then}") from None
