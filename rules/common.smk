import glob
import json
import os
import re
import shlex
import shutil
import sys

from snakemake.utils import validate

from dflash_pipeline import package_paths, settings
from dflash_pipeline.cluster.launch_torchrun import train_resources
from dflash_pipeline.generation.sglang_flags import version as sglang_flags_version
from dflash_pipeline.planning import preflight
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.target import fingerprint as target_fingerprint
from dflash_pipeline.target import is_gguf_path
from dflash_pipeline.target_import.gguf import IMPORTED_FILES
from dflash_pipeline.settings.rule_params import RuleParams
from dflash_pipeline.workflow_files import ManifestCache, storage_copy

# The schema ships with the package (one file states every default, for the workflow and a stage run by hand).
# A misspelled key is one line per mistake (Snakemake's own message prints the whole schema after it).
_CONFIG_PROBLEMS = preflight.schema_errors(config, settings.SCHEMA_PATH)
if _CONFIG_PROBLEMS:
    raise WorkflowError("\n".join(_CONFIG_PROBLEMS))
validate(config, str(settings.SCHEMA_PATH))  # fills in the schema's defaults

R = config["results"]
# Every rule calls a stage of the project's command, `dflash-pipeline`. When snakemake runs from a venv that is
# not on PATH, the jobs (local, or a snakemake re-run inside a cluster job) find it beside the interpreter.
if shutil.which("dflash-pipeline") is None:
    shell.prefix(f'export PATH={shlex.quote(os.path.dirname(sys.executable))}:"$PATH"; ')
DATASETS = ["source", "regenerated"]
ENV_CPU = "../envs/cpu.yaml"
ENV_GPU = "../envs/gpu.yaml"


def _source_name(path):
    name = os.path.basename(path.rstrip("/"))
    name = re.sub(r"(\.(json|jsonl|gz|zst))+$", "", name)
    return re.sub(r"[^A-Za-z0-9_.]+", "_", name) or "input"


# Mistakes in the config's paths found while reading it (a glob matching no file, a pkg:// package that is not
# installed): collected, not raised, so that the preflight reports them in one run with the target's and the
# resources' (run_preflight); a user fixes them all at once instead of one per dry run.
CONFIG_PATH_PROBLEMS = []


def _expand_inputs(patterns):
    """Config `inputs` (paths, globs, s3:// URIs) -> {source name: path}, names unique and stable."""
    paths = []
    for pattern in patterns:
        try:
            pattern = package_paths.resolve(pattern)  # pkg://PACKAGE/PATH: a file shipped in an installed package
        except PipelineError as exc:
            CONFIG_PATH_PROBLEMS.append(f"config inputs: {exc}")
            continue
        if pattern.startswith("s3://") or not glob.has_magic(pattern):
            paths.append(pattern)
        else:
            matched = sorted(glob.glob(pattern))
            if not matched:
                CONFIG_PATH_PROBLEMS.append(f"config inputs: glob {pattern!r} matches no file")
            paths.extend(matched)
    sources = {}
    for path in paths:
        name = base = _source_name(path)
        i = 1
        while name in sources:
            i += 1
            name = f"{base}_{i}"
        sources[name] = path
    return sources


RAW_INPUTS = _expand_inputs(config["inputs"])


def _package_path(key, path):
    try:
        return package_paths.resolve(path)
    except PipelineError as exc:
        CONFIG_PATH_PROBLEMS.append(f"config {key}: {exc}")
        return ""


# evaluation prompts (MT-Bench question.jsonl): evaluated beside the held-out split, and never trained on
EVAL_PROMPTS = _package_path("evaluate.prompts_file", config.get("evaluate", {}).get("prompts_file") or "") or None
EXCLUDE_PROMPTS = sorted(
    {
        q
        for q in (_package_path("ingest.exclude_prompts", p) for p in config["ingest"].get("exclude_prompts") or [])
        if q
    }
    | ({EVAL_PROMPTS} if EVAL_PROMPTS else set())
)


