# Tokenize a shard with the target's chat template and an assistant-only loss mask, plus its audit.


rule tokenize:
    input:
        conversations=shard_conversations,
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
        settings=stage_settings("tokenize", trivial_tokens=config["audit"]["trivial_response_tokens"], **TRUST),
    shell:
        "dflash-pipeline tokenize --input {input.conversations:q} --model {params.model:q} --out {output.tokens:q} "
        "--audit {output.audit:q} --settings {params.settings:q} > {log:q} 2>&1"
