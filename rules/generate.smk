# Generation: regenerate every assistant answer with the target, exactly once per sample, resumably.
# Per shard: completions/{shard}.parquet (+ .summary.json). A job's journal (completions/journal/) is not a
# declared output, so a failed or killed job keeps its finished samples and the rerun sends only the rest.
#
# Server start-up (minutes for a 27B model) is paid once per *job*, not per shard: with
# generate.shards_per_job = K > 1 one job takes the K consecutive shards of a source file (a group), starts its
# servers once and keeps them saturated across shard boundaries; a cheap rule then copies each shard's file out.
# With backend `servers` the servers are long-lived (started outside the workflow) and cost nothing per job.


GEN = config["generate"]
GEN_HF = GEN.get("hf") or {}
GEN_SGLANG = GEN.get("sglang") or {}


wildcard_constraints:
    gengroup=r"[A-Za-z0-9_.]+-g\d{5}",


def _opt(flag, value):
    return f"{flag} {value}" if value not in (None, "", []) else ""


def _generate_flags():
    """The stage's command-line flags from config `generate:` (everything but the files)."""
    g = GEN
    flags = [
        f"--backend {g['backend']}",
        f"--max-new-tokens {g['max_new_tokens']}",
        f"--temperature {g['temperature']}",
        f"--top-p {g['top_p']}",
        f"--top-k {g['top_k']}",
        _opt("--seed", g.get("seed")),
        "--enable-thinking" if g["enable_thinking"] else "--no-enable-thinking",
        f"--turns {g['turns']}",
        f"--on-length {g['on_length']}",
        f"--length-retry-max-new-tokens {g['length_retry_max_new_tokens']}",
        f"--max-retries {g['max_retries']}",
        f"--empty-retries {g['empty_retries']}",
        "" if g["retry_failed"] else "--no-retry-failed",
        f"--flush-every {g['journal_flush_every']}",
        f"--progress-interval {g['progress_interval_s']}",
        f"--api {g['api']}",
        f"--max-in-flight {g['max_in_flight']}",
        f"--request-timeout {g['request_timeout_s']}",
        f"--all-down-timeout {g['all_down_timeout_s']}",
        _opt("--model-name", shlex.quote(g["model_name"]) if g.get("model_name") else ""),
        "--trust-remote-code" if config["target"].get("trust_remote_code") else "",
    ]
    if g["backend"] == "hf":
        flags += [
            f"--batch-size {GEN_HF.get('batch_size', 32)}",
            f"--device {GEN_HF.get('device', 'cpu')}",
            f"--dtype {GEN_HF.get('dtype', 'auto')}",
            _opt("--threads", GEN_HF.get("threads")),
            _opt("--context-length", GEN_HF.get("context_length")),
        ]
    elif g["backend"] == "servers":
        if not g["servers"]:
            raise WorkflowError("generate.backend is 'servers' but generate.servers lists no endpoint")
        flags.append("--servers " + " ".join(shlex.quote(u) for u in g["servers"]))
    else:
        if g["gpus"] < 1:
            raise WorkflowError("generate.backend is 'sglang' but generate.gpus is 0: give each job its GPUs "
                                "(tp_size x dp_size x instances)")
        flags.append("--sglang-json " + shlex.quote(json.dumps(GEN_SGLANG, sort_keys=True)))
    mirror = GEN.get("journal_mirror") or ""
    prefix = getattr(workflow.storage_settings, "default_storage_prefix", None) or ""
    if not mirror and str(prefix).startswith("s3://"):
        mirror = f"{str(prefix).rstrip('/')}/{R}/completions/journal"  # outputs on S3: journals follow them
    flags.append(_opt("--journal-mirror", shlex.quote(mirror) if mirror else ""))
    return " ".join(f for f in flags if f)


GEN_FLAGS = _generate_flags() if GEN["enabled"] else ""
GEN_ENV = ENV_GPU if GEN["backend"] == "sglang" else ENV_CPU
GEN_RESOURCES = dict(gpu=GEN["gpus"], runtime=GEN["runtime_min"], mem_mb=GEN["mem_mb"])


def _gen_group_of(shard):
    src, k = shard.rsplit("-", 1)
    return f"{src}-g{int(k) // GEN['shards_per_job']:05d}"


def _gen_group_members(gengroup):
    return [s for s in shard_ids() if _gen_group_of(s) == gengroup]


if GEN["enabled"] and GEN["shards_per_job"] == 1:

    rule generate:
        input:
            shard=os.path.join(R, "ingest/shards/{shard}.parquet"),
            # ancient: the gate must have passed, but its rewrite (another shard changed) redoes no generation
            gate=ancient(os.path.join(R, "audit/source/gate.ok")),
            model=target_model_files(),
        output:
            completions=os.path.join(R, "completions/{shard}.parquet"),
            summary=os.path.join(R, "completions/{shard}.summary.json"),
        params:
            model=lambda wc, input: target_model_dir(input.model),
            journal=os.path.join(R, "completions/journal"),
            server_logs=lambda wc: log(f"generate/{wc.shard}.servers").removesuffix(".log"),
            flags=GEN_FLAGS,
        resources:
            **GEN_RESOURCES,
        log:
            log("generate/{shard}"),
        benchmark:
            bench("generate/{shard}")
        conda:
            GEN_ENV
        shell:
            "{PKG} with-gpus --n {resources.gpu} -- {PKG} generate --input {input.shard:q} --out {output.completions:q} --model {params.model:q} "
            "--journal-dir {params.journal:q} --server-log-dir {params.server_logs:q} {params.flags} > {log:q} 2>&1"

elif GEN["enabled"]:

    rule generate_group:
        input:
            shards=lambda wc: expand(os.path.join(R, "ingest/shards/{shard}.parquet"),
                                     shard=_gen_group_members(wc.gengroup)),
            # ancient: the gate must have passed, but its rewrite (another shard changed) redoes no generation
            gate=ancient(os.path.join(R, "audit/source/gate.ok")),
            model=target_model_files(),
        output:
            directory(os.path.join(R, "completions/groups/{gengroup}")),
        params:
            model=lambda wc, input: target_model_dir(input.model),
            outs=lambda wc, output: [os.path.join(output[0], f"{s}.parquet") for s in _gen_group_members(wc.gengroup)],
            journal=os.path.join(R, "completions/journal"),
            server_logs=lambda wc: log(f"generate/{wc.gengroup}.servers").removesuffix(".log"),
            flags=GEN_FLAGS,
        resources:
            **GEN_RESOURCES,
        log:
            log("generate/{gengroup}"),
        benchmark:
            bench("generate/{gengroup}")
        conda:
            GEN_ENV
        shell:
            "{PKG} with-gpus --n {resources.gpu} -- {PKG} generate --input {input.shards:q} --out {params.outs:q} --model {params.model:q} "
            "--journal-dir {params.journal:q} --server-log-dir {params.server_logs:q} {params.flags} > {log:q} 2>&1"

    rule completions_from_group:
        input:
            lambda wc: os.path.join(R, f"completions/groups/{_gen_group_of(wc.shard)}"),
        output:
            completions=os.path.join(R, "completions/{shard}.parquet"),
            summary=os.path.join(R, "completions/{shard}.summary.json"),
        log:
            log("generate/{shard}.copy"),
        shell:
            "(cp {input:q}/{wildcards.shard}.parquet {output.completions:q} && "
            "cp {input:q}/{wildcards.shard}.summary.json {output.summary:q}) > {log:q} 2>&1"
