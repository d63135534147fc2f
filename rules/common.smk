import json
import os
import sys

from dflash_pipeline.cluster.launch_torchrun import train_resources
from dflash_pipeline.demo.paths import demo_builds_target, demo_data_files, demo_target_files
from dflash_pipeline.generation.sglang_flags import version as sglang_flags_version
from dflash_pipeline.planning import preflight
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.hidden_states.group_stats import adopt_groups
from dflash_pipeline.target_import.gguf import IMPORTED_FILES
from dflash_pipeline.settings.config_paths import ConfigPaths
from dflash_pipeline.settings.job_groups import JobGroups, link_out
from dflash_pipeline.settings.rule_params import RuleParams, planned_values
from dflash_pipeline.settings.target_source import TargetSource
from dflash_pipeline.workflow_files import JsonFileCache, index_shards, storage_copy

R = config["results"]
DATASETS = ["source", "regenerated"]
ENV_CPU = "../envs/cpu.yaml"
ENV_GPU = "../envs/gpu.yaml"
GEN, EXTRACT, TRAIN, DRAFTER, EVAL = (config[k] for k in ("generate", "extract", "train", "drafter", "evaluate"))
CALIBRATE = GEN["calibrate"]
CALIBRATION = os.path.join(R, "calibration/generation.json")
CALIBRATION_SAMPLE = os.path.join(R, "calibration/sample.parquet")
GENERATION_GATE = os.path.join(R, "calibration/gate.ok")
RATES = os.path.join(R, "calibration/rates.json")

# A stage's job takes a group of shards_per_job consecutive shards of one file (settings/job_groups.py): shard
# and tokenize by ingest.shards_per_job, generate and extract by their own
SHARD_GROUPS = JobGroups("j", config["ingest"]["shards_per_job"])
GENERATION_GROUPS = JobGroups("g", GEN["shards_per_job"])
EXTRACTION_GROUPS = JobGroups("x", EXTRACT["shards_per_job"])

# The config's paths (settings/config_paths.py); their mistakes go to the preflight (the Snakefile's last lines)
PATHS = ConfigPaths(config)
RAW_INPUTS = PATHS.raw_inputs
EVAL_PROMPTS = PATHS.eval_prompts
EXCLUDE_PROMPTS = PATHS.exclude_prompts


def raw_input(wildcards):
    path = RAW_INPUTS[wildcards.src]
    if path.startswith("s3://"):
        return storage.s3(path)  # through the S3 storage plugin; local inputs are plain paths
    return path


# The target (settings/target_source.py): a transformers directory, the demo's (built by a rule at its own path
# only: demo/paths.py), or a GGUF file that rules/target.smk imports once into a directory under the results. A
# user's directory is tracked by its fingerprint, a param of every job that reads it.
TARGET = TargetSource(PATHS.target_source, PATHS.target_resolved, demo_builds_target(config))
TARGET_IDENTITY = TARGET.identity()
TOKENIZER_IDENTITY = TARGET.identity(weights=False)
TARGET_IMPORT_FILES = [os.path.join(R, "target", f) for f in IMPORTED_FILES]


def target_model_files():
    """Files that make the target model an input, so jobs wait for the job that builds them."""
    return TARGET.files(demo_target_files(), TARGET_IMPORT_FILES)


target_model_dir = TARGET.model_dir


_MANIFESTS = JsonFileCache(index_shards)


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


def generate_settings():
    """generate's and calibrate's --settings; a backend without what it needs stops the parse in one line."""
    try:
        return PARAMS.generate()
    except PipelineError as exc:
        raise WorkflowError(str(exc))


def log(name):
    return os.path.join(R, "logs", f"{name}.log")


# A group job writes its directory as {output}.partial and renames it at its end: a killed job (SIGKILL,
# no cleanup) leaves nothing that a rerun could take for complete. (Not `partial`: Snakemake's own name here.)
def partial_dir(wildcards, output):
    return output[0] + ".partial"


def partial_files(output, members, suffix):
    return [os.path.join(partial_dir(None, output), f"{m}{suffix}") for m in members]


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


def shard_group_specs(wildcards):
    """The manifest entries of a shard job's group, with their content digests: what decides the job (its param),
    so a changed shard in another group, or another file, rewrites nothing here."""
    by_shard = manifest()["_by_shard"]
    return [by_shard[s] for s in SHARD_GROUPS.members(wildcards.shardgroup, shard_ids())]


