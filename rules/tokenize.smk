# Tokenize a shard with the target's chat template and an assistant-only loss mask, plus its audit.
from types import SimpleNamespace

if SHARDS_PER_JOB == 1:

    rule tokenize:
        input:
            conversations=shard_conversations,
            verdicts=regenerated_settled,
            model=target_model_files(),
        output:
            tokens=os.path.join(R, "tokens/{dataset}/{shard}.parquet"),
            audit=os.path.join(R, "tokens/{dataset}/{shard}.audit.json"),
        log:
            log("tokenize/{dataset}/{shard}"),
        benchmark:
            bench("tokenize/{dataset}/{shard}")
        conda:
            ENV_CPU
        params:
            model=lambda wc, input: target_model_dir(input.model),
            target=TOKENIZER_IDENTITY,  # reruns the job when the target changes in place (rules/common.smk)
            settings=stage_settings("tokenize", trivial_tokens=config["audit"]["trivial_response_tokens"], **TRUST),
        shell:
            "dflash-pipeline tokenize --input {input.conversations:q} --model {params.model:q} --out {output.tokens:q} "
            "--audit {output.audit:q} --settings {params.settings:q} > {log:q} 2>&1"

else:

    # one process per group of shards: the tokenizer (seconds for a 248K vocabulary) loads once per group
    rule tokenize_group:
        input:
            conversations=lambda wc: [
                shard_conversations(SimpleNamespace(dataset=wc.dataset, shard=s))
                for s in shard_group_members(wc.shardgroup)
            ],
            verdicts=regenerated_settled,
            model=target_model_files(),
        output:
            directory(os.path.join(R, "tokens/{dataset}/groups/{shardgroup}")),
        log:
            log("tokenize/{dataset}/{shardgroup}"),
        benchmark:
            bench("tokenize/{dataset}/{shardgroup}")
        wildcard_constraints:
            shardgroup=r"[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*?-j\d{5}",
        conda:
            ENV_CPU
        params:
            model=lambda wc, input: target_model_dir(input.model),
            target=TOKENIZER_IDENTITY,  # reruns the job when the target changes in place (rules/common.smk)
            settings=stage_settings("tokenize", trivial_tokens=config["audit"]["trivial_response_tokens"], **TRUST),
        shell:
            "dflash-pipeline tokenize --input {input.conversations:q} --model {params.model:q} --out-dir {output:q} "
            "--settings {params.settings:q} > {log:q} 2>&1"

    rule tokens_from_group:
        input:
            group=lambda wc: os.path.join(R, f"tokens/{wc.dataset}/groups/{shard_group_of(wc.shard)}"),
            verdicts=regenerated_settled,
        output:
            tokens=os.path.join(R, "tokens/{dataset}/{shard}.parquet"),
            audit=os.path.join(R, "tokens/{dataset}/{shard}.audit.json"),
        log:
            log("tokenize/{dataset}/{shard}"),
        conda:
            ENV_CPU
        shell:
            "(ln -f {input.group:q}/{wildcards.shard}.parquet {output.tokens:q} || cp {input.group:q}/{wildcards.shard}.parquet {output.tokens:q}) && "
            "(ln -f {input.group:q}/{wildcards.shard}.audit.json {output.audit:q} || cp {input.group:q}/{wildcards.shard}.audit.json {output.audit:q}) > {log:q} 2>&1"
