# Tokenize a shard with the target's chat template and an assistant-only loss mask, plus its audit.


def _conversations(wildcards):
    if wildcards.dataset == "source":
        return os.path.join(R, f"ingest/shards/{wildcards.shard}.parquet")
    return os.path.join(R, f"completions/{wildcards.shard}.parquet")


rule tokenize:
    input:
        conversations=_conversations,
        model=target_model_files(),
    output:
        tokens=os.path.join(R, "tokens/{dataset}/{shard}.parquet"),
        audit=os.path.join(R, "tokens/{dataset}/{shard}.audit.json"),
    params:
        model=lambda wc, input: target_model_dir(input.model),
        settings=stage_settings("tokenize", trivial_tokens=config["audit"]["trivial_response_tokens"],
                                **TRUST),
    log:
        log("tokenize/{dataset}/{shard}"),
    benchmark:
        bench("tokenize/{dataset}/{shard}")
    conda:
        ENV_CPU
    shell:
        "{PKG} tokenize --input {input.conversations:q} --model {params.model:q} --out {output.tokens:q} "
        "--audit {output.audit:q} --settings {params.settings:q} > {log:q} 2>&1"
