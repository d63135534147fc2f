# What the console says beyond Snakemake's own lines: where the whole plan is after a dry run (below), and the
# failed stage's own error line (the onerror handler in the Snakefile).
import atexit


# A dry run lists only the jobs known before its checkpoints (the manifest's shards, the gates): the rest show as
# <TBD>. Its last line says where the whole plan is (no hook runs after a dry run, hence atexit).
def dry_run_hint():
    if not workflow.dryrun or not any(job.is_checkpoint for job in workflow.dag.jobs):
        return
    preview = os.path.join(R, "preview.txt")
    ready = f"; it exists: cat {preview}" if os.path.exists(preview) else ""
    print(
        f"\nThis dry run lists only the jobs known before its checkpoints (the rest show as <TBD>). The whole "
        f"plan, stage by stage (samples, tokens, hidden-state bytes, GPU-hours and dollars): {preview}, written by "
        f"CPU jobs only (no GPU): the same command with {preview} as its target (before --configfile) and "
        f"without -n{ready}",
        file=sys.stderr,
    )


if not (workflow.remote_exec or workflow.subprocess_exec):
    atexit.register(dry_run_hint)
