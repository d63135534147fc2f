# DFlash drafter pipeline. Stages: ingest -> tokenize + audit (gate) -> generate -> tokenize + audit (gate)
# -> extract -> train -> export -> evaluate. Rules are thin: each calls `dflash-pipeline STAGE ...`.
import os
import shlex
import shutil
import sys

from snakemake.utils import min_version, validate

from dflash_pipeline import settings
from dflash_pipeline.planning import preflight

min_version("9.0")


# defaults; a user config given with --configfile is merged over them
configfile: os.path.join(workflow.basedir, "config/config.yaml")


# The schema ships with the package (one file states every default, for the workflow and a stage run by hand).
# A misspelled key is one line per mistake (Snakemake's own message prints the whole schema after it).
CONFIG_PROBLEMS = preflight.schema_errors(config, settings.SCHEMA_PATH)
if CONFIG_PROBLEMS:
    raise WorkflowError("\n".join(CONFIG_PROBLEMS))
validate(config, str(settings.SCHEMA_PATH))  # fills in the schema's defaults

# Every rule calls a stage of the project's command, `dflash-pipeline`. When snakemake runs from a venv that is
# not on PATH, the jobs (local, or a snakemake re-run inside a cluster job) find it beside the interpreter.
if shutil.which("dflash-pipeline") is None:
    shell.prefix(f'export PATH={shlex.quote(os.path.dirname(sys.executable))}:"$PATH"; ')


include: "rules/common.smk"
include: "rules/verdicts.smk"


# the runtime settings, set in every Snakemake process that parses the workflow: the jobs it starts inherit them
# (not params: changing one reruns nothing; settings/rule_params.py)
os.environ.update(PARAMS.job_environment())


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


# after every rule exists: the seconds of checks that stop a doomed run before its first job, every mistake in
# one run (README: "Before the first run"; planning/preflight.py)
PREFLIGHT_PROBLEMS = preflight.before_first_job(
    workflow,
    config,
    path_problems=PATHS.problems,
    results=R,
    inputs=RAW_INPUTS,
    built_inputs=set(demo_data_files(RAW_INPUTS)),
    target=TARGET.preflight_path(),
    argv=sys.argv[1:],
    env=os.environ,
    cwd=os.getcwd(),
)
if PREFLIGHT_PROBLEMS:
    raise WorkflowError(preflight.stop_message(PREFLIGHT_PROBLEMS))


# the console's last line points at what to read
onsuccess:
    if os.path.exists(os.path.join(R, "report/summary.html")):
        print(f"\nThe run's summary: {os.path.join(R, 'report/summary.html')}")
