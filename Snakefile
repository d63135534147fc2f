# DFlash drafter pipeline. Stages: ingest -> tokenize + audit (gate) -> generate -> tokenize + audit (gate)
# -> extract -> train -> export -> evaluate. Rules are thin: each calls `dflash-pipeline STAGE ...`.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "rules/common.smk"
include: "rules/demo.smk"
include: "rules/ingest.smk"
include: "rules/tokenize.smk"
include: "rules/audit.smk"


rule all:
    default_target: True
    input:
        final_targets(),