def raw_input(wildcards):
    path = RAW_INPUTS[wildcards.src]
    if path.startswith("s3://"):
        return storage.s3(path)  # through the S3 storage plugin; local inputs are plain paths
    return path


# The demo builds its raw files and its tiny target with rules, only at the demo's own paths: a
# target.model_path or an input elsewhere is the user's, read and never written, whatever demo.enabled says.
DEMO_DATA_DIR = "data/demo"
DEMO_TARGET_DIR = "resources/demo-target"
# every file `dflash-pipeline tiny-model` writes: all are declared, so under S3 storage the whole model
# directory travels to the jobs that need it (config.json first: target_model_dir() takes its directory)
DEMO_TARGET_FILES = [
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "demo_target.json",
]


def is_demo_path(path, demo_dir):
    """True for the demo's own relative path (or a path under it), never for a user's path."""
    norm = os.path.normpath(str(path))
    return not os.path.isabs(norm) and (norm == demo_dir or norm.startswith(demo_dir + os.sep))


DEMO_BUILDS_TARGET = config["demo"]["enabled"] and is_demo_path(config["target"]["model_path"], DEMO_TARGET_DIR)


def demo_target_files():
    """The tiny target's files: the demo rule's outputs, at the demo's own path only."""
    return [os.path.join(DEMO_TARGET_DIR, f) for f in DEMO_TARGET_FILES]


def demo_data_files():
    """The configured inputs that the demo builds (those at its own path only)."""
    return [path for path in RAW_INPUTS.values() if is_demo_path(path, DEMO_DATA_DIR)]


# The target: a transformers directory, or a GGUF file that rules/target.smk imports once into one (under the
# results) for every stage to read. `pkg://PACKAGE/PATH` names a file inside an installed Python package.
try:
    TARGET_SOURCE = package_paths.resolve(config["target"]["model_path"], must_exist=False)
    TARGET_RESOLVED = True
except PipelineError as exc:
    CONFIG_PATH_PROBLEMS.append(f"config target.model_path: {exc}")
    TARGET_SOURCE, TARGET_RESOLVED = config["target"]["model_path"], False
TARGET_IS_GGUF = is_gguf_path(TARGET_SOURCE) and not DEMO_BUILDS_TARGET
TARGET_IMPORT_DIR = os.path.join(R, "target")

# A user's model directory is no job's output, so no job's input: its identity (target.fingerprint: config, chat
# template and tokenizer files, the weight files' names, sizes and mtimes) is a param of every job that reads the
# target, so a target retrained or re-templated in place reruns exactly those jobs (tokenize and the plan only
# when what tokenization reads changed). The demo's target and an imported GGUF are outputs: mtimes do that.
TARGET_TRACKED = TARGET_RESOLVED and not DEMO_BUILDS_TARGET and not TARGET_IS_GGUF and os.path.isdir(TARGET_SOURCE)
TARGET_IDENTITY = target_fingerprint(TARGET_SOURCE) if TARGET_TRACKED else "a workflow output"
TOKENIZER_IDENTITY = target_fingerprint(TARGET_SOURCE, weights=False) if TARGET_TRACKED else "a workflow output"


def target_model_files():
    """Files that make the target model an input, so jobs wait for the job that builds them (the demo's own
    target, never a user's model directory; or the import of a GGUF target)."""
    if DEMO_BUILDS_TARGET:
        return demo_target_files()
    if TARGET_IS_GGUF:
        return [os.path.join(TARGET_IMPORT_DIR, f) for f in IMPORTED_FILES]
    return []


def target_model_dir(input_files):
    """The model directory as a job sees it (a storage-local copy when inputs come from S3)."""
    if DEMO_BUILDS_TARGET or TARGET_IS_GGUF:
        return os.path.dirname(str(input_files[0]))
    return TARGET_SOURCE


