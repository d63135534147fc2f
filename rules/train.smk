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


def _drafter_args():
    args = [f"--num-layers {DRAFTER['num_layers']}", f"--block-size {DRAFTER['block_size']}"]
    if DRAFTER.get("target_layer_ids"):
        args.append("--target-layer-ids " + ",".join(str(i) for i in DRAFTER["target_layer_ids"]))
    if DRAFTER.get("mask_token_id") is not None:
        args.append(f"--mask-token-id {DRAFTER['mask_token_id']}")
    return " ".join(args)


def _train_args():
    t = TRAIN
    args = [
        f"--num-anchors {t['num_anchors']}", f"--gamma {t['gamma']}", f"--max-length {t['max_length']}",
        f"--batch-size {t['batch_size']}", f"--grad-accum {t['grad_accum']}", f"--epochs {t['epochs']}",
        f"--max-steps {t['max_steps']}", f"--lr {t['lr']}", f"--warmup-ratio {t['warmup_ratio']}",
        f"--weight-decay {t['weight_decay']}", f"--grad-clip {t['grad_clip']}", f"--seed {t['seed']}",
        f"--checkpoint-every {t['checkpoint_every']}", f"--keep-checkpoints {t['keep_checkpoints']}",
        f"--log-every {t['log_every']}", f"--holdout-fraction {config['evaluate']['holdout_fraction']}",
        f"--attention {t['attention']}",
        f"--labels {t['labels']}",
    ]
    if t.get("compile"):
        args.append("--compile")
    # checkpoints are not an output: on S3 storage (Kubernetes, no shared disk) mirror them, so a job that
    # restarts on another machine resumes instead of starting over
    mirror = t.get("checkpoint_mirror") or ""
    prefix = str(getattr(workflow.storage_settings, "default_storage_prefix", None) or "")
    if not mirror and prefix.startswith("s3://"):
        mirror = f"{prefix.rstrip('/')}/{R}/train/checkpoints"
    if mirror:
        args.append(f"--checkpoint-mirror {shlex.quote(mirror)}")
    return " ".join(args)


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
        mode=TRAIN["mode"],
        drafter=_drafter_args(),
        train=_train_args(),
        gpus=TRAIN["gpus"],
        nproc=max(1, TRAIN["gpus"]),
        nodes=TRAIN["nodes"],
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
        "{PKG} with-gpus --n {params.gpus} -- "
        "{PKG} launch-torchrun --nproc-per-node {params.nproc} --nnodes {params.nodes} -- "
        "{PKG} train --mode {params.mode} --inputs {params.data:q} --model {params.model:q} --out {output:q} "
        "--checkpoint-dir {params.checkpoints:q} {params.drafter} {params.train} > {log:q} 2>&1"


rule export:
    input:
        drafter=os.path.join(R, "train/drafter"),
        model=target_model_files(),
    output:
        directory(os.path.join(R, "drafter")),
    params:
        model=lambda wc, input: target_model_dir(input.model),
        dtype=DRAFTER["export_dtype"],
    log:
        log("export"),
    conda:
        ENV_CPU
    shell:
        "{PKG} export --drafter {input.drafter:q} --model {params.model:q} --out {output:q} --dtype {params.dtype} "
        "> {log:q} 2>&1"


add_final_target(lambda: [os.path.join(R, "drafter")])
