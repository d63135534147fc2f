"""One command, one sub-command per stage: `dflash-pipeline STAGE --help`.

Stage modules are imported lazily so that `dflash-pipeline ingest` does not pay for importing torch.
Each stage module exposes `add_arguments(parser)` and `run(args) -> int | None`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from dflash_pipeline import storage
from dflash_pipeline.errors import PipelineError

STAGES = {
    "demo-data": ("dflash_pipeline.demo.data", "write the bundled demo conversations"),
    "tiny-model": ("dflash_pipeline.demo.tiny_model", "build a tiny random Qwen3 target with a real tokenizer"),
    "ingest": ("dflash_pipeline.data.ingest", "normalize one raw ShareGPT file into per-file records + quarantine"),
    "manifest": ("dflash_pipeline.data.manifest", "deduplicate across files and assign shards"),
    "shard": ("dflash_pipeline.data.manifest", "write one ingested shard"),
    "tokenize": ("dflash_pipeline.data.tokenize", "chat-template a shard into tokens + assistant loss mask"),
    "audit": ("dflash_pipeline.data.audit", "aggregate per-shard audits into a report (JSON + HTML)"),
    "gate": ("dflash_pipeline.data.audit", "pass or fail the data-quality gate from an audit report"),
    "generate": ("dflash_pipeline.generation.stage", "regenerate responses with the target (sglang / servers / hf)"),
    "extract": ("dflash_pipeline.hidden_states.extract", "extract target hidden states into a shard file"),
    "plan": ("dflash_pipeline.planning.plan", "print samples, tokens, bytes and GPU hours before the GPU starts"),
    "hidden-verify": ("dflash_pipeline.hidden_states.shard_format", "check hidden-state shards (footer, index, every checksum)"),
    "train": ("dflash_pipeline.drafter.train", "train the DFlash drafter"),
    "export": ("dflash_pipeline.drafter.export", "export an engine-loadable drafter checkpoint"),
    "evaluate": ("dflash_pipeline.drafter.evaluate", "acceptance length of the drafter against the target"),
    "evaluate-gate": ("dflash_pipeline.drafter.evaluate", "fail unless the trained drafter clearly beats an untrained one"),
    "with-gpus": ("dflash_pipeline.cluster.gpu_slots", "run a command on N distinct free GPUs (sets CUDA_VISIBLE_DEVICES)"),
    "launch-torchrun": ("dflash_pipeline.cluster.launch_torchrun", "launch a command under torchrun (multi-node inside SLURM)"),
    "report-figures": ("dflash_pipeline.report.figures", "figures and tables for `snakemake --report`"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="dflash-pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in STAGES.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:  # import only the module that will run
            module = importlib.import_module(module_name)
            adder = getattr(module, f"add_{name.replace('-', '_')}_arguments", None) or module.add_arguments
            adder(p)
            runner = getattr(module, f"run_{name.replace('-', '_')}", None) or module.run
            p.set_defaults(_run=runner)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args._run(args) or 0)
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        # an S3 failure deep inside a stage (mirror, ranged read): one line, not a botocore traceback
        if not storage.is_botocore_error(exc):
            raise
        print(f"error: S3 request failed: {storage.redact_credentials(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
