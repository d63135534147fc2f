"""One command, one sub-command per stage: `dflash-pipeline STAGE --help`.

Stage modules are imported lazily so that `dflash-pipeline ingest` does not pay for importing torch. Every
stage is named here with the module and the two functions that make it: one adds its arguments to a parser,
one runs it with the parsed arguments and returns an exit code (or None for 0).

Settings: the workflow hands a stage its config section as one JSON object (`--settings '{...}'`): keys are the
stage's long options with underscores; an unknown key is an error. An option that is a config setting (a key of
one of the stage's `sections`, or named in its `aliases`) has no default of its own: the packaged schema's
(dflash_pipeline/settings/schema.yaml) is its default, so one file states it (tests/test_settings.py checks
every stage); an explicit option on the command line wins over both. `--runtime-settings '{...}'` takes the same keys: the workflow passes there the
knobs that change how a job runs but not what it writes (progress, timeouts, retries), which are not rule
params, so that changing one reruns nothing.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import logging
import os
import sys
from dataclasses import dataclass, field

from dflash_pipeline import settings, storage
from dflash_pipeline.errors import PipelineError, StoppedBySignal


@dataclass(frozen=True)
class Stage:
    module: str
    add_arguments: str
    run: str
    help: str
    sections: tuple[str, ...] = ()  # config sections whose keys, where an option has that name, are its settings
    aliases: dict[str, str] = field(default_factory=dict)  # option -> dotted schema key, where the names differ
    # option -> its own bounds (minimum, maximum, exclusive...), where the stage run by hand accepts values the
    # workflow's config does not (the schema's bounds of that key are replaced, its type and default kept)
    bounds: dict[str, dict] = field(default_factory=dict)


# every stage that loads the target
TARGET = {"trust_remote_code": "target.trust_remote_code"}
# generate and calibrate run the same engine with the same options (calibrate measures what generate will do)
GENERATE_SECTIONS = ("generate", "generate.hf")
GENERATE_ALIASES = {**TARGET, "flush_every": "generate.journal_flush_every",
                    "progress_interval": "generate.progress_interval_s",
                    "request_timeout": "generate.request_timeout_s",
                    "all_down_timeout": "generate.all_down_timeout_s"}


STAGES = {
    "demo-data": Stage("dflash_pipeline.demo.data", "add_arguments", "run", "write the bundled demo conversations", ("demo",)),
    "tiny-model": Stage("dflash_pipeline.demo.tiny_model", "add_arguments", "run",
                        "build a tiny random Qwen3 target with a real tokenizer",
                        aliases={"pretrain_steps": "demo.target_pretrain_steps"}),
    "target-import": Stage("dflash_pipeline.target_import.gguf", "add_arguments", "run",
                           "convert a GGUF target once into a transformers directory every stage reads",
                           aliases={"dtype": "target.gguf_dtype"}),
    "ingest": Stage("dflash_pipeline.data.ingest", "add_arguments", "run",
                    "normalize one raw ShareGPT file into per-file records + quarantine", ("ingest",)),
    "manifest": Stage("dflash_pipeline.data.manifest", "add_manifest_arguments", "run_manifest",
                      "deduplicate across files and assign shards", ("ingest",)),
    "shard": Stage("dflash_pipeline.data.manifest", "add_shard_arguments", "run_shard", "write one ingested shard"),
    "tokenize": Stage("dflash_pipeline.data.tokenize", "add_arguments", "run",
                      "chat-template a shard into tokens + assistant loss mask", ("tokenize",),
                      {**TARGET, "trivial_tokens": "audit.trivial_response_tokens"}),
    "audit": Stage("dflash_pipeline.data.audit", "add_audit_arguments", "run_audit",
                   "aggregate per-shard audits into a report (JSON + HTML)"),
    "gate": Stage("dflash_pipeline.data.audit", "add_gate_arguments", "run_gate",
                  "pass or fail the data-quality gate from an audit report"),
    "generate": Stage("dflash_pipeline.generation.stage", "add_arguments", "run",
                      "regenerate responses with the target (sglang / servers / hf)", GENERATE_SECTIONS,
                      GENERATE_ALIASES),
    "calibrate-sample": Stage("dflash_pipeline.planning.calibration_sample", "add_arguments", "run",
                              "draw the calibration's prompts (stratified by prompt length and shard)",
                              ("generate.calibrate",), {"warmup": "generate.calibrate.warmup_requests"}),
    "calibrate": Stage("dflash_pipeline.generation.calibrate", "add_arguments", "run",
                       "measure the generation rate on a sample, run exactly as `generate` runs", GENERATE_SECTIONS,
                       GENERATE_ALIASES),
    "extract": Stage("dflash_pipeline.hidden_states.extract", "add_arguments", "run",
                     "extract target hidden states into a shard file", ("extract",),
                     {**TARGET, "target_layer_ids": "drafter.target_layer_ids", "num_layers": "drafter.num_layers"}),
    "plan": Stage("dflash_pipeline.planning.plan", "add_arguments", "run",
                  "print samples, tokens, bytes and GPU hours before the GPU starts"),
    "calibrate-rates": Stage("dflash_pipeline.planning.calibrate_rates", "add_arguments", "run",
                             "measure extraction and training rates on this GPU for the plan",
                             aliases={"shards_per_job": "extract.shards_per_job",
                                      "encode_threads": "extract.encode_threads"}),
    "generation-gate": Stage("dflash_pipeline.planning.plan", "add_generation_gate_arguments", "run_generation_gate",
                             "stop before the full generation when its projected wall time or GPU hours exceed the "
                             "limits", aliases={"max_wall_hours": "generate.max_wall_hours",
                                                "max_gpu_hours": "generate.max_gpu_hours"}),
    "reset": Stage("dflash_pipeline.planning.reset", "add_arguments", "run",
                   "delete a stage's resume state (journals, checkpoints), so that --forcerun redoes it"),
    "hidden-verify": Stage("dflash_pipeline.hidden_states.verify", "add_arguments", "run",
                           "check hidden-state shards (footer, index, every checksum)"),
    "train": Stage("dflash_pipeline.drafter.train", "add_arguments", "run", "train the DFlash drafter",
                   ("train", "drafter"), {**TARGET, "holdout_fraction": "evaluate.holdout_fraction"},
                   # 0 trains on every sample (no acceptance monitor); the workflow's evaluate needs a held-out split
                   {"holdout_fraction": {"minimum": 0, "maximum": 0.5}}),
    "export": Stage("dflash_pipeline.drafter.export", "add_arguments", "run",
                    "export an engine-loadable drafter checkpoint",
                    aliases={**TARGET, "dtype": "drafter.export_dtype"}),
    "evaluate": Stage("dflash_pipeline.drafter.evaluate", "add_evaluate_arguments", "run_evaluate",
                      "acceptance length of the drafter against the target", ("evaluate",), TARGET),
    "evaluate-gate": Stage("dflash_pipeline.drafter.evaluate_gate", "add_evaluate_gate_arguments", "run_evaluate_gate",
                           "fail unless the trained drafter clearly beats an untrained one"),
    "with-gpus": Stage("dflash_pipeline.cluster.gpu_slots", "add_arguments", "run",
                       "run a command on N distinct free GPUs (sets CUDA_VISIBLE_DEVICES)"),
    "launch-torchrun": Stage("dflash_pipeline.cluster.launch_torchrun", "add_arguments", "run",
                             "launch a command under torchrun (multi-node inside SLURM)"),
    "report-figures": Stage("dflash_pipeline.report.figures", "add_arguments", "run",
                            "figures and tables for `snakemake --report`"),
}


def option_dests(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions
            if a.option_strings and a.dest not in ("help", "settings", "runtime_settings")}


def setting_keys(stage: str, dests) -> dict[str, str]:
    """{option dest: dotted schema key} of the stage's options that are config settings."""
    spec = STAGES[stage]
    keys = {}
    for section in spec.sections:
        for key in settings.properties(section):
            if key in dests:
                keys.setdefault(key, f"{section}.{key}")
    keys.update({dest: path for dest, path in spec.aliases.items() if dest in dests})
    return keys


