"""The target model as the workflow sees it (rules/common.smk): a transformers directory of the user's, the
demo's tiny target (built by a rule), or a GGUF file that a rule imports once into a directory under the results.

A user's model directory is no job's output, so no job's input: its identity (target.fingerprint: config, chat
template and tokenizer files, the weight files' names, sizes and mtimes) is a param of every job that reads the
target, so a target retrained or re-templated in place reruns exactly those jobs (tokenize and the plan only when
what tokenization reads changed). The demo's target and an imported GGUF are outputs: mtimes do that."""

from __future__ import annotations

import os
from dataclasses import dataclass

from dflash_pipeline.target import fingerprint, is_gguf_path

BUILT = "a workflow output"  # the identity of a target that is a rule's output


@dataclass(frozen=True)
class TargetSource:
    path: str        # the resolved target.model_path
    resolved: bool   # False: its pkg:// path did not resolve (a preflight problem)
    built: bool      # the demo's own target, written by a rule

    @property
    def is_gguf(self) -> bool:
        return is_gguf_path(self.path) and not self.built

    @property
    def tracked(self) -> bool:
        """A user's directory, identified by its fingerprint (not by a rule's output)."""
        return self.resolved and not self.built and not self.is_gguf and os.path.isdir(self.path)

    def identity(self, weights: bool = True) -> str:
        """A param of the jobs that read the target; weights=False for those that read only its tokenizer."""
        return fingerprint(self.path, weights=weights) if self.tracked else BUILT

    def files(self, built_files: list[str], imported_files: list[str]) -> list[str]:
        """The files that make the target an input, so jobs wait for the job that builds them: the demo's target
        (`built_files`) or the import of a GGUF (`imported_files`); none for a user's directory."""
        if self.built:
            return list(built_files)
        return list(imported_files) if self.is_gguf else []

    def model_dir(self, input_files) -> str:
        """The model directory as a job sees it (a storage-local copy when its inputs come from S3)."""
        return os.path.dirname(str(input_files[0])) if self.built or self.is_gguf else self.path

    def preflight_path(self) -> str | None:
        """The directory the preflight checks: None when the workflow builds it or its path did not resolve."""
        return self.path if self.resolved and not self.built else None
