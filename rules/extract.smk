# Hidden-state extraction (GPU-tagged, one job per shard) and the plan printed before any GPU work.


rule preview:
    # the cost preview: CPU jobs only (ingest, tokenize, this), generation priced from config generate.assumed
    input:
        tokens=lambda wc: expand(os.path.join(R, "tokens/source/{shard}.parquet"), shard=shard_ids()),
        model=target_model_files(),
    output:
        os.path.join(R, "preview.txt"),
    log:
        log("preview"),
    conda:
        ENV_CPU
    params:
        model=lambda wc, input: target_model_dir(input.model),
        config=PLAN_CONFIG,
        stats=os.path.join(R, "hidden/*.stats.json"),
    shell:
        "dflash-pipeline plan --tokens {input.tokens:q} --model {params.model:q} --config {params.config:q} "
        "--hidden-stats {params.stats:q} --assume-generation --out {output:q} 2>&1 | tee {log:q}; "
        "exit ${{PIPESTATUS[0]}}"


# a checkpoint: extraction jobs wait for it without taking its file (rules/common.smk, after())
checkpoint plan:
    input:
        tokens=lambda wc: expand(os.path.join(R, "tokens/source/{shard}.parquet"), shard=shard_ids()),
        model=target_model_files(),
        calibration=plan_calibration(),
    output:
        text=os.path.join(R, "plan.txt"),
        json=os.path.join(R, "plan.json"),
    log:
        log("plan"),
    conda:
        ENV_CPU
    params:
        model=lambda wc, input: target_model_dir(input.model),
        config=PLAN_CONFIG,
        stats=os.path.join(R, "hidden/*.stats.json"),
    shell:
        # printed to the terminal as well: this is what the user must read before the GPUs start
        "dflash-pipeline plan --tokens {input.tokens:q} --model {params.model:q} --config {params.config:q} "
        "--hidden-stats {params.stats:q} --calibration {input.calibration:q} --out {output.text:q} "
        "--json {output.json:q} 2>&1 | tee {log:q}; "
        "exit ${{PIPESTATUS[0]}}"


rule extract:
    input:
        tokens=lambda wc: os.path.join(R, "tokens", training_dataset(), f"{wc.shard}.parquet"),
        # the gate must have passed and the plan be printed first; waited for, not inputs: a re-gate or a new
        # plan (a shard added elsewhere) redoes no shard
        verdicts=settled,
        model=target_model_files(),
    output:
        hidden=os.path.join(R, "hidden/{shard}.dfhs"),
        stats=os.path.join(R, "hidden/{shard}.stats.json"),
    log:
        log("extract/{shard}"),
    benchmark:
        bench("extract/{shard}")
    conda:
        ENV_GPU
    threads: EXTRACT["encode_threads"]
    resources:
        gpu=EXTRACT["gpus"],
        runtime=EXTRACT["runtime_min"],
        mem_mb=EXTRACT["mem_mb"],
    params:
        model=lambda wc, input: target_model_dir(input.model),
        settings=stage_settings(
            "extract",
            # encode_threads is the rule's threads (not a param: how many threads write it changes no byte)
            drop=("assumed_tokens_per_s", "warn_bytes", "warn_shard_bytes", "encode_threads"),
            drafter_config=drafter_layers_json(),
            **TRUST,
        ),
    shell:
        # a killed job leaves {output.hidden}.partial + .journal behind: the rerun resumes from them
        "dflash-pipeline with-gpus --n {resources.gpu} -- dflash-pipeline extract --tokens {input.tokens:q} --model {params.model:q} --out {output.hidden:q} "
        "--stats {output.stats:q} --settings {params.settings:q} --encode-threads {threads} > {log:q} 2>&1"
