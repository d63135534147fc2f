# Train the DFlash drafter (GPU-tagged; DDP over the GPUs of a node and over nodes) and export it in the
# layout SGLang and vLLM load. Offline mode reads the extracted hidden-state shards; online mode reads the
# token shards and runs the target beside the drafter (no hidden states on disk).


rule train:
    input:
        data=train_inputs,
        verdicts=train_verdicts,
        model=target_model_files(),
    output:
        directory(os.path.join(R, "train/drafter")),
    log:
        log("train"),
    benchmark:
        bench("train")
    conda:
        ENV_GPU
    resources:
        # one node: gpu=N; several (SLURM): a per-node GRES, one task per node, mpi (see launch_torchrun)
        **train_resources(TRAIN["nodes"], TRAIN["gpus"]),
        runtime=TRAIN["runtime_min"],
        mem_mb=TRAIN["mem_mb"],
        # what the launcher needs, as resources (not params): resizing a run resumes its checkpoints
        gpus_per_node=TRAIN["gpus"],
        nnodes=TRAIN["nodes"],
    params:
        model=lambda wc, input: target_model_dir(input.model),
        target=TARGET_IDENTITY,  # reruns the job when the target changes in place (rules/common.smk)
        checkpoints=os.path.join(R, "train/checkpoints"),  # not an output: survives a failed job for resume
        # the plan resolved the layer ids and the mask token: a rewritten plan with the same values reruns nothing
        settings=lambda wc: PARAMS.train(planned()),
    shell:
        "dflash-pipeline with-gpus --n {resources.gpus_per_node} -- "
        "dflash-pipeline launch-torchrun --nproc-per-node auto --nnodes {resources.nnodes} -- "
        "dflash-pipeline train --inputs {input.data:q} --model {params.model:q} --out {output:q} "
        "--checkpoint-dir {params.checkpoints:q} --settings {params.settings:q} "
        '--runtime-settings "$DFLASH_TRAIN_RUNTIME" > {log:q} 2>&1'


rule export:
    input:
        drafter=os.path.join(R, "train/drafter"),
        verdicts=settled,
        model=target_model_files(),
    output:
        directory(os.path.join(R, "drafter")),
    log:
        log("export"),
    conda:
        ENV_CPU
    params:
        model=lambda wc, input: target_model_dir(input.model),
        target=TARGET_IDENTITY,  # reruns the job when the target changes in place (rules/common.smk)
        settings=PARAMS.stage(None, dtype=DRAFTER["export_dtype"], **PARAMS.trust),
    shell:
        "dflash-pipeline export --drafter {input.drafter:q} --model {params.model:q} --out {output:q} --settings {params.settings:q} "
        "> {log:q} 2>&1"
