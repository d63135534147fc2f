# Train the DFlash drafter (GPU-tagged; DDP over the GPUs of a node and over nodes) and export it in the
# layout SGLang and vLLM load. Offline mode reads the extracted hidden-state shards; online mode reads the
# token shards and runs the target beside the drafter (no hidden states on disk).

from dflash_pipeline.cluster.launch_torchrun import train_resources

TRAIN = config["train"]
DRAFTER = config["drafter"]


def _train_inputs(wildcards):
    if TRAIN["mode"] == "offline":
        return expand(os.path.join(R, "hidden/{shard}.dfhs"), shard=shard_ids())
    dataset = training_dataset()
    return expand(os.path.join(R, "tokens", dataset, "{shard}.parquet"), shard=shard_ids()) + [
        os.path.join(R, "audit", dataset, "gate.ok")
    ]


def _train_settings():
    """train: (minus resources) + the drafter's shape + the evaluation holdout, as one JSON."""
    drafter = {k: DRAFTER[k] for k in ("num_layers", "block_size", "mask_token_id") if DRAFTER.get(k) is not None}
    if DRAFTER.get("target_layer_ids"):
        drafter["target_layer_ids"] = ",".join(str(i) for i in DRAFTER["target_layer_ids"])
    # checkpoints are not an output: on S3 storage (Kubernetes, no shared disk) mirror them, so a job that
    # restarts on another machine resumes instead of starting over
    mirror = TRAIN.get("checkpoint_mirror") or ""
    prefix = str(getattr(workflow.storage_settings, "default_storage_prefix", None) or "")
    if not mirror and prefix.startswith("s3://"):
        mirror = f"{prefix.rstrip('/')}/{R}/train/checkpoints"
    return stage_settings("train", drop=("checkpoint_mirror",), **drafter, checkpoint_mirror=mirror,
                          holdout_fraction=config["evaluate"]["holdout_fraction"], **TRUST)


# GPUs are resources, not params: a run moved to more GPUs or nodes resumes its checkpoints instead of rerunning
TRAIN_GPUS, TRAIN_NPROC, TRAIN_NODES = TRAIN["gpus"], max(1, TRAIN["gpus"]), TRAIN["nodes"]


rule train:
    input:
        data=_train_inputs,
        model=target_model_files(),
    output:
        directory(os.path.join(R, "train/drafter")),
    params:
        model=lambda wc, input: target_model_dir(input.model),
        data=lambda wc, input: [p for p in input.data if not str(p).endswith("gate.ok")],
        checkpoints=os.path.join(R, "train/checkpoints"),  # not an output: survives a failed job for resume
        settings=_train_settings(),
    resources:
        # one node: gpu=N; several (SLURM): a per-node GRES, one task per node, mpi (see launch_torchrun)
        **train_resources(TRAIN["nodes"], TRAIN["gpus"]),
    log:
        log("train"),
    benchmark:
        bench("train")
    conda:
        ENV_GPU
    shell:
        "{PKG} with-gpus --n {TRAIN_GPUS} -- "
        "{PKG} launch-torchrun --nproc-per-node {TRAIN_NPROC} --nnodes {TRAIN_NODES} -- "
        "{PKG} train --inputs {params.data:q} --model {params.model:q} --out {output:q} "
        "--checkpoint-dir {params.checkpoints:q} --settings {params.settings:q} > {log:q} 2>&1"


rule export:
    input:
        drafter=os.path.join(R, "train/drafter"),
        model=target_model_files(),
    output:
        directory(os.path.join(R, "drafter")),
    params:
        model=lambda wc, input: target_model_dir(input.model),
        settings=stage_settings(None, dtype=DRAFTER["export_dtype"], **TRUST),
    log:
        log("export"),
    conda:
        ENV_CPU
    shell:
        "{PKG} export --drafter {input.drafter:q} --model {params.model:q} --out {output:q} --settings {params.settings:q} "
        "> {log:q} 2>&1"


add_final_target(lambda: [os.path.join(R, "drafter")])
