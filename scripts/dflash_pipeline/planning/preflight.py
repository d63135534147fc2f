"""Checks that run in seconds when Snakemake builds the DAG, before any job: each mistake a user makes going from
the demo to their own model, data and cluster becomes one line naming what is wrong and how to fix it, instead of
a failure after hours of CPU stages or on a GPU node.

Pure functions of plain values (paths, dicts, the command line): the `Snakefile` and `rules/common.smk` hand them the config and
what Snakemake knows (the profile's resources, the storage settings) and stops the run with their lines.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path

import yaml

from dflash_pipeline import settings
from dflash_pipeline.settings.train_combinations import train_problems
from dflash_pipeline.storage import not_regular_file

# the rules that ask for GPUs, and the config section that says how much each needs (the config owns the GPU
# count, runtime and memory of a job; a profile says where it runs)
GPU_RULES = {"calibrate": "generate", "generate": "generate", "extract": "extract", "train": "train",
             "evaluate": "evaluate"}
# Snakemake resource -> config key of the section
CONFIG_OWNED = {"gpu": "gpus", "runtime": "runtime_min", "mem_mb": "mem_mb"}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def config_error_line(error) -> str:
    """A jsonschema ValidationError as one line: where, what, and the closest known key for a misspelling."""
    where = ".".join(str(p) for p in error.absolute_path) or "top level"
    line = f"config ({where}): {error.message}"
    if error.validator == "additionalProperties":
        known = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(known)) if isinstance(error.instance, dict) else []
        hints = [f"{k!r} -> {m[0]!r}" for k in extra for m in [difflib.get_close_matches(k, known, n=1)] if m]
        line += f"; did you mean {', '.join(hints)}?" if hints else f"; known keys: {', '.join(known)}"
    return line


def schema_errors(config: dict, schema_path: str | Path) -> list[str]:
    """Every schema violation of the merged config, one line each (jsonschema's own text prints the schema)."""
    import jsonschema

    schema = yaml.safe_load(Path(schema_path).read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path)))
    return [config_error_line(e) for e in errors]


def has_chat_template(model: Path) -> bool:
    if (model / "chat_template.jinja").exists() or (model / "chat_template.json").exists():
        return True
    cfg = model / "tokenizer_config.json"
    if cfg.exists():
        try:
            return bool(json.loads(cfg.read_text()).get("chat_template"))
        except (OSError, ValueError, AttributeError):
            return False
    return False


def _nearby(missing: Path) -> str:
    """What exists near a missing path: similarly named directories beside it, or the deepest existing parent
    (never the missing path itself as an example)."""
    parent = missing.parent
    while not parent.is_dir() and parent != parent.parent:
        parent = parent.parent
    if parent != missing.parent:
        return f" (nor is {missing.parent}; the deepest directory that exists is {parent})"
    try:
        dirs = sorted(p.name for p in parent.iterdir() if p.is_dir())
    except OSError:
        return ""
    close = difflib.get_close_matches(missing.name, dirs, n=3, cutoff=0.6)
    return f" (similar names in {parent}: {', '.join(close)})" if close else ""


def target_problems(model_path: str) -> list[str]:
    """The target directory has what every stage loads: config, weights, tokenizer, chat template."""
    model = Path(model_path)
    if model.suffix == ".gguf":  # imported into a transformers directory by the target_import rule
        if not model.is_file():
            return [f"target.model_path {model_path}: no such GGUF file"]
        if importlib.util.find_spec("gguf") is None:
            return [f"target.model_path {model_path}: a GGUF target needs the `gguf` package: pip install -e '.[gguf]'"]
        return []
    if not model.is_dir():
        return [f"target.model_path {model_path}: no such directory{_nearby(model)}; set target.model_path (in your "
                "config file, or --config target.model_path=DIR) to the directory that holds the model: config.json, "
                "weights, tokenizer, chat template"]
    names = {p.name for p in model.iterdir()}
    missing = []
    if "config.json" not in names:
        missing.append("config.json")
    if not any(n.endswith(WEIGHT_SUFFIXES) or n.endswith(".index.json") for n in names):
        missing.append("the weights (*.safetensors)")
    if not names & set(TOKENIZER_FILES):
        missing.append(f"the tokenizer ({' or '.join(TOKENIZER_FILES[:2])})")
    if not has_chat_template(model):
        missing.append("a chat template (chat_template.jinja, or chat_template in tokenizer_config.json)")
    if not missing:
        return []
    return [f"target.model_path {model_path}: missing {', '.join(missing)}; copy the complete model directory "
            "(as downloaded from the hub) there"]