_MANIFESTS = ManifestCache()


def manifest():
    """The shard manifest (parsed once per version of the file: dflash_pipeline/workflow_files.py)."""
    return _MANIFESTS.get(checkpoints.manifest.get().output.manifest)


def shard_ids():
    return [s["shard"] for s in manifest()["shards"]]


def training_dataset():
    """Which token files feed extraction: the target's own regenerated responses, or the originals."""
    return "regenerated" if config["generate"]["enabled"] else "source"


# Every rule's settings (dflash_pipeline/settings/rule_params.py): the --settings JSON of each stage, its rule's
# one output-changing param, and the runtime settings passed through the environment.
PARAMS = RuleParams(config, R, getattr(workflow.storage_settings, "default_storage_prefix", None))
stage_settings = PARAMS.stage
TRUST = PARAMS.trust


def generate_settings():
    """generate's and calibrate's --settings; a backend without what it needs stops the parse in one line."""
    try:
        return PARAMS.generate()
    except PipelineError as exc:
        raise WorkflowError(str(exc))


calibration_settings = generate_settings
extract_settings = PARAMS.extract
train_settings = PARAMS.train
rates_settings = PARAMS.rates
PLAN_CONFIG = PARAMS.plan()


def log(name):
    return os.path.join(R, "logs", f"{name}.log")


def bench(name):
    return os.path.join(R, "benchmarks", f"{name}.tsv")


def final_output():
    """What the default target (`all`) builds: the source gate, the plan, the evaluation of the exported drafter
    (which needs the trained and exported drafter) and its gate, and the run's summary for `snakemake --report`.
    No directory output here: with S3 storage, the plugin (0.3.6) caches a directory's "is a directory" answer
    from before the job made it, and `all` then fails on "missing in storage" after a complete run."""
    return [
        os.path.join(R, "audit/source/gate.ok"),
        os.path.join(R, "plan.txt"),
        os.path.join(R, "evaluate/report.json"),
        os.path.join(R, "evaluate/gate.ok"),
        os.path.join(R, "report/summary.html"),
    ]


# ------------------------------------------------------------------ ingest, tokenize, audit


def shard_entry(wildcards):
    return manifest()["_by_shard"][wildcards.shard]


def shard_records(wildcards):
    """The ingested file a shard is cut from. ancient(): the file is rewritten whenever any of its records
    changes; the shard's manifest entry (its param, with a digest of its samples) says whether this shard did.
    (Safe from snakemake#4166: asked only once the manifest checkpoint, which runs after ingest, is done.)"""
    return ancient(os.path.join(R, f"ingest/files/{shard_entry(wildcards)['src']}.parquet"))


# ingest.shards_per_job > 1: shard and tokenize jobs take K consecutive shards of one file (a job group)
SHARDS_PER_JOB = config["ingest"]["shards_per_job"]


def shard_group_of(shard):
    src, k = shard.rsplit("-", 1)
    return f"{src}-j{int(k) // SHARDS_PER_JOB:05d}"


def shard_group_members(shardgroup):
    src = shardgroup.rsplit("-", 1)[0]
    return [s["shard"] for s in manifest()["shards"] if s["src"] == src and shard_group_of(s["shard"]) == shardgroup]


def shard_conversations(wildcards):
    """A shard's conversations: the ingested shard (source) or the target's completions (regenerated)."""
    if wildcards.dataset == "source":
        return os.path.join(R, f"ingest/shards/{wildcards.shard}.parquet")
    return os.path.join(R, f"completions/{wildcards.shard}.parquet")


def shard_audits(wildcards):
    """Every shard's audit of one dataset."""
    return expand(os.path.join(R, "tokens/{dataset}/{shard}.audit.json"), dataset=wildcards.dataset, shard=shard_ids())


