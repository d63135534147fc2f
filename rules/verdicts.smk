# Verdicts: the gates and the plan decide whether a job may run, not what it reads. Jobs wait for these
# checkpoints through input functions that return no file (after()), so a rewritten verdict redoes no job.

from snakemake.exceptions import IncompleteCheckpointException


def after(aggregate, **wildcards):
    """For an input function: wait for an aggregate that decides rather than feeds (a gate, the plan), without
    taking its file as an input. Its rewrite (a shard added elsewhere, a touch, the same verdict again) then
    redoes no per-shard job, in the same invocation: a job that asks is re-evaluated once the checkpoint has
    run. (Not ancient(): jobs behind an ancient() input of a rerunning job are never re-evaluated for their own
    changes in that invocation, snakemake/snakemake#4166.) A failed gate stops the run before them."""
    aggregate.get(**wildcards)
    return []


def generation_gates(wildcards):
    return after(checkpoints.gate, dataset="source") + after(checkpoints.generation_gate)


def settled(wildcards):
    """Every verdict upstream of a job after generation, in order, waited for. Snakemake keeps the reason it
    gave a job while something upstream was pending; only the jobs that asked a checkpoint are re-evaluated
    when it has run. So every job downstream of a verdict asks for it too, not only the first one."""
    verdicts = generation_gates(wildcards) if GEN["enabled"] else []
    return verdicts + after(checkpoints.gate, dataset=training_dataset()) + after(checkpoints.plan)


_PLANNED = JsonFileCache(planned_values, download=True)


def planned():
    """What the plan resolved for every later stage (the target's layer ids, the mask token:
    rule_params.planned_values), for a param: a changed value reruns the job, a rewritten plan with the same
    values does not. Every rule that reads it waits for the plan through settled(), and is re-evaluated once the
    plan has run, so the empty answer of a pending plan never reaches a job."""
    try:
        return _PLANNED.get(checkpoints.plan.get().output.json)
    except IncompleteCheckpointException:
        return {}


def regenerated_settled(wildcards):
    """settled() for the jobs between generation and its gate (the regenerated dataset's tokenize, audit)."""
    return generation_gates(wildcards) if wildcards.dataset == "regenerated" else []


def generation_calibration(wildcards):
    """The calibration a generation job compares its live rate with. ancient(), and only once the generation
    gate has run: a recalibration reruns the plan and that gate first, so its producer never reruns behind it."""
    checkpoints.generation_gate.get()
    return ancient(CALIBRATION)


def train_verdicts(wildcards):
    return settled(wildcards)
