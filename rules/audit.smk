# The data-quality gate: aggregate per-shard audits into a report, then pass or stop the run.
# The report is always written (so a failed gate can be read); the gate rule is what fails.


def _audits(wildcards):
    return expand(os.path.join(R, "tokens/{dataset}/{shard}.audit.json"), dataset=wildcards.dataset, shard=shard_ids())


def _gate_mode(dataset):
    # with regeneration on, the source audit gates prompts only: bad answers are about to be replaced
    return "prompts" if dataset == "source" and config["generate"]["enabled"] else "full"


rule audit:
    input:
        audits=_audits,
        manifest=os.path.join(R, "ingest/manifest.json"),
    output:
        report=os.path.join(R, "audit/{dataset}/report.json"),
        html=report(os.path.join(R, "audit/{dataset}/report.html"), category="Audit", labels={"dataset": "{dataset}"}),
    params:
        thresholds=json.dumps(config["audit"]),
        mode=lambda wc: _gate_mode(wc.dataset),
    log:
        log("audit/{dataset}"),
    conda:
        ENV_CPU
    shell:
        "{PKG} audit --audits {input.audits:q} --manifest {input.manifest:q} --thresholds {params.thresholds:q} "
        "--mode {params.mode} --dataset {wildcards.dataset} --out {output.report:q} --html {output.html:q} > {log:q} 2>&1"


rule gate:
    input:
        os.path.join(R, "audit/{dataset}/report.json"),
    output:
        os.path.join(R, "audit/{dataset}/gate.ok"),
    log:
        log("gate/{dataset}"),
    shell:
        # the reason goes to the terminal as well as the log: this is what the user must read
        "{PKG} gate --report {input:q} --out {output:q} 2>&1 | tee {log:q}; exit ${{PIPESTATUS[0]}}"


add_final_target(lambda: [os.path.join(R, "audit/source/gate.ok")])