def gate_mode(dataset):
    # with regeneration on, the source audit gates prompts only: bad answers are about to be replaced
    return "prompts" if dataset == "source" and config["generate"]["enabled"] else "full"


# ------------------------------------------------------------------ generation

GEN = config["generate"]


# set (not read) here, in every Snakemake process that parses the workflow, so the jobs it starts inherit them
os.environ.update(
    DFLASH_GENERATE_RUNTIME=json.dumps(PARAMS.generate_runtime(), sort_keys=True),
    DFLASH_TRAIN_RUNTIME=json.dumps(PARAMS.runtime("train"), sort_keys=True),
    DFLASH_EVALUATE_RUNTIME=json.dumps(PARAMS.runtime("evaluate"), sort_keys=True),
    # calibrate-rates reads the run's whole train settings from here, as the runtime settings are read
    DFLASH_RATES_TRAIN_SETTINGS=PARAMS.train(),
)


GEN_SETTINGS = generate_settings() if GEN["enabled"] else "{}"
GEN_ENV = ENV_GPU if GEN["backend"] == "sglang" else ENV_CPU
GEN_RESOURCES = dict(gpu=GEN["gpus"], runtime=GEN["runtime_min"], mem_mb=GEN["mem_mb"])


def generation_group_of(shard):
    src, k = shard.rsplit("-", 1)
    return f"{src}-g{int(k) // GEN['shards_per_job']:05d}"


def generation_group_members(gengroup):
    return [s for s in shard_ids() if generation_group_of(s) == gengroup]


# ------------------------------------------------------------------ generation calibration

CALIBRATE = GEN["calibrate"]
CALIBRATION = os.path.join(R, "calibration/generation.json")
CALIBRATION_SAMPLE = os.path.join(R, "calibration/sample.parquet")
GENERATION_GATE = os.path.join(R, "calibration/gate.ok")


def calibration_sample_settings():
    return {k: CALIBRATE[k] for k in ("samples", "warmup_requests", "seed")}


def calibration_shards():
    """The shards the calibration sample is drawn from: those of the sample already drawn while they all still
    exist and it met its size with the same settings (so added data keeps the sample and the calibration),
    else every shard."""
    from dflash_pipeline.planning.calibration_sample import drawn_from  # pyarrow: only when asked

    current = shard_ids()
    with storage_copy(rules.calibration_sample.output[0]) as path:
        drawn = drawn_from(path) if path else None
    if drawn and drawn["settings"] == calibration_sample_settings() and drawn["full"]:
        if set(drawn["shards"]) <= set(current):
            return drawn["shards"]
    return current


def calibration_token_files(wildcards):
    return expand(os.path.join(R, "tokens/source/{shard}.parquet"), shard=calibration_shards())


def calibration_shard_files(wildcards):
    return expand(os.path.join(R, "ingest/shards/{shard}.parquet"), shard=calibration_shards())


def calibration_sample_input(wildcards):
    # ancient: after its checkpoint has run, the sample's mtime says nothing; its digest (a param) decides.
    # The manifest first: the sample's checkpoint waits for it, and may then not run at all (settled())
    manifest()
    checkpoints.calibration_sample.get()
    return ancient(CALIBRATION_SAMPLE)


def calibration_sample_identity(wildcards):
    """Which prompts the sample holds: a new draw of the same prompts recalibrates nothing."""
    from dflash_pipeline.planning.calibration_sample import sample_identity

    manifest()  # as calibration_sample_input asks: the same checkpoint pending first
    with storage_copy(checkpoints.calibration_sample.get().output[0]) as path:
        return sample_identity(path)


def generation_limits():
    limits = {"--max-wall-hours": GEN.get("max_wall_hours"), "--max-gpu-hours": GEN.get("max_gpu_hours")}
    return " ".join(f"{flag} {value}" for flag, value in limits.items() if value is not None)


def plan_calibration():
    """The plan projects generation from the calibration when there is a generation."""
    return [CALIBRATION] if GEN["enabled"] else []


