"""The config's paths as the workflow reads them (rules/common.smk): raw inputs (paths, globs, s3:// URIs,
pkg://PACKAGE/PATH), the evaluation and excluded prompts, and the target's source. Resolved once while the
workflow parses. Mistakes (a glob matching no file, a pkg:// package that is not installed) are collected in
`problems`, not raised, so that the preflight reports them with the target's and the resources' in one run: a
user fixes them all at once instead of one per dry run."""

from __future__ import annotations

import glob
import os
import re

from dflash_pipeline import package_paths
from dflash_pipeline.settings import value
from dflash_pipeline.errors import PipelineError


def source_name(path: str) -> str:
    """A raw file's name in the workflow (the {src} wildcard): its base name without data suffixes, safe chars."""
    name = re.sub(r"(\.(json|jsonl|gz|zst))+$", "", os.path.basename(path.rstrip("/")))
    return re.sub(r"[^A-Za-z0-9_.]+", "_", name) or "input"


class ConfigPaths:
    def __init__(self, config: dict):
        self.problems: list[str] = []
        self.raw_inputs = self._expand_inputs(config["inputs"])
        # evaluation prompts (MT-Bench question.jsonl): evaluated beside the held-out split, and never trained on
        self.eval_prompts = self._resolve("evaluate.prompts_file",
                                          value(config.get("evaluate"), "evaluate.prompts_file")) or None
        excluded = {self._resolve("ingest.exclude_prompts", p) for p in config["ingest"].get("exclude_prompts") or []}
        self.exclude_prompts = sorted({p for p in excluded if p} | ({self.eval_prompts} if self.eval_prompts else set()))
        try:  # must_exist=False: the demo's target is built by the workflow
            self.target_source = package_paths.resolve(config["target"]["model_path"], must_exist=False)
            self.target_resolved = True
        except PipelineError as exc:
            self.problems.append(f"config target.model_path: {exc}")
            self.target_source, self.target_resolved = config["target"]["model_path"], False

    def _resolve(self, key: str, path: str) -> str:
        try:
            return package_paths.resolve(path)
        except PipelineError as exc:
            self.problems.append(f"config {key}: {exc}")
            return ""

    def _expand_inputs(self, patterns: list[str]) -> dict[str, str]:
        """Config `inputs` -> {source name: path}, names unique and stable (in the order of the config)."""
        paths = []
        for pattern in patterns:
            pattern = self._resolve("inputs", pattern)  # pkg://PACKAGE/PATH: a file in an installed package
            if not pattern:
                continue
            if pattern.startswith("s3://") or not glob.has_magic(pattern):
                paths.append(pattern)
                continue
            matched = sorted(glob.glob(pattern))
            if not matched:
                self.problems.append(f"config inputs: glob {pattern!r} matches no file")
            paths.extend(matched)
        sources: dict[str, str] = {}
        for path in paths:
            name = base = source_name(path)
            i = 1
            while name in sources:
                i += 1
                name = f"{base}_{i}"
            sources[name] = path
        return sources
