"""What each rule passes its stage: the `--settings` JSON (the rule's one output-changing param) and the runtime
settings (how a job runs, never what it writes: passed through the environment, so changing one reruns nothing).
Built from the validated config (schema defaults filled in) by rules/common.smk; tested without a workflow
(tests/test_rule_params.py)."""

from __future__ import annotations

import json

from dflash_pipeline import settings
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.settings.added_later import at_default

# Keys that size a job rather than change its output: kept out of the settings (and out of params), so that
# moving a run to more GPUs or memory reruns nothing.
RESOURCE_KEYS = frozenset({"gpus", "nodes", "mem_mb", "runtime_min"})
# how train and evaluate run, not what they write: not params either (runtime). Evaluation's batch and CUDA
# graphs change how many prompts decode at once, not the tokens (tests/test_batched_decoding.py)
RUNTIME_ONLY = {"train": ("cpu_threads",), "evaluate": ("cpu_threads", "batch_size", "eager")}
# generate's settings that decide the answers (sampling, backend, turn and length policies)
GENERATE_KEYS = ("backend", "api", "max_in_flight", "max_new_tokens", "temperature", "top_p", "top_k", "seed",
                 "enable_thinking", "turns", "max_turns", "on_length", "length_retry_max_new_tokens", "model_name")
# the hf backend's settings that decide the answers (not threads: how fast, not what)
HF_KEYS = ("batch_size", "device", "dtype", "context_length", "max_batch_tokens", "cache", "engine", "slot_width")
# generate's operational knobs: option name -> config key
GENERATE_RUNTIME = {"max_retries": "max_retries", "empty_retries": "empty_retries", "retry_failed": "retry_failed",
                    "flush_every": "journal_flush_every", "progress_interval": "progress_interval_s",
                    "request_timeout": "request_timeout_s", "all_down_timeout": "all_down_timeout_s"}
# what the plan and the preview read of each section (planning/plan.py, projection.py), and only that: a
# learning rate, a progress interval or a timeout changes no projection, so it reruns no plan (nor the
# generation gate behind it)
PLAN_KEYS = {
    "generate": ("enabled", "max_new_tokens", "parallel_jobs", "gpus", "shards_per_job", "assumed"),
    "tokenize": ("max_length",),
    "extract": ("codec", "assumed_tokens_per_s", "warn_bytes", "warn_shard_bytes", "shards_per_job", "compile"),
    "drafter": ("num_layers", "target_layer_ids", "mask_token_id"),
    "train": ("epochs", "mode", "num_anchors", "max_length"),
    "cost": ("gpu_hour_usd",),
    # what decides the evaluation's work (its batch size, runtime-only, reaches the plan through the environment)
    "evaluate": ("holdout_fraction", "prompts_file", "num_prompts", "max_new_tokens", "temperatures", "speedup_prompts"),
}
# What decides training's speed, not its outcome: calibrate-rates' params (a new learning rate measures nothing
# again).
TRAIN_RATE_KEYS = ("mode", "num_anchors", "max_length", "batch_size", "grad_accum", "attention", "compile",
                   "head_chunk", "layout", "num_layers", "block_size", "target_layer_ids")


def planned_values(plan: dict) -> dict:
    """What the plan resolved once for every later stage: the target's layer ids the drafter reads, and the mask
    token (absent when the plan could not decide it: training then says why)."""
    values = {"target_layer_ids": [int(i) for i in plan["target_layer_ids"]]}
    mask = (plan.get("mask_token") or {}).get("id")
    if mask is not None:
        values["mask_token_id"] = int(mask)
    return values