# ------------------------------------------------------------------ extraction and training

EXTRACT = config["extract"]


RATES = os.path.join(R, "calibration/rates.json")


def plan_rates():
    """cost.calibrate_rates: the plan projects extraction and training from rates measured on the run's GPU."""
    return [RATES] if config["cost"].get("calibrate_rates") else []


def rates_token_files(wildcards):
    """The first cost.calibrate_rates_shards source token shards (by name): enough tokens to measure, and a raw
    file added later (sorted after them) recalibrates nothing."""
    shards = sorted(shard_ids())[: config["cost"]["calibrate_rates_shards"]]
    return expand(os.path.join(R, "tokens/source/{shard}.parquet"), shard=shards)


def extraction_group_of(shard):
    """The extraction job of a shard: extract.shards_per_job consecutive shards of one source file."""
    src, k = shard.rsplit("-", 1)
    return f"{src}-x{int(k) // EXTRACT['shards_per_job']:05d}"


def extraction_group_members(exgroup):
    return [s for s in shard_ids() if extraction_group_of(s) == exgroup]


TRAIN = config["train"]
DRAFTER = config["drafter"]


def train_inputs(wildcards):
    if TRAIN["mode"] == "offline":
        return expand(os.path.join(R, "hidden/{shard}.dfhs"), shard=shard_ids())
    return expand(os.path.join(R, "tokens", training_dataset(), "{shard}.parquet"), shard=shard_ids())


EVAL = config["evaluate"]


# ------------------------------------------------------------------ report


def report_inputs(wildcards):
    inputs = {
        "verdicts": settled(wildcards),
        "train": os.path.join(R, "train/drafter"),
        "evaluate": os.path.join(R, "evaluate/report.json"),
        # the summary embeds the evaluation's acceptance curve (read beside the report; declared for S3 storage)
        "acceptance": os.path.join(R, "evaluate/acceptance.png"),
    }
    inputs["plan"] = os.path.join(R, "plan.json")
    if config["generate"]["enabled"]:
        inputs["generation"] = expand(os.path.join(R, "completions/{shard}.summary.json"), shard=shard_ids())
        inputs["calibration"] = CALIBRATION
    if config["train"]["mode"] == "offline":  # hidden-state shards exist only when training reads them
        inputs["extraction"] = expand(os.path.join(R, "hidden/{shard}.stats.json"), shard=shard_ids())
    return inputs


# ------------------------------------------------------------------ preflight


def backend_ready(wildcards):
    """An input function of `calibrate`, the first job that starts the generation backend: it runs when the DAG
    holds that job (a cost preview needs no sglang), before any job, and again inside the job on its node."""
    if preflight.executor_name(sys.argv[1:], os.environ) != "kubernetes":  # a pod runs the image's sglang
        problems = preflight.backend_problems(GEN, sglang_flags_version())
        if problems:
            raise WorkflowError("preflight: " + "\npreflight: ".join(problems))
    return []


def run_preflight():
    """Seconds of checks before any job (README: "Before the first run"; planning/preflight.py), every mistake
    in one run: the config's paths, the target, the inputs, the resources. Called by the Snakefile once every
    rule exists; jobs on a cluster (remote mode) were checked when they were submitted."""
    if workflow.remote_exec or workflow.subprocess_exec:
        return
    target = TARGET_SOURCE if not DEMO_BUILDS_TARGET and TARGET_RESOLVED else None  # pkg:// resolved
    problems = CONFIG_PATH_PROBLEMS + preflight.workflow_problems(
        workflow,
        config,
        results=R,
        inputs=RAW_INPUTS,
        built_inputs=set(demo_data_files()),
        target=target,
        argv=sys.argv[1:],
        env=os.environ,
        cwd=os.getcwd(),
    )
    if problems:
        raise WorkflowError("preflight: " + "\npreflight: ".join(problems))
