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


# Under `--quiet rules` (make demo) Snakemake hides a failed job's block and its log: the console showed only
# `CalledProcessError ... exit status 2`. Each failed job's own error line is printed here instead.
ERROR_LINE = re.compile(r"^(error: |\w*(Error|Exception|Interrupt)\b|.*\bFAILED\b)")


def stage_error_line(path, limit=400):
    """The stage's one-line error in its log: its last `error: ...` or exception line, else its last line."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = [ln.rstrip() for ln in fh.readlines()[-200:] if ln.strip()]
    except OSError:
        return None
    if not lines:
        return None
    line = next((ln for ln in reversed(lines) if ERROR_LINE.match(ln)), lines[-1])
    return line if len(line) <= limit else line[: limit - 3] + "..."


def print_failed_stages():
    failed = getattr(getattr(workflow, "scheduler", None), "failed", None) or ()
    for job in sorted(failed, key=str):
        for one in getattr(job, "jobs", None) or [job]:  # a group job: each member
            for path in getattr(one, "log", None) or []:
                line = stage_error_line(str(path))
                if line:
                    print(f"{one.rule.name} failed: {line} (log: {path})", file=sys.stderr)


onerror:
    print_failed_stages()