def shard_group_records(wildcards):
    """The ingested file a shard job cuts its group from. ancient(): the file is rewritten whenever any of its
    records changes; the group's manifest entries (its param) say whether this group did. (Safe from
    snakemake#4166: asked only once the manifest checkpoint, which runs after ingest, is done.)"""
    return ancient(os.path.join(R, f"ingest/files/{shard_group_specs(wildcards)[0]['src']}.parquet"))


def tokenize_group_inputs(wildcards):
    """A tokenize job's conversations: its group's ingested shards (source) or the target's completions."""
    folder = "ingest/shards" if wildcards.dataset == "source" else "completions"
    return [os.path.join(R, folder, f"{s}.parquet") for s in SHARD_GROUPS.members(wildcards.shardgroup, shard_ids())]


def shard_audits(wildcards):
    """Every shard's audit of one dataset."""
    return expand(os.path.join(R, "tokens/{dataset}/{shard}.audit.json"), dataset=wildcards.dataset, shard=shard_ids())


def gate_mode(dataset):
    # with regeneration on, the source audit gates prompts only: bad answers are about to be replaced
    return "prompts" if dataset == "source" and config["generate"]["enabled"] else "full"


# ------------------------------------------------------------------ generation

GEN_SETTINGS = generate_settings() if GEN["enabled"] else "{}"
GEN_ENV = ENV_GPU if GEN["backend"] == "sglang" else ENV_CPU
GEN_RESOURCES = dict(gpu=GEN["gpus"], runtime=GEN["runtime_min"], mem_mb=GEN["mem_mb"])


# ------------------------------------------------------------------ generation calibration


def calibration_shards():
    """The shards the calibration sample is drawn from (planning/calibration_sample.py, shards_to_draw)."""
    from dflash_pipeline.planning import calibration_sample  # pyarrow: only when asked

    with storage_copy(rules.calibration_sample.output[0]) as path:
        drawn = calibration_sample.drawn_from(path) if path else None
    return calibration_sample.shards_to_draw(drawn, calibration_sample.settings_of(GEN), shard_ids())


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
    from dflash_pipeline.planning.calibration_sample import sample_identity  # pyarrow: only when asked

    manifest()  # as calibration_sample_input asks: the same checkpoint pending first
    with storage_copy(checkpoints.calibration_sample.get().output[0]) as path:
        return sample_identity(path)


def plan_calibration():
    """The plan projects generation from the calibration when there is a generation."""
    return [CALIBRATION] if GEN["enabled"] else []


# ------------------------------------------------------------------ extraction and training


def plan_rates():
    """cost.calibrate_rates: the plan projects extraction and training from rates measured on the run's GPU."""
    return [RATES] if config["cost"].get("calibrate_rates") else []


def rates_token_files(wildcards):
    """The first cost.calibrate_rates_shards source token shards (by name): enough tokens to measure, and a raw
    file added later (sorted after them) recalibrates nothing."""
    shards = sorted(shard_ids())[: config["cost"]["calibrate_rates_shards"]]
    return expand(os.path.join(R, "tokens/source/{shard}.parquet"), shard=shards)


def train_inputs(wildcards):
    if TRAIN["mode"] == "offline":  # the extraction groups' directories (rules/extract.smk), in shard order
        return expand(os.path.join(R, "hidden/groups/{exgroup}"), exgroup=EXTRACTION_GROUPS.groups(shard_ids()))
    return expand(os.path.join(R, "tokens", training_dataset(), "{shard}.parquet"), shard=shard_ids())


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
        inputs["extraction"] = expand(
            os.path.join(R, "hidden/groups/{exgroup}.stats.json"), exgroup=EXTRACTION_GROUPS.groups(shard_ids())
        )
    return inputs


# ------------------------------------------------------------------ preflight (the rest: the Snakefile's end)


def backend_ready(wildcards):
    """An input function of `calibrate`, the first job that starts the generation backend: it runs when the DAG
    holds that job (a cost preview needs no sglang), before any job, and again inside the job on its node."""
    problems = preflight.generation_backend_problems(GEN, sys.argv[1:], os.environ, sglang_flags_version())
    if problems:
        raise WorkflowError(preflight.stop_message(problems))
    return []
