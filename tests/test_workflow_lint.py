"""The workflow's own style checks: `snakemake --lint` finds nothing and the rules are snakefmt-formatted."""

from __future__ import annotations

import subprocess

from conftest import BIN, REPO


def test_snakemake_lint_is_clean():
    proc = subprocess.run([str(BIN / "snakemake"), "--lint", "--cores", "1"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Lints for" not in out, out[-4000:]


def test_rules_are_snakefmt_formatted():
    files = ["Snakefile", *sorted(str(p.relative_to(REPO)) for p in (REPO / "rules").glob("*.smk"))]
    proc = subprocess.run([str(BIN / "snakefmt"), "--check", "--diff", *files], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
