# Figures and tables for `snakemake --report report.html`: generation statistics, extraction throughput and
# storage, training curves, acceptance length, and the wall time of every stage (from the benchmark files).
# The audit reports (rules/audit.smk) and the evaluation plot (rules/evaluate.smk) are report items too.


rule run_report:
    input:
        unpack(report_inputs),
    output:
        generation=report(os.path.join(R, "report/generation.png"), category="Generation"),
        extraction=report(os.path.join(R, "report/extraction.png"), category="Extraction"),
        training=report(os.path.join(R, "report/training.png"), category="Training"),
        tau=report(os.path.join(R, "report/tau.png"), category="Evaluation"),
        summary=report(os.path.join(R, "report/summary.html"), category="Summary"),
    log:
        log("run_report"),
    conda:
        ENV_CPU
    params:
        generation=lambda wc, input: input.get("generation", []),
        extraction=lambda wc, input: input.get("extraction", []),
        # named inputs are absent while the manifest checkpoint is pending (a dry run formats this anyway)
        train=lambda wc, input: input.get("train", ""),
        evaluate=lambda wc, input: input.get("evaluate", ""),
        plan=lambda wc, input: input.get("plan", ""),
        calibration=lambda wc, input: input.get("calibration", ""),
        benchmarks=os.path.join(R, "benchmarks"),
        out_dir=lambda wc, output: os.path.dirname(output.summary),
        # GPUs per job, so that the summary compares GPU-hours with the plan's GPU-hours
        extract_gpus=config["extract"]["gpus"],
        train_gpus=config["train"]["gpus"] * config["train"]["nodes"],
    shell:
        "dflash-pipeline report-figures --generation {params.generation:q} --extraction {params.extraction:q} "
        "--train {params.train:q} --evaluate {params.evaluate:q} --benchmarks {params.benchmarks:q} "
        "--plan {params.plan:q} --calibration {params.calibration:q} --extract-gpus {params.extract_gpus} "
        "--train-gpus {params.train_gpus} --out-dir {params.out_dir:q} > {log:q} 2>&1"


# Jobs too small to be worth a cluster slot (seconds of work, no GPU): on SLURM or Kubernetes they run in
# the Snakemake process's machine instead of queueing behind real work.
localrules:
    all,
    gate,
    evaluate_gate,
    run_report,
    plan,
    preview,
    calibration_sample,
    export,