def backend_problems(generate: dict, supported_sglang: str) -> list[str]:
    """The generation backend can start here: sglang importable at the version its flags were checked against."""
    if not generate.get("enabled") or generate.get("backend") != "sglang":
        return []
    if (generate.get("sglang") or {}).get("launch_command"):
        return []  # the user's own launch command (a container, another environment): nothing to import here
    fix = "install it on the GPU nodes with `pip install -e .[sglang]`, or set generate.backend: servers"
    if importlib.util.find_spec("sglang") is None:
        return [f"generate.backend is sglang but sglang is not installed in this environment; {fix}"]
    try:
        installed = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        installed = "unknown"
    if installed != supported_sglang:
        return [f"generate.backend is sglang but sglang {installed} is installed; the launch flags are checked "
                f"against {supported_sglang}: `pip install -e .[sglang]` installs it"]
    return []


def input_problems(inputs: dict[str, str], built: set[str], remote_storage: str | None,
                   results: str | None = None) -> list[str]:
    """Every configured input is reachable by the jobs: with a default storage provider (Kubernetes) an input must
    be on that storage; otherwise a local file must exist. Inputs that a rule builds (the demo's) are fine. No
    input lies under `results`: a glob that matches the run's own outputs (its generation journals) would
    ingest them as new samples on every run."""
    problems = []
    outputs = os.path.realpath(results) if results and not results.startswith("s3://") else None
    for path in inputs.values():
        if outputs and not path.startswith("s3://") and _is_under(os.path.realpath(path), outputs):
            problems.append(f"config inputs: {path} is under the results directory {results}: the pipeline would "
                            "ingest its own outputs; narrow the glob or move the results (config results)")
            continue
        if path in built or path.startswith("s3://"):
            continue
        if remote_storage:
            problems.append(f"config inputs: {path} is a local file, but the jobs read every file from the default "
                            f"storage ({remote_storage}); upload it and list its s3:// URI in inputs")
        elif not os.path.exists(path):
            problems.append(f"config inputs: {path}: no such file; fix the path (globs are allowed) in inputs")
        elif not_regular_file(path):
            problems.append(f"config inputs: {path}: {not_regular_file(path)}")
    return problems


RESULTS_OWNER = ".dflash-owner.json"


def results_owner_problem(results: str, workdir: str, claim: bool) -> str | None:
    """A results directory belongs to the working directory that first ran into it: Snakemake's records of what
    it built (and from which settings) live in that working directory's .snakemake/, so a second working
    directory sharing the results would mix shards of two configurations and see "Nothing to be done". The
    owner is written on a real run (`claim`); a run from another working directory is refused."""
    path = os.path.join(results, RESULTS_OWNER)
    # relative to the results: a run directory copied whole (results inside it) still owns its copy
    here = os.path.relpath(os.path.realpath(workdir), os.path.realpath(results))
    try:
        with open(path, encoding="utf-8") as fh:
            owner = json.load(fh).get("workdir_from_results")
    except FileNotFoundError:
        owner = None
    except (OSError, ValueError, AttributeError) as exc:
        return f"results {results}: unreadable {RESULTS_OWNER} ({exc}); delete it if this directory is yours"
    if owner and owner != here:
        owner = os.path.normpath(os.path.join(os.path.realpath(results), owner))
        return (f"results {results} belongs to the runs from {owner} (their Snakemake records are there, and its "
                f"settings may differ): set another `results:` for this working directory, run from {owner}, or "
                f"delete {results} to start it over from here")
    if owner is None and claim:
        os.makedirs(results, exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"workdir_from_results": here}, fh)
    return None


def _is_under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def resource_problems(rules: dict[str, dict], overrides: dict[str, dict], config: dict, executor: str,
                      profile: str = "the profile") -> list[str]:
    """GPU rules have what `executor` needs to place them, and no set-resources entry silently replaces what the
    config says a job needs. `rules`: {rule: its resources as Snakemake resolved them}; `overrides`: the profile's
    (and command line's) set-resources."""
    problems = []
    for rule, section in GPU_RULES.items():
        if rule not in rules:
            continue
        res, given = rules[rule], overrides.get(rule, {})
        for name, key in CONFIG_OWNED.items():
            want = config[section].get(key)
            if name in given and want is not None and given[name] != want:
                problems.append(f"{profile}: set-resources {rule}: {name}={given[name]} overrides config "
                                f"{section}.{key}={want}; remove it there (the config says how much a job needs, "
                                f"the profile where it runs) or change {section}.{key}")
        if not (res.get("gpu") or res.get("gres")):
            continue  # a CPU run of this stage: placed like any CPU job
        needed = {"slurm": ("slurm_partition", "gpu_model"), "kubernetes": ("gpu_manufacturer",)}.get(executor, ())
        if rule == "train":  # several nodes take a per-node GRES, which a gpu_model would contradict (the
            needed = tuple(n for n in needed if n != "gpu_model")  # profile picks the type by partition/constraint)
        for name in needed:  # from set-resources: default-resources place the CPU jobs (slurm_partition: cpu)
            if name not in given:
                problems.append(f"{profile}: GPU rule {rule} has no {name} in set-resources: add `{rule}: {{{name}: "
                                f"...}}` there (as the shipped profile does for every GPU rule)")
    return problems


