# The data-quality gate: aggregate per-shard audits into a report, then pass or stop the run.
# The report is always written (so a failed gate can be read); the gate rule is what fails.


rule audit:
    input:
        audits=shard_audits,
        verdicts=regenerated_settled,
        manifest=os.path.join(R, "ingest/manifest.json"),
    output:
        report=os.path.join(R, "audit/{dataset}/report.json"),
        html=report(os.path.join(R, "audit/{dataset}/report.html"), category="Audit", labels={"dataset": "{dataset}"}),
    log:
        log("audit/{dataset}"),
    benchmark:
        bench("audit/{dataset}")
    conda:
        ENV_CPU
    params:
        thresholds=json.dumps(config["audit"]),
        mode=lambda wc: gate_mode(wc.dataset),
    shell:
        "dflash-pipeline audit --audits {input.audits:q} --manifest {input.manifest:q} --thresholds {params.thresholds:q} "
        "--mode {params.mode} --dataset {wildcards.dataset} --out {output.report:q} --html {output.html:q} > {log:q} 2>&1"


# a checkpoint: per-shard jobs wait for its verdict without taking its file (rules/common.smk, after())
checkpoint gate:
    input:
        os.path.join(R, "audit/{dataset}/report.json"),
    output:
        os.path.join(R, "audit/{dataset}/gate.ok"),
    log:
        log("gate/{dataset}"),
    conda:
        ENV_CPU
    shell:
        # the reason goes to the terminal as well as the log: this is what the user must read
        "dflash-pipeline gate --report {input:q} --out {output:q} 2>&1 | tee {log:q}; exit ${{PIPESTATUS[0]}}"
