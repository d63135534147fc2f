"""Process-level helpers shared by the drafter stages (train, export, evaluate)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch


def keeps_torch_threads(fn):
    """A stage's CPU thread setting is its own, not its caller's (tests run stages in-process): restore it."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        threads = torch.get_num_threads()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return wrapper


def make_readable(directory: str | Path) -> None:
    """Give a directory made by `atomic_dir` (mkdtemp: 0700) and its files the usual umask permissions."""
    mask = os.umask(0)
    os.umask(mask)
    directory = Path(directory)
    os.chmod(directory, 0o777 & ~mask)
    for f in directory.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~mask)


def save_figure(fig, path: str | Path) -> None:
    """A matplotlib figure as a PNG, written atomically; the figure is closed."""
    import matplotlib.pyplot as plt

    from dflash_pipeline.storage import atomic_path

    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=90)
    plt.close(fig)
