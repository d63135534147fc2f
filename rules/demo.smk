# The demo's raw data and tiny target are built by rules, so a fresh clone needs no download.

if config["demo"]["enabled"]:

    rule demo_data:
        output:
            [path for path in RAW_INPUTS.values() if path.startswith("data/demo/")],
        params:
            records=config["demo"]["records"],
            placeholder_rate=config["demo"]["placeholder_rate"],
        log:
            log("demo_data"),
        conda:
            ENV_CPU
        shell:
            "{PKG} demo-data --out \"$(dirname {output[0]:q})\" --records {params.records} "
            "--placeholder-rate {params.placeholder_rate} > {log:q} 2>&1"

    rule tiny_target:
        output:
            target_model_files(),
        params:
            pretrain_steps=config["demo"].get("target_pretrain_steps", 0),
        log:
            log("tiny_target"),
        benchmark:
            bench("tiny_target")
        conda:
            ENV_CPU
        shell:
            "{PKG} tiny-model --out \"$(dirname {output[0]:q})\" --pretrain-steps {params.pretrain_steps} > {log:q} 2>&1"
