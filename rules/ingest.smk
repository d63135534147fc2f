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
        settings=stage_settings("ingest", keys=["on_corrupt", "max_record_bytes", "max_records"]),
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
        settings=stage_settings("ingest", keys=["shard_size"]),
    shell:
        "dflash-pipeline manifest --records {input.records:q} --stats {input.stats:q} --settings {params.settings:q} "
        "--out {output.manifest:q} > {log:q} 2>&1"


# Writing a shard is cheap; starting a Python process for it is not (about a second). With
# ingest.shards_per_job = K > 1 one job writes K consecutive shards of a file (a "job group" directory) and a
# shell-only rule links each shard out, so thousands of shards cost a few hundred process start-ups.
if SHARDS_PER_JOB == 1:

    rule shard:
        input:
            records=shard_records,
        output:
            os.path.join(R, "ingest/shards/{shard}.parquet"),
        log:
            log("shard/{shard}"),
        benchmark:
            bench("shard/{shard}")
        conda:
            ENV_CPU
        params:
            # this shard's manifest entry, with its content digest, is what decides it: another shard of the same
            # file changed, or another file, rewrites nothing here
            spec=lambda wc: json.dumps(shard_entry(wc), sort_keys=True),
        shell:
            "dflash-pipeline shard --records {input.records:q} --spec {params.spec:q} --out {output:q} > {log:q} 2>&1"

else:

    rule shard_group:
        input:
            records=lambda wc: shard_records(SimpleNamespace(shard=shard_group_members(wc.shardgroup)[0])),
        output:
            directory(os.path.join(R, "ingest/shards/groups/{shardgroup}")),
        log:
            log("shard/{shardgroup}"),
        benchmark:
            bench("shard/{shardgroup}")
        wildcard_constraints:
            shardgroup=r"[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*?-j\d{5}",
        conda:
            ENV_CPU
        params:
            specs=lambda wc: json.dumps(
                [manifest()["_by_shard"][s] for s in shard_group_members(wc.shardgroup)], sort_keys=True
            ),
        shell:
            "dflash-pipeline shard --records {input.records:q} --specs {params.specs:q} --out-dir {output:q} > {log:q} 2>&1"

    rule shard_from_group:
        input:
            lambda wc: os.path.join(R, f"ingest/shards/groups/{shard_group_of(wc.shard)}"),
        output:
            os.path.join(R, "ingest/shards/{shard}.parquet"),
        log:
            log("shard/{shard}"),
        conda:
            ENV_CPU
        shell:
            # a hard link when the file system allows it: no bytes copied
            "(ln -f {input:q}/{wildcards.shard}.parquet {output:q} || cp {input:q}/{wildcards.shard}.parquet {output:q}) > {log:q} 2>&1"