BOUND_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def option_prop(stage: str, dest: str, path: str) -> dict:
    """The property schema a stage's option is checked against: its config key's, with the stage's own bounds
    (Stage.bounds) in place of the key's where the stage has them."""
    prop = settings.prop(path)
    own = STAGES[stage].bounds.get(dest)
    if own is None:
        return prop
    return {**{k: v for k, v in prop.items() if k not in BOUND_KEYWORDS}, **own}


def _settings_object(settings_json: str | None, option: str, stage: str, dests: dict) -> dict:
    if not settings_json:
        return {}
    try:
        values = json.loads(settings_json)
    except ValueError as exc:
        raise PipelineError(f"{stage} {option}: not JSON ({exc})") from exc
    if not isinstance(values, dict):
        raise PipelineError(f"{stage} {option}: expected a JSON object, got {type(values).__name__}")
    unknown = sorted(set(values) - set(dests))
    if unknown:
        raise PipelineError(f"{stage} {option}: unknown key(s) {', '.join(map(repr, unknown))}; "
                            f"known: {', '.join(sorted(dests))}")
    return values


def _setting_value(stage: str, key: str, value, action: argparse.Action, path: str | None):
    """A `--settings` value checked against the schema (type, bounds) and converted as its option would be."""
    if path is not None and value is not None and (why := settings.problem(value, option_prop(stage, key, path))):
        raise PipelineError(f"{stage} --settings: {key}={value!r}: {why} (the config schema's {path})")
    if isinstance(value, bool) and action.choices is not None and "true" in action.choices:
        value = str(value).lower()  # YAML true/false for an option spelled auto|true|false
    if isinstance(value, str) and callable(action.type):
        try:
            value = action.type(value)
        except (ValueError, TypeError) as exc:
            raise PipelineError(f"{stage} --settings: {key}={value!r}: {exc}") from None
    if action.choices is not None and value is not None and value not in action.choices:
        raise PipelineError(f"{stage}: setting {key}={value!r} is not one of {list(action.choices)}")
    return value


