# Generation: regenerate every assistant answer with the target, exactly once per sample, resumably.
# Per shard: completions/{shard}.parquet (+ .summary.json). A job's journal (completions/journal/) is not a
# declared output, so a failed or killed job keeps its finished samples and the rerun sends only the rest.
#
# Server start-up (minutes for a 27B model) is paid once per *job*, not per shard: one `generate` job takes
# the generate.shards_per_job consecutive shards of a source file (a group; 1: a group of one), starts its
# servers once and keeps them saturated across shard boundaries; a cheap local rule then links each shard's
# files out. With backend `servers` the servers are long-lived (started outside the workflow) and cost nothing
# per job.


if GEN["enabled"]:

    rule generate:
        input:
            shards=lambda wc: expand(
                os.path.join(R, "ingest/shards/{shard}.parquet"),
                shard=GENERATION_GROUPS.members(wc.gengroup, shard_ids()),
            ),
            # the source gate and the generation gate must have passed; waited for, not inputs (common.smk: after)
            gates=generation_gates,
            calibration=generation_calibration,
            model=target_model_files(),
        output:
            directory(os.path.join(R, "completions/groups/{gengroup}")),
        log:
            log("generate/{gengroup}"),
        benchmark:
            bench("generate/{gengroup}")
        conda:
            GEN_ENV
        resources:
            **GEN_RESOURCES,
        params:
            model=lambda wc, input: target_model_dir(input.model),
            target=TARGET_IDENTITY,  # reruns the job when the target changes in place (rules/common.smk)
            partial=partial_dir,  # (rules/common.smk) the journal keeps a killed job's samples
            outs=lambda wc, output: partial_files(
                output, GENERATION_GROUPS.members(wc.gengroup, shard_ids()), ".parquet"
            ),
            journal=os.path.join(R, "completions/journal"),
            server_logs=lambda wc: log(f"generate/{wc.gengroup}.servers").removesuffix(".log"),
            settings=GEN_SETTINGS,
        shell:
            "dflash-pipeline with-gpus --n {resources.gpu} -- dflash-pipeline generate --input {input.shards:q} --out {params.outs:q} --model {params.model:q} "
            "--journal-dir {params.journal:q} --server-log-dir {params.server_logs:q} --calibration {input.calibration:q} "
            "--settings {params.settings:q} "
            '--runtime-settings "$DFLASH_GENERATE_RUNTIME" > {log:q} 2>&1 && '
            "rm -rf {output:q} && mv {params.partial:q} {output:q}"

    rule completions_from_group:
        input:
            group=lambda wc: os.path.join(R, f"completions/groups/{GENERATION_GROUPS.of(wc.shard)}"),
            gates=generation_gates,
        output:
            completions=os.path.join(R, "completions/{shard}.parquet"),
            summary=os.path.join(R, "completions/{shard}.summary.json"),
        log:
            log("generate/{shard}.link"),
        conda:
            ENV_CPU
        shell:
            link_out(
                ("{input.group:q}/{wildcards.shard}.parquet", "{output.completions:q}"),
                ("{input.group:q}/{wildcards.shard}.summary.json", "{output.summary:q}"),
            )

    localrules:
        completions_from_group,
