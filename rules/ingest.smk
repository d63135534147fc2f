# Ingest: one job per raw file (so a change to one file redoes only its shards), then one checkpoint
# that deduplicates across files and writes the shard manifest, then one cheap job per shard.


rule ingest:
    input:
        raw=raw_input,
        # evaluation prompts (evaluate.prompts_file, ingest.exclude_prompts): samples asking one never train
        exclude=EXCLUDE_PROMPTS,
    output:
        records=os.path.join(R, "ingest/files/{src}.parquet"),
        stats=os.path.join(R, "ingest/files/{src}.stats.json"),
        quarantine=os.path.join(R, "ingest/files/{src}.quarantine.jsonl"),
    log:
        log("ingest/{src}"),
    benchmark:
        bench("ingest/{src}")
    conda:
        ENV_CPU
    params:
        settings=PARAMS.stage("ingest", keys=["on_corrupt", "max_record_bytes", "max_records"]),
        name=lambda wc: RAW_INPUTS[wc.src],
    shell:
        "dflash-pipeline ingest --input {input.raw:q} --name {params.name:q} --out {output.records:q} --stats {output.stats:q} "
        "--quarantine {output.quarantine:q} --exclude-prompts {input.exclude:q} --settings {params.settings:q} > {log:q} 2>&1; "
        # the file's one-line account (kept, quarantined and why) on the console; the rest is in the log
        "tail -n 1 {log:q}"


checkpoint manifest:
    input:
        stats=expand(os.path.join(R, "ingest/files/{src}.stats.json"), src=sorted(RAW_INPUTS)),
        records=expand(os.path.join(R, "ingest/files/{src}.parquet"), src=sorted(RAW_INPUTS)),
    output:
        manifest=os.path.join(R, "ingest/manifest.json"),
    log:
        log("manifest"),
    benchmark:
        bench("manifest")
    conda:
        ENV_CPU
    params:
        settings=PARAMS.stage("ingest", keys=["shard_size"]),
    shell:
        "dflash-pipeline manifest --records {input.records:q} --stats {input.stats:q} --settings {params.settings:q} "
        "--out {output.manifest:q} > {log:q} 2>&1"


# Writing a shard is cheap; starting a Python process for it is not (about a second). One shard job takes a
# group: the ingest.shards_per_job consecutive shards of one file (1: a group of one), written under
# ingest/shards/groups/{shardgroup}.partial/ and renamed at the end; a local rule links each shard out. So
# thousands of shards cost a few hundred process start-ups, and the rule is `shard` whatever the group size.


rule shard:
    input:
        records=shard_group_records,
    output:
        directory(os.path.join(R, "ingest/shards/groups/{shardgroup}")),
    log:
        log("shard/{shardgroup}"),
    benchmark:
        bench("shard/{shardgroup}")
    wildcard_constraints:
        shardgroup=SHARD_GROUPS.pattern,
    conda:
        ENV_CPU
    params:
        specs=lambda wc: json.dumps(shard_group_specs(wc), sort_keys=True),
        partial=partial_dir,  # (rules/common.smk)
    shell:
        # nothing to resume (a shard takes a moment): a killed job's .partial directory is started afresh
        "rm -rf {params.partial:q} && "
        "dflash-pipeline shard --records {input.records:q} --specs {params.specs:q} --out-dir {params.partial:q} > {log:q} 2>&1 && "
        "rm -rf {output:q} && mv {params.partial:q} {output:q}"


rule shard_from_group:
    input:
        lambda wc: os.path.join(R, f"ingest/shards/groups/{SHARD_GROUPS.of(wc.shard)}"),
    output:
        os.path.join(R, "ingest/shards/{shard}.parquet"),
    log:
        log("shard/{shard}.link"),
    conda:
        ENV_CPU
    shell:
        link_out(("{input:q}/{wildcards.shard}.parquet", "{output:q}"))


localrules:
    shard_from_group,
