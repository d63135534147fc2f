# Generation calibration, before the full generation (README: Generation, "Calibration"). The configured
# backend, started exactly as `generate` starts it, answers a stratified sample of the real prompts; the plan
# projects the whole corpus from the measured rate; the generation gate stops the run before any generation
# job when the projection exceeds generate.max_wall_hours / generate.max_gpu_hours.
#
# Cached: the calibration reruns only when what decides the rate changes (its params: backend settings,
# target, sampling) or the prompts of the sample do; new shards, limits or progress settings do not recalibrate.


# a checkpoint: the calibration asks for it and takes the sample's identity (which prompts) as its param, so
# a redraw of the same prompts recalibrates nothing
checkpoint calibration_sample:
    input:
        tokens=calibration_token_files,
        shards=calibration_shard_files,
    output:
        os.path.join(R, "calibration/sample.parquet"),
    log:
        log("calibration_sample"),
    conda:
        ENV_CPU
    params:
        samples=CALIBRATE["samples"],
        warmup=CALIBRATE["warmup_requests"],
        seed=CALIBRATE["seed"],
    shell:
        "dflash-pipeline calibrate-sample --tokens {input.tokens:q} --shards {input.shards:q} "
        "--samples {params.samples} --warmup {params.warmup} --seed {params.seed} --out {output:q} > {log:q} 2>&1"


rule calibrate:
    input:
        sample=calibration_sample_input,
        model=target_model_files(),
        backend=backend_ready,  # checked before any job: the backend is installed (nothing to wait for)
    output:
        CALIBRATION,
    log:
        log("calibrate"),
    benchmark:
        bench("calibrate")
    conda:
        GEN_ENV
    resources:
        **GEN_RESOURCES,
    params:
        model=lambda wc, input: target_model_dir(input.model),
        target=TARGET_IDENTITY,  # reruns the job when the target changes in place (rules/common.smk)
        settings=generate_settings(),
        sample=calibration_sample_identity,
        server_logs=log("calibrate.servers").removesuffix(".log"),
    shell:
        # the measured figures go to the terminal as well
        "dflash-pipeline with-gpus --n {resources.gpu} -- dflash-pipeline calibrate --input {input.sample:q} "
        "--out {output:q} --model {params.model:q} --server-log-dir {params.server_logs:q} "
        "--gpus-per-job {resources.gpu} --settings {params.settings:q} "
        '--runtime-settings "$DFLASH_GENERATE_RUNTIME" 2>&1 | tee {log:q}; exit ${{PIPESTATUS[0]}}'


# a checkpoint: generation jobs wait for its verdict without taking its file (rules/common.smk, after())
checkpoint generation_gate:
    input:
        os.path.join(R, "plan.json"),
    output:
        GENERATION_GATE,
    log:
        log("generation_gate"),
    conda:
        ENV_CPU
    params:
        limits=PARAMS.generation_limits(),
    shell:
        # the reason goes to the terminal as well as the log: this is what the user must read
        "dflash-pipeline generation-gate --plan {input:q} {params.limits} --out {output:q} 2>&1 | tee {log:q}; "
        "exit ${{PIPESTATUS[0]}}"


localrules:
    generation_gate,


# cost.calibrate_rates: extraction and training measured on the run's GPU (planning/calibrate_rates.py) before the
# plan, which then projects those stages from measured rates and start-ups instead of its cost model. Drawn
# from the first source shards by name, so that a raw file added later measures nothing again.
if config["cost"].get("calibrate_rates"):

    rule calibrate_rates:
        input:
            tokens=rates_token_files,
            model=target_model_files(),
        output:
            RATES,
        log:
            log("calibrate_rates"),
        benchmark:
            bench("calibrate_rates")
        conda:
            ENV_GPU
        # the extract job's threads (Snakemake sets OMP_NUM_THREADS from them): with 1, the H200 host of stop 38
        # measured extraction at 37K tok/s where the job ran at 117K
        threads: EXTRACT["encode_threads"]
        resources:
            gpu=max(EXTRACT["gpus"], 1 if TRAIN["gpus"] else 0),
            runtime=EXTRACT["runtime_min"],
            mem_mb=EXTRACT["mem_mb"],
        params:
            model=lambda wc, input: target_model_dir(input.model),
            target=TARGET_IDENTITY,  # reruns the job when the target changes in place (rules/common.smk)
            settings=PARAMS.rates(),
            extract=PARAMS.extract(),
            shards_per_job=EXTRACT["shards_per_job"],
            tokens=config["cost"]["calibrate_rates_tokens"],
            steps=config["cost"]["calibrate_rates_train_steps"],
        shell:
            # the figures go to the terminal as well; the scratch directory is removed by the stage
            'work=$(mktemp -d "${{TMPDIR:-/tmp}}/dflash-rates.XXXXXX") && '
            "dflash-pipeline with-gpus --n {resources.gpu} -- dflash-pipeline calibrate-rates "
            "--tokens {input.tokens:q} --model {params.model:q} --extract-settings {params.extract:q} "
            '--train-settings "$DFLASH_RATES_TRAIN_SETTINGS" --shards-per-job {params.shards_per_job} '
            "--encode-threads {threads} --measure-tokens {params.tokens} --warmup-tokens {params.tokens} "
            '--train-steps {params.steps} --work-dir "$work" --out {output:q} 2>&1 | tee {log:q}; '
            "exit ${{PIPESTATUS[0]}}"
