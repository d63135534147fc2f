# The demo's raw data and tiny target are built by rules, so a fresh clone needs no download. Their outputs are
# the demo's own paths only (data/demo/, resources/demo-target/): a user's model or input is never written.

if config["demo"]["enabled"]:

    rule demo_data:
        output:
            demo_data_files(RAW_INPUTS),
        log:
            log("demo_data"),
        conda:
            ENV_CPU
        params:
            out_dir=lambda wc, output: os.path.dirname(output[0]),
            records=config["demo"]["records"],
            placeholder_rate=config["demo"]["placeholder_rate"],
        shell:
            "dflash-pipeline demo-data --out {params.out_dir:q} --records {params.records} "
            "--placeholder-rate {params.placeholder_rate} > {log:q} 2>&1"

    rule tiny_target:
        output:
            demo_target_files(),
        log:
            log("tiny_target"),
        benchmark:
            bench("tiny_target")
        conda:
            ENV_CPU
        params:
            out_dir=lambda wc, output: os.path.dirname(output[0]),
            pretrain_steps=config["demo"]["target_pretrain_steps"],
        shell:
            "dflash-pipeline tiny-model --out {params.out_dir:q} --pretrain-steps {params.pretrain_steps} > {log:q} 2>&1"
