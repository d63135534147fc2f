# A GGUF target is converted once into a transformers directory under the results (README: Real target (GGUF));
# every stage reads that directory. A transformers directory as target.model_path needs no rule.

if TARGET.is_gguf and not config["demo"]["enabled"]:

    rule target_import:
        input:
            TARGET.path,
        output:
            target_model_files(),
        log:
            log("target_import"),
        benchmark:
            bench("target_import")
        conda:
            ENV_CPU
        params:
            out_dir=lambda wc, output: os.path.dirname(output[0]),
            dtype=config["target"]["gguf_dtype"],
        shell:
            "dflash-pipeline target-import --gguf {input:q} --out {params.out_dir:q} --dtype {params.dtype} > {log:q} 2>&1"