def _flag_value(argv: list[str], *names: str) -> str | None:
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "=") and name.startswith("--"):
                return arg.split("=", 1)[1]
    return None


def profile_dir(argv: list[str], env: dict) -> Path | None:
    """The profile directory Snakemake uses (--profile, else $SNAKEMAKE_PROFILE), searched as Snakemake does."""
    name = _flag_value(argv, "--profile") or env.get("SNAKEMAKE_PROFILE")
    if not name:
        return None
    if Path(name).is_dir():
        return Path(name)
    home = Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    for base in (home / "snakemake", Path("/etc/xdg/snakemake")):
        if (base / name).is_dir():
            return base / name
    return None


def executor_name(argv: list[str], env: dict) -> str:
    """The executor of this invocation: --executor/-e, else the profile's `executor:`, else local. Snakemake
    decides it after reading the Snakefile, so the command line is the one place to learn it from."""
    name = _flag_value(argv, "--executor", "-e")
    if name:
        return name
    profile = profile_dir(argv, env)
    if profile is not None:
        for fname in ("config.v8+.yaml", "config.yaml"):
            if (profile / fname).exists():
                return str((yaml.safe_load((profile / fname).read_text()) or {}).get("executor") or "local")
    return "local"


def known_resources(resources) -> dict:
    """{name: value} of Snakemake resources before a job exists (one computed per job, or given as an
    expression on the command line or in a profile, by its text)."""
    return {name: res.raw if res.is_evaluable() else res.value for name, res in resources.items()}


def before_first_job(workflow, config: dict, *, path_problems: list[str], **known) -> list[str]:
    """Every mistake in one run, before any job: the config's paths (`path_problems`, settings/config_paths.py),
    then workflow_problems (`known`: its keywords). The Snakefile calls it once every rule exists. Nothing in a
    job on a cluster (remote mode) or a job's subprocess: the invocation that submitted it was checked."""
    if workflow.remote_exec or workflow.subprocess_exec:
        return []
    return list(path_problems) + workflow_problems(workflow, config, **known)


def generation_backend_problems(generate: dict, argv: list[str], env: dict, supported_sglang: str) -> list[str]:
    """backend_problems where this invocation runs the backend: not for a pod, which runs its image's sglang."""
    return [] if executor_name(argv, env) == "kubernetes" else backend_problems(generate, supported_sglang)


def stop_message(problems: list[str]) -> str:
    return "preflight: " + "\npreflight: ".join(problems)


def workflow_problems(workflow, config: dict, *, results: str, inputs: dict[str, str], built_inputs: set[str],
                      target: str | None, argv: list[str], env: dict, cwd: str) -> list[str]:
    """The workflow's checks before any job: train settings that cannot go together, the target directory
    (`target`: None when the workflow builds it or its path did not resolve), the inputs' reachability, the
    results directory's owner and every rule's resources on this invocation's executor (before_first_job)."""
    from snakemake.resources import Resources

    executor = executor_name(argv, env)
    storage = workflow.storage_settings
    train = config.get("train")
    problems = train_problems(settings.value(train, "train.mode"), settings.value(train, "train.labels"))
    if target is not None and executor != "kubernetes":  # a pod's model lives in its image
        problems += target_problems(target)
    remote = f"{storage.default_storage_provider} {storage.default_storage_prefix or ''}" \
        if storage.default_storage_provider else None
    problems += input_problems(inputs, built_inputs, remote, results=results)
    if not storage.default_storage_provider:  # a results directory belongs to one working directory
        problems += [p for p in [results_owner_problem(results, cwd, claim=not workflow.dryrun)] if p]
    rules_resources = {r.name: known_resources(r.resources) for r in workflow.rules}
    overrides = {name: known_resources(Resources.from_mapping(m))
                 for name, m in workflow.resource_settings.overwrite_resources.items()}
    return problems + resource_problems(rules_resources, overrides, config, executor, f"executor {executor}")
