# Acceptance length (tau) of the exported drafter against the target on held-out prompts, an untrained
# drafter beside it, and losslessness against plain greedy decoding. The report is always written; the
# gate rule fails the run when the trained drafter is not clearly better (wrong layer ids, shifted labels).


rule evaluate:
    input:
        drafter=os.path.join(R, "drafter"),
        verdicts=settled,
        tokens=lambda wc: expand(os.path.join(R, "tokens", training_dataset(), "{shard}.parquet"), shard=shard_ids()),
        model=target_model_files(),
        prompts=[EVAL_PROMPTS] if EVAL_PROMPTS else [],
    output:
        report=os.path.join(R, "evaluate/report.json"),
        plot=report(os.path.join(R, "evaluate/acceptance.png"), category="Evaluation"),
    log:
        log("evaluate"),
    benchmark:
        bench("evaluate")
    conda:
        ENV_GPU
    resources:
        gpu=EVAL["gpus"],
        runtime=EVAL["runtime_min"],
        mem_mb=EVAL["mem_mb"],
    params:
        model=lambda wc, input: target_model_dir(input.model),
        target=TARGET_IDENTITY,  # reruns the job when the target changes in place (rules/common.smk)
        settings=PARAMS.stage("evaluate", drop=("prompts_file",), **PARAMS.trust),
        prompts=lambda wc, input: f"--prompts-file {shlex.quote(input.prompts[0])}" if input.prompts else "",
    shell:
        "dflash-pipeline with-gpus --n {resources.gpu} -- "
        "dflash-pipeline evaluate --drafter {input.drafter:q} --model {params.model:q} --tokens {input.tokens:q} "
        '--settings {params.settings:q} --runtime-settings "$DFLASH_EVALUATE_RUNTIME" {params.prompts} '
        "--out {output.report:q} --plot {output.plot:q} "
        "> {log:q} 2>&1"


rule evaluate_gate:
    input:
        report=os.path.join(R, "evaluate/report.json"),
        verdicts=settled,
    output:
        os.path.join(R, "evaluate/gate.ok"),
    log:
        log("evaluate_gate"),
    conda:
        ENV_CPU
    shell:
        "dflash-pipeline evaluate-gate --report {input.report:q} --out {output:q} 2>&1 | tee {log:q}; exit ${{PIPESTATUS[0]}}"
