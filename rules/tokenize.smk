# Tokenize a shard with the target's chat template and an assistant-only loss mask, plus its audit. One job
# takes a group of ingest.shards_per_job shards (1: a group of one), as shard does: the tokenizer (seconds for a
# 248K vocabulary) loads once per group; a local rule links each shard's tokens and audit out.


rule tokenize:
    input:
        conversations=tokenize_group_inputs,
        verdicts=regenerated_settled,
        model=target_model_files(),
    output:
        directory(os.path.join(R, "tokens/{dataset}/groups/{shardgroup}")),
    log:
        log("tokenize/{dataset}/{shardgroup}"),
    benchmark:
        bench("tokenize/{dataset}/{shardgroup}")
    wildcard_constraints:
        shardgroup=SHARD_GROUPS.pattern,
    conda:
        ENV_CPU
    params:
        model=lambda wc, input: target_model_dir(input.model),
        target=TOKENIZER_IDENTITY,  # reruns the job when the target changes in place (rules/common.smk)
        settings=lambda wc: PARAMS.tokenize(wc.dataset),
        partial=partial_dir,  # (rules/common.smk)
    shell:
        "rm -rf {params.partial:q} && "
        "dflash-pipeline tokenize --input {input.conversations:q} --model {params.model:q} --out-dir {params.partial:q} "
        "--settings {params.settings:q} > {log:q} 2>&1 && rm -rf {output:q} && mv {params.partial:q} {output:q}"


rule tokens_from_group:
    input:
        group=lambda wc: os.path.join(R, f"tokens/{wc.dataset}/groups/{SHARD_GROUPS.of(wc.shard)}"),
        verdicts=regenerated_settled,
    output:
        tokens=os.path.join(R, "tokens/{dataset}/{shard}.parquet"),
        audit=os.path.join(R, "tokens/{dataset}/{shard}.audit.json"),
    log:
        log("tokenize/{dataset}/{shard}.link"),
    conda:
        ENV_CPU
    shell:
        link_out(
            ("{input.group:q}/{wildcards.shard}.parquet", "{output.tokens:q}"),
            ("{input.group:q}/{wildcards.shard}.audit.json", "{output.audit:q}"),
        )


localrules:
    tokens_from_group,
