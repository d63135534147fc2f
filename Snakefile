# DFlash drafter pipeline. Stages: ingest -> tokenize + audit (gate) -> generate -> tokenize + audit (gate)
# -> extract -> train -> export -> evaluate. Rules are thin: each calls `dflash-pipeline STAGE ...`.
import os

from snakemake.utils import min_version

min_version("9.0")


# defaults; a user config given with --configfile is merged over them
configfile: os.path.join(workflow.basedir, "config/config.yaml")


include: "rules/common.smk"
include: "rules/verdicts.smk"


wildcard_constraints:
    src=r"[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*?",
    shard=r"[A-Za-z0-9_.-]+-\d{5}",
    dataset="|".join(DATASETS),
    gengroup=r"[A-Za-z0-9_.]+-g\d{5}",


include: "rules/demo.smk"
include: "rules/target.smk"
include: "rules/ingest.smk"
include: "rules/tokenize.smk"
include: "rules/audit.smk"
include: "rules/generate.smk"
include: "rules/calibrate.smk"
include: "rules/extract.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"
include: "rules/report.smk"
include: "rules/console.smk"


rule all:
    default_target: True
    input:
        final_output(),


# after every rule exists: the seconds of checks that stop a doomed run before its first job (rules/common.smk)
run_preflight()


# the console's last line points at what to read
onsuccess:
    if os.path.exists(os.path.join(R, "report/summary.html")):
        print(f"\nThe run's summary: {os.path.join(R, 'report/summary.html')}")
