"""The launch flags SGLang really has, from a checked-in list (`sglang_flags.json`, with the version it came from).

The list is extracted from the released wheel's own parser (`tests/extract_sglang_flags.py`). The pipeline checks
`generate.sglang` against it before launching anything, so a renamed or misspelled flag is one clear error
naming the flag, not a server that exits at once on a GPU node; the stand-in test server parses its command
line with the same list, strictly.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
from pathlib import Path

from dflash_pipeline.errors import PipelineError

FLAGS_FILE = Path(__file__).with_name("sglang_flags.json")
# flags that SGLang renamed: the old spelling gets the new one in the error
RENAMED = {"--mamba-scheduler-strategy": "--mamba-radix-cache-strategy"}


@functools.lru_cache(maxsize=1)
def _spec() -> dict:
    return json.loads(FLAGS_FILE.read_text())


def version() -> str:
    return _spec()["sglang_version"]


@functools.lru_cache(maxsize=1)
def by_name() -> dict[str, dict]:
    return {name: flag for flag in _spec()["flags"] for name in flag["names"]}


def choices(flag: str) -> list[str]:
    """The values SGLang accepts for `flag` ([] when any): e.g. --tool-call-parser's are 0.5.23's
    `function_call/parser_names.TOOL_CALL_PARSER_NAMES` plus "auto", as its server_args offers them."""
    return list(by_name()[flag].get("choices") or [])


def _unknown(flag: str) -> PipelineError:
    hint = RENAMED.get(flag) or next(iter(difflib.get_close_matches(flag, by_name(), n=1)), None)
    return PipelineError(f"generate.sglang: {flag} is not a launch flag of SGLang {version()}"
                         + (f" (did you mean {hint}?)" if hint else "") + f"; the known flags: {FLAGS_FILE}")


def _check_value(flag: str, spec: dict, value: str) -> None:
    if spec.get("choices") and value not in spec["choices"]:
        raise PipelineError(f"generate.sglang: {flag} {value!r}: SGLang {version()} accepts one of "
                            f"{', '.join(spec['choices'])}")
    if spec["type"] in ("int", "float"):
        try:
            (int if spec["type"] == "int" else float)(value)
        except ValueError:
            raise PipelineError(f"generate.sglang: {flag} {value!r}: not a number") from None


def check_launch_args(args: list[str]) -> None:
    """Every flag in `args` exists in SGLang's launch_server, with the values it takes; else PipelineError."""
    i = 0
    while i < len(args):
        token = str(args[i])
        if not token.startswith("--"):
            raise PipelineError(f"generate.sglang: {token!r} is not a flag and follows no flag that takes it")
        flag, eq, inline = token.partition("=")
        spec = by_name().get(flag)
        if spec is None:
            raise _unknown(flag)
        values = [inline] if eq else []
        i += 1
        if not eq and spec["value"] != "none":
            while i < len(args) and not str(args[i]).startswith("--"):
                values.append(str(args[i]))
                i += 1
                if spec["value"] in ("one", "optional"):
                    break
        if spec["value"] == "none" and (eq or (i < len(args) and not str(args[i]).startswith("--"))):
            raise PipelineError(f"generate.sglang: {flag} takes no value (got {inline if eq else args[i]!r})")
        if spec["value"] in ("one", "some") and not values:
            raise PipelineError(f"generate.sglang: {flag} needs a value")
        for value in values:
            _check_value(flag, spec, value)


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with exactly SGLang's launch flags (values as strings, choices enforced)."""
    p = argparse.ArgumentParser(prog=prog, description=f"SGLang {version()} launch_server flags",
                                allow_abbrev=False)
    nargs = {"one": None, "optional": "?", "any": "*", "some": "+"}
    types = {"int": int, "float": float}
    for flag in _spec()["flags"]:
        names = [n for n in flag["names"] if n not in ("-h", "--help")]
        if not names:
            continue
        if flag["value"] == "none":
            p.add_argument(*names, action="store_true")
        else:
            kind = str if flag.get("choices") else types.get(flag["type"], str)  # choices are stored as text
            p.add_argument(*names, nargs=nargs[flag["value"]], type=kind, choices=flag.get("choices"))
    return p