def apply_settings(parser: argparse.ArgumentParser, stage: str, settings_json: str | None = None,
                   runtime_json: str | None = None) -> None:
    """Schema defaults, then `--settings` and `--runtime-settings` values, become the parser's defaults
    (explicit options still win)."""
    dests = option_dests(parser)
    keys = setting_keys(stage, dests)
    values = {dest: settings.default(path) for dest, path in keys.items() if "default" in settings.prop(path)}
    values.update(_settings_object(settings_json, "--settings", stage, dests))
    values.update(_settings_object(runtime_json, "--runtime-settings", stage, dests))
    for dest, value in values.items():
        values[dest] = _setting_value(stage, dest, value, dests[dest], keys.get(dest))
        dests[dest].required = False  # given by the settings or the schema
    parser.set_defaults(**values)


def check_options(args: argparse.Namespace, stage: str) -> None:
    """Options given on the command line obey the schema's types and bounds too (`--max-record-bytes -1`)."""
    for dest, path in setting_keys(stage, vars(args)).items():
        value, prop = getattr(args, dest), option_prop(stage, dest, path)
        if value is None or "enum" in prop:  # unset; enums are argparse choices, checked there
            continue
        if (why := settings.problem(value, prop)):
            raise PipelineError(f"{stage}: --{dest.replace('_', '-')} {value!r}: {why} (the config schema's {path})")


# a full disk, a quota, a read-only or forbidden output directory: the user's to fix, not a bug to trace
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG})


def disk_error(exc: OSError, args: argparse.Namespace) -> str:
    """One line for an OSError of the file system: the file (or the stage's outputs), the cause, what to do."""
    out = next((getattr(args, k) for k in ("out", "out_dir", "stats") if getattr(args, k, None)), None)
    out = " ".join(map(str, out)) if isinstance(out, list) else out
    where = exc.filename or f"writing its outputs ({out or '?'})"
    return (f"{args.stage}: {os.strerror(exc.errno)} ({errno.errorcode.get(exc.errno, exc.errno)}): {where}; "
            "outputs get their final names only when complete, so nothing half-written counts as done: make "
            "room or fix the permissions, then rerun")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`STAGE --help` shows each option's default: the schema's for a stage that takes a config section (they
    are the parser's defaults by then), else the option's own; options without a default (None, off) say nothing."""

    def _get_help_string(self, action):
        if not has_default(action):
            return action.help
        return super()._get_help_string(action)


def has_default(action: argparse.Action) -> bool:
    return not (action.default is None or action.default is False or action.default == ""
                or action.default is argparse.SUPPRESS)


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Options added without a help text still show their default in --help (argparse skips help-less ones)."""
    for action in parser._actions:
        if action.help is None and action.option_strings and has_default(action):
            action.help = "(default: %(default)s)"


def build_parser(wanted: str | None, argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for name, stage in STAGES.items():
        p = sub.add_parser(name, help=stage.help, description=stage.help, formatter_class=DefaultsHelpFormatter)
        if name != wanted:
            continue
        module = importlib.import_module(stage.module)  # only the module that will run
        getattr(module, stage.add_arguments)(p)
        p.add_argument("--settings", default=None, metavar="JSON",
                       help="the stage's settings as one JSON object (what the workflow passes)")
        p.add_argument("--runtime-settings", default=None, metavar="JSON",
                       help="settings that change how the stage runs, not its output (not rule params)")
        p.set_defaults(_run=getattr(module, stage.run))
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--settings", default=None)
        pre.add_argument("--runtime-settings", default=None)
        known, _ = pre.parse_known_args(argv[argv.index(name) + 1:])
        apply_settings(p, name, known.settings, known.runtime_settings)
        show_defaults(p)
    return parser


def stage_args(stage: str, argv: list[str]) -> argparse.Namespace:
    """A stage's options as its command line would parse them (schema defaults, then --settings, then `argv`)."""
    return build_parser(stage, [stage, *argv]).parse_args([stage, *argv])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    try:
        args = build_parser(wanted, argv).parse_args(argv)
        check_options(args, args.stage)
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args._run(args) or 0)
    except StoppedBySignal as exc:  # a checkpoint was written: the exit status of a job killed by that signal
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno not in DISK_ERRNOS:
            raise
        print(f"error: {disk_error(exc, args)}", file=sys.stderr)
        return 2
    except Exception as exc:
        # an S3 failure deep inside a stage (mirror, ranged read): one line, not a botocore traceback
        if not storage.is_botocore_error(exc):
            raise
        print(f"error: S3 request failed: {storage.redact_credentials(exc)}", file=sys.stderr)
        return 2


def console() -> None:
    """The `dflash-pipeline` command: main(), the exit handlers (logging, thread pools, temporary files), then an
    exit that skips the interpreter's native teardown, where a finished stage can still abort on a parquet thread
    pool destroyed while joinable (apache/arrow#34314: "terminate called without an active exception", exit 134;
    seen once in this suite, in calibrate-sample, after its output was written). An exception still exits as
    Python does."""
    import atexit

    rc = main()
    atexit._run_exitfuncs()  # noqa: SLF001 - what a normal exit runs first
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    console()
