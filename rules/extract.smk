# Hidden-state extraction (GPU-tagged) and the plan printed before any GPU work.
#
# One extraction job takes a group: the extract.shards_per_job consecutive shards of one source file (1: a
# group of one). It pays python, torch and the target's load (and compilation) once for the group, writes each
# shard's file and stats under hidden/groups/{exgroup}.partial/ and renames the directory at the end, beside
# hidden/groups/{exgroup}.stats.json (every shard's stats: what the plan and the report read). Training reads
# the group directories themselves: no job copies or links hidden states out of them, so on S3 storage they go
# up once from the extraction job and down once to the training job, never through the Snakemake host. A
# killed job leaves the .partial directory: the rerun keeps the shards finished there (same tokens and
# settings: extract.py resume_key) and resumes the one it was writing from its journal. A changed shard
# redoes its group's job; the other groups are not touched.

# groups extracted before their stats file existed get it now, from their shards' stats: not extracted again
for adopted in adopt_groups(os.path.join(R, "hidden/groups")):
    print(f"extraction group of an earlier version kept: {adopted} written from its shards' stats", file=sys.stderr)


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
        target=TOKENIZER_IDENTITY,  # reruns the job when the target changes in place (rules/common.smk)
        config=PARAMS.plan(),
        stats=os.path.join(R, "hidden/groups/*.stats.json"),
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
        rates=plan_rates(),
    output:
        text=os.path.join(R, "plan.txt"),
        json=os.path.join(R, "plan.json"),
    log:
        log("plan"),
    conda:
        ENV_CPU
    params:
        model=lambda wc, input: target_model_dir(input.model),
        target=TOKENIZER_IDENTITY,  # reruns the job when the target changes in place (rules/common.smk)
        config=PARAMS.plan(),
        stats=os.path.join(R, "hidden/groups/*.stats.json"),
        rates=lambda wc, input: f"--rates {shlex.quote(input.rates[0])}" if input.rates else "",
    shell:
        # printed to the terminal as well: this is what the user must read before the GPUs start
        "dflash-pipeline plan --tokens {input.tokens:q} --model {params.model:q} --config {params.config:q} "
        "--hidden-stats {params.stats:q} --calibration {input.calibration:q} {params.rates} --out {output.text:q} "
        "--json {output.json:q} 2>&1 | tee {log:q}; "
        "exit ${{PIPESTATUS[0]}}"


rule extract:
    input:
        tokens=lambda wc: expand(
            os.path.join(R, "tokens", training_dataset(), "{shard}.parquet"),
            shard=EXTRACTION_GROUPS.members(wc.exgroup, shard_ids()),
        ),
        # the gate must have passed and the plan be printed first; waited for, not inputs: a re-gate or a new
        # plan (a shard added elsewhere) redoes no shard
        verdicts=settled,
        model=target_model_files(),
    output:
        group=directory(os.path.join(R, "hidden/groups/{exgroup}")),  # first: partial_dir names it
        stats=os.path.join(R, "hidden/groups/{exgroup}.stats.json"),
    log:
        log("extract/{exgroup}"),
    benchmark:
        bench("extract/{exgroup}")
    wildcard_constraints:
        exgroup=r"[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*?-x\d{5}",
    conda:
        ENV_GPU
    threads: EXTRACT["encode_threads"]
    resources:
        gpu=EXTRACT["gpus"],
        runtime=EXTRACT["runtime_min"],
        mem_mb=EXTRACT["mem_mb"],
    params:
        model=lambda wc, input: target_model_dir(input.model),
        target=TARGET_IDENTITY,  # reruns the job when the target changes in place (rules/common.smk)
        partial=partial_dir,  # (rules/common.smk)
        outs=lambda wc, output: partial_files(output, EXTRACTION_GROUPS.members(wc.exgroup, shard_ids()), ".dfhs"),
        stats=lambda wc, output: partial_files(
            output, EXTRACTION_GROUPS.members(wc.exgroup, shard_ids()), ".stats.json"
        ),
        # the plan resolved the layer ids: a rewritten plan with the same ids reruns nothing
        settings=lambda wc: PARAMS.extract(planned()),
    shell:
        # a killed job leaves {params.partial} (finished shards, {shard}.dfhs.partial + .journal): the rerun
        # resumes from them; only a complete group is renamed into place
        "mkdir -p {params.partial:q} && "
        "dflash-pipeline with-gpus --n {resources.gpu} -- dflash-pipeline extract --tokens {input.tokens:q} --model {params.model:q} "
        "--out {params.outs:q} --stats {params.stats:q} --group-stats {output.stats:q} --settings {params.settings:q} "
        "--encode-threads {threads} > {log:q} 2>&1 && rm -rf {output.group:q} && mv {params.partial:q} {output.group:q}"