class RuleParams:
    """The settings of every rule, from one validated config. `storage_prefix`: Snakemake's default storage
    prefix (s3://... when outputs live on S3: journals and checkpoints are mirrored beside them)."""

    def __init__(self, config: dict, results: str, storage_prefix: str | None = None):
        self.config, self.results, self.prefix = config, results, str(storage_prefix or "")
        # only stated when on, so that every stage that loads the target must understand it (an unknown
        # setting is an error)
        self.trust = {"trust_remote_code": True} if config["target"].get("trust_remote_code") else {}

    def stage(self, section, keys=None, drop=(), **extra) -> str:
        """A config section as the one `--settings` JSON its stage takes: `keys` picks keys (default: all but
        resources, runtime-only knobs and `drop`), `extra` adds or renames."""
        values = self.config[section] if section else {}
        skip = RESOURCE_KEYS.union(RUNTIME_ONLY.get(section, ()), drop)
        wanted = keys if keys is not None else [k for k in values if k not in skip]
        settings = {k: values[k] for k in wanted if k in values}
        settings.update(extra)
        return json.dumps(settings, sort_keys=True, default=str)

    def _set_for_all_turns(self, path: str) -> bool:
        """A multi-turn setting that can change outputs: `generate.turns: all` (with `first` a conversation has one
        generated turn) and a value other than the schema's default."""
        section, key = path.split(".")
        return (self.config["generate"].get("turns") == "all"
                and self.config[section].get(key) != settings.default(path))

    def tokenize(self, dataset: str) -> str:
        """tokenize's --settings for a dataset (`source`: the ingested shards; else the regenerated completions).
        `turn_samples` only where it can change the samples: the completions of `generate.turns: all` (the source
        has no generated turns, `turns: first` one per conversation), and only when it is not the schema's default
        (the params of configs that never set it stay as they were)."""
        every = dataset != "source" and self._set_for_all_turns("tokenize.turn_samples")
        drop = () if every else ("turn_samples",)
        return self.stage("tokenize", drop=drop, trivial_tokens=self.config["audit"]["trivial_response_tokens"],
                          **self.trust)

    def _mirror(self, configured: str, under: str) -> str:
        """A configured mirror, else (outputs on S3) a prefix beside the outputs, so a job restarted on another
        machine resumes instead of starting over."""
        if not configured and self.prefix.startswith("s3://"):
            return f"{self.prefix.rstrip('/')}/{self.results}/{under}"
        return configured or ""

    def generation_backend(self) -> dict:
        """The backend's own settings for `generate` and `calibrate` (hf in-process, or sglang); the endpoints
        of backend `servers` are operational (generate_runtime)."""
        gen = self.config["generate"]
        if gen["backend"] == "hf":
            hf = gen.get("hf") or {}
            return {k: hf[k] for k in HF_KEYS if hf.get(k) not in (None, "")}
        if gen["backend"] == "servers":
            if not gen["servers"]:
                raise PipelineError("generate.backend is 'servers' but generate.servers lists no endpoint")
            return {}
        if gen["gpus"] < 1:
            raise PipelineError("generate.backend is 'sglang' but generate.gpus is 0: give each job its GPUs "
                                "(tp_size x dp_size x instances)")
        # an unset tool_call_parser is left out: the params (and outputs) of configs without it stay as they were
        sglang = {k: v for k, v in (gen.get("sglang") or {}).items() if k != "tool_call_parser" or v}
        return {"sglang_json": json.dumps(sglang, sort_keys=True)}

    def generate(self) -> str:
        """generate's and calibrate's --settings (calibrate measures what generate will do): not the resources,
        the calibration, the gate's limits, nor the operational knobs."""
        # max_turns only when it can cut: the params of configs without it stay as they were
        keys = [k for k in GENERATE_KEYS if k != "max_turns" or self._set_for_all_turns("generate.max_turns")]
        return self.stage("generate", keys=keys, **self.generation_backend(), **self.trust)

    def generate_runtime(self) -> dict:
        """Knobs that change how a generation job runs, never what it writes (progress, timeouts, retries,
        journal flushing and mirror, the running servers, the hf backend's CPU threads)."""
        gen = self.config["generate"]
        runtime = {option: gen[key] for option, key in GENERATE_RUNTIME.items() if gen.get(key) is not None}
        runtime["journal_mirror"] = self._mirror(gen.get("journal_mirror"), "completions/journal")
        threads = (gen.get("hf") or {}).get("threads")
        if gen["backend"] == "hf" and threads:
            runtime["threads"] = threads
        if gen["backend"] == "servers":
            runtime["servers"] = gen["servers"]
        return runtime

    def runtime(self, section: str) -> dict:
        return {k: self.config[section][k] for k in RUNTIME_ONLY[section] if self.config[section].get(k) is not None}

    def job_environment(self) -> dict[str, str]:
        """The runtime settings as environment variables: set in every Snakemake process that parses the
        workflow, so the jobs it starts inherit them (and they are no param: changing one reruns nothing).
        calibrate-rates reads the run's whole train settings the same way."""
        return {"DFLASH_GENERATE_RUNTIME": json.dumps(self.generate_runtime(), sort_keys=True),
                "DFLASH_TRAIN_RUNTIME": json.dumps(self.runtime("train"), sort_keys=True),
                "DFLASH_EVALUATE_RUNTIME": json.dumps(self.runtime("evaluate"), sort_keys=True),
                "DFLASH_RATES_TRAIN_SETTINGS": self.train()}

    def generation_limits(self) -> str:
        """calibrate's (and the generation gate's) --max-wall-hours/--max-gpu-hours, those the config sets."""
        gen = self.config["generate"]
        limits = {"--max-wall-hours": gen.get("max_wall_hours"), "--max-gpu-hours": gen.get("max_gpu_hours")}
        return " ".join(f"{flag} {value}" for flag, value in limits.items() if value is not None)

    def extract(self, planned: dict | None = None) -> str:
        """The extract rule's --settings (calibrate-rates measures with the same). encode_threads is the rule's
        threads (how many threads write it changes no byte); shards_per_job is the group (its members are the
        inputs). `planned`: the plan's resolved values (planned_values): the layer ids the plan
        resolved replace the drafter section the stage would resolve them from; calibrate-rates, which runs
        before the plan, resolves them the same way (target_layers.py)."""
        d = self.config["drafter"]
        layers = ({"target_layer_ids": planned["target_layer_ids"]} if planned
                  else {k: d[k] for k in ("num_layers", "target_layer_ids") if d.get(k) is not None})
        return self.stage("extract", drop=("assumed_tokens_per_s", "warn_bytes", "warn_shard_bytes", "encode_threads",
                                           "shards_per_job"), **layers, **self.trust)

    def train(self, planned: dict | None = None) -> str:
        """train: (minus resources) + the drafter's shape + the evaluation holdout, as one JSON; `planned`: the
        plan's layer ids and mask token in place of the config's (None there: resolved by the stage)."""
        d = {**self.config["drafter"], **(planned or {})}
        drafter = {k: d[k] for k in ("num_layers", "block_size", "mask_token_id", "target_layer_ids")
                   if d.get(k) is not None}
        mirror = self._mirror(self.config["train"].get("checkpoint_mirror"), "train/checkpoints")
        # settings added later only when set: the params of configs without them stay as they were
        return self.stage("train", drop=("checkpoint_mirror", *at_default(self.config["train"])), **drafter,
                          checkpoint_mirror=mirror,
                          holdout_fraction=self.config["evaluate"]["holdout_fraction"], **self.trust)

    def rates(self) -> str:
        """calibrate-rates' one param: the extract settings, the speed-deciding train settings and its own."""
        train, cost = json.loads(self.train()), self.config["cost"]
        return json.dumps({"extract": json.loads(self.extract()),
                           "shards_per_job": self.config["extract"]["shards_per_job"],
                           "train": {k: train.get(k) for k in TRAIN_RATE_KEYS},
                           "tokens": cost["calibrate_rates_tokens"],
                           "train_steps": cost["calibrate_rates_train_steps"]}, sort_keys=True)

    def plan(self) -> str:
        """What the plan and the cost preview read of the config (PLAN_KEYS)."""
        return json.dumps({name: {k: (self.config.get(name) or {}).get(k) for k in keys}
                           for name, keys in PLAN_KEYS.items()}, sort_keys=True, default=str)
