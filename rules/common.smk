import glob
import json
import os
import re
import shlex
import shutil
import sys

from snakemake.utils import validate


validate(config, "../config/schema.yaml")

R = config["results"]
# The project's command; every rule calls one of its stages. When snakemake runs from a venv that is
# not on PATH, use the command installed beside its interpreter.
PKG = "dflash-pipeline"
if shutil.which(PKG) is None and os.path.exists(os.path.join(os.path.dirname(sys.executable), PKG)):
    PKG = os.path.join(os.path.dirname(sys.executable), PKG)
PKG = shlex.quote(PKG)  # a venv under a path with spaces
DATASETS = ["source", "regenerated"]
ENV_CPU = "../envs/cpu.yaml"
ENV_GPU = "../envs/gpu.yaml"


wildcard_constraints:
    src=r"[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*?",
    shard=r"[A-Za-z0-9_.-]+-\d{5}",
    dataset="|".join(DATASETS),


def _source_name(path):
    name = os.path.basename(path.rstrip("/"))
    name = re.sub(r"(\.(json|jsonl|gz|zst))+$", "", name)
    return re.sub(r"[^A-Za-z0-9_.]+", "_", name) or "input"


def _expand_inputs(patterns):
    """Config `inputs` (paths, globs, s3:// URIs) -> {source name: path}, names unique and stable."""
    paths = []
    for pattern in patterns:
        if pattern.startswith("s3://") or not glob.has_magic(pattern):
            paths.append(pattern)
        else:
            matched = sorted(glob.glob(pattern))
            if not matched:
                raise WorkflowError(f"config inputs: glob {pattern!r} matches no file")
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


def raw_input(wildcards):
    path = RAW_INPUTS[wildcards.src]
    # s3:// inputs go through the S3 storage plugin; local ones are plain paths
    return storage.s3(path) if path.startswith("s3://") else path


# every file `dflash-pipeline tiny-model` writes: all are declared, so under S3 storage the whole model
# directory travels to the jobs that need it (config.json first: target_model_dir() takes its directory)
DEMO_TARGET_FILES = ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", "chat_template.jinja", "demo_target.json"]


def target_model_files():
    """Files that make the target model an input, so demo jobs wait for the rule that builds it."""
    if config["demo"]["enabled"]:
        return [os.path.join(config["target"]["model_path"], f) for f in DEMO_TARGET_FILES]
    return []


def target_model_dir(input_files):
    """The model directory as a job sees it (a storage-local copy when inputs come from S3)."""
    if config["demo"]["enabled"]:
        return os.path.dirname(str(input_files[0]))
    return config["target"]["model_path"]


_MANIFEST_CACHE = {}


def manifest():
    """The shard manifest, parsed once per version of the file (input functions call this per job:
    re-parsing it for each of thousands of shards would dominate the planning time)."""
    out = checkpoints.manifest.get().output.manifest
    local = out.storage_object.local_path() if getattr(out, "storage_object", None) else str(out)
    try:
        st = os.stat(local)
        key = (str(out), st.st_mtime_ns, st.st_size)
    except OSError:
        key = None
    if key is None or key not in _MANIFEST_CACHE:
        with out.open() as fh:
            data = json.load(fh)
        data["_by_shard"] = {s["shard"]: s for s in data["shards"]}
        if key is None:
            return data
        _MANIFEST_CACHE.clear()
        _MANIFEST_CACHE[key] = data
    return _MANIFEST_CACHE[key]


def shard_ids():
    return [s["shard"] for s in manifest()["shards"]]


def training_dataset():
    """Which token files feed extraction: the target's own regenerated responses, or the originals."""
    return "regenerated" if config["generate"]["enabled"] else "source"


# Keys that size a job rather than change its output: kept out of the settings (and out of params), so that
# moving a run to more GPUs or memory reruns nothing.
RESOURCE_KEYS = frozenset({"gpus", "nodes", "mem_mb", "runtime_min"})


def stage_settings(section, keys=None, drop=(), **extra):
    """A config section as the one `--settings` JSON its stage takes, and the rule's one output-changing param:
    `keys` picks keys (default: all but resources and `drop`), `extra` adds or renames."""
    values = config[section] if section else {}
    wanted = keys if keys is not None else [k for k in values if k not in RESOURCE_KEYS and k not in drop]
    settings = {k: values[k] for k in wanted if k in values}
    settings.update(extra)
    return json.dumps(settings, sort_keys=True, default=str)


# only stated when on, so that every stage that loads the target must understand it (an unknown setting is an error)
TRUST = {"trust_remote_code": True} if config["target"].get("trust_remote_code") else {}


def log(name):
    return os.path.join(R, "logs", name + ".log")


def bench(name):
    return os.path.join(R, "benchmarks", name + ".tsv")


_FINAL_TARGETS = []


def add_final_target(fn):
    """Stages register what `rule all` must build; called once per included rule file."""
    _FINAL_TARGETS.append(fn)


def final_targets():
    return lambda wildcards: [path for fn in _FINAL_TARGETS for path in fn()]
