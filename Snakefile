# DFlash drafter pipeline. Stages: ingest -> tokenize + audit (gate) -> generate -> tokenize + audit (gate)
# -> extract -> train -> export -> evaluate. Rules are thin: each calls `dflash-pipeline STAGE ...`.
import os

from snakemake.utils import min_version

min_version("9.0")


# defaults; a user config given with --configfile is merged over them
configfile: os.path.join(workflow.basedir, "config/config.yaml")


include: "rules/common.smk"
include: "rules/demo.smk"
include: "rules/ingest.smk"
include: "rules/tokenize.smk"
include: "rules/audit.smk"
include: "rules/generate.smk"
include: "rules/extract.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        final_targets(),
