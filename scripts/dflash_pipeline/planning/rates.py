"""The GPU rates the plan prices extraction and training with: measured on the run's GPU, or modelled.

Measured (`dflash-pipeline calibrate-rates`, planning/calibrate_rates.py, rules/calibrate.smk): real extract
batches and real training steps through the stages' own code at the run's target, drafter and settings, warm-up
excluded, plus what a job pays before its first token (python, torch, the target's load, compilation). The plan
uses these and says "measured".

Modelled (no measurement): a cost model, marked ASSUMED wherever it is shown. It counts what sets the pace at
small shapes as well as large ones:
  extract  per token 2 x (the target's parameters up to the last captured layer) FLOPs at an assumed share of
           the GPU's peak, a kernel-launch floor per layer and batch, and the host's encoding of the states;
  train    per trained position (block tokens) 6 x the drafter's layer parameters + 4 x hidden x vocabulary
           (the frozen LM head: its forward and its input gradient), at an assumed share of the peak;
  per job  a start-up (python, torch, the model's weights at an assumed disk rate).
A job's time is start-up + tokens / rate; jobs of one stage run one after another on one GPU each.
"""

from __future__ import annotations

from dflash_pipeline import settings

# what the model assumes (one H200-class GPU, bf16 dense peak); each is printed with the plan
ASSUMED = {
    "peak_tflops": 989.0,            # bf16 dense peak of an H100/H200 SXM
    "extract_mfu": 0.45,             # the target's forward, large batches (8B shape compiled measured ~44%)
    "train_mfu": 0.35,               # the drafter's step (issue 24's goal at small shapes; 51.6% at the 8B shape)
    "launch_s_per_layer": 2.5e-4,    # eager kernels of one decoder layer for one batch
    "encode_bytes_per_s_per_thread": 1.5e8,  # host encoding (zstd level 1) and writing of the states
    "startup_s": 20.0,               # python, torch, CUDA context
    "load_bytes_per_s": 2.0e9,       # the target's weights from disk into the GPU
}


def extract_flops_per_token(shape: dict, layer_ids) -> float:
    """2 x the parameters a token passes through: layers up to the last captured one (no LM head)."""
    layers_run = max(layer_ids) + 1 if layer_ids else shape["num_layers"]
    return 2.0 * shape["active_params"] * layers_run / max(shape["num_layers"], 1)


def modelled_extract(shape: dict, layer_ids, extract: dict, assumed: dict = ASSUMED) -> dict:
    """Extraction tok/s and per-job start-up from the cost model (see the module's text)."""
    budget = int(settings.value(extract, "extract.token_budget"))
    layers_run = max(layer_ids) + 1 if layer_ids else shape["num_layers"]
    gpu_s = budget * extract_flops_per_token(shape, layer_ids) / (assumed["peak_tflops"] * 1e12 * assumed["extract_mfu"])
    gpu_s += layers_run * assumed["launch_s_per_layer"]
    gpu_rate = budget / gpu_s
    bytes_per_token = len(layer_ids) * shape["hidden_size"] * 2
    host_rate = int(settings.value(extract, "extract.encode_threads")) * assumed["encode_bytes_per_s_per_thread"] / bytes_per_token
    weights = 2.0 * (shape["active_params"] + shape.get("vocab_size", 0) * shape["hidden_size"])
    return {"tok_s": min(gpu_rate, host_rate), "startup_s": assumed["startup_s"] + weights / assumed["load_bytes_per_s"],
            "bound": "GPU" if gpu_rate <= host_rate else "host encoding", "basis": "ASSUMED (cost model)"}


def drafter_layer_params(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> float:
    """One drafter decoder layer (attention over context + block, SwiGLU MLP)."""
    return hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * intermediate


def train_flops_per_position(shape: dict, drafter_layers: int) -> float:
    """FLOPs of one trained position: 6 x the drafter's layer parameters (forward, both backward products) and
    4 x hidden x vocabulary for the frozen LM head (forward, input gradient; no weight gradient)."""
    H = shape["hidden_size"]
    layer = drafter_layer_params(H, shape.get("intermediate_size", 4 * H), shape.get("num_heads", 1),
                                 shape.get("num_kv_heads", shape.get("num_heads", 1)), shape.get("head_dim", H))
    return 6.0 * drafter_layers * layer + 4.0 * H * shape.get("vocab_size", 0)


def trained_positions_per_token(mean_tokens: float, mean_answer_tokens: float, train: dict, block_size: int) -> float:
    """Block positions trained per data token: a sample trains min(num_anchors, its answer tokens) blocks of
    block_size positions (on the mean sample, cut at train.max_length)."""
    anchors = int(settings.value(train, "train.num_anchors"))
    tokens = min(mean_tokens, int(settings.value(train, "train.max_length")))
    return min(anchors, mean_answer_tokens) * block_size / tokens if tokens > 0 else 0.0


def modelled_train(shape: dict, drafter_layers: int, positions_per_token: float, assumed: dict = ASSUMED) -> dict:
    flops = train_flops_per_position(shape, drafter_layers) * positions_per_token
    rate = assumed["peak_tflops"] * 1e12 * assumed["train_mfu"] / max(flops, 1.0)
    return {"tok_s": rate, "startup_s": assumed["startup_s"] + 2.0 * shape.get("vocab_size", 0) * shape["hidden_size"]
            / assumed["load_bytes_per_s"], "flops_per_token": flops, "basis": "ASSUMED (cost model)"}


def measured_rate(rates: dict | None, stage: str) -> dict | None:
    """A stage's measured rate from a calibrate-rates result, labelled with where it was measured."""
    part = (rates or {}).get(stage) or {}
    if not part.get("tok_s"):
        return None
    return {"tok_s": float(part["tok_s"]), "startup_s": float(part.get("startup_s") or 0.0),
            "basis": f"measured on {rates.get('device', '?')} ({part.get('how', 'calibrate-rates')})"}


def extract_rates_for_jobs(rates: dict | None, compile_setting, job_tokens: float) -> dict | None:
    """`rates` with its extraction figures in the mode the run's jobs will take: calibrate-rates times eager and
    compiled extraction on a GPU under compile=auto, and the jobs choose by their own tokens (known only here,
    after the generation's projection), as hidden_states/extract.py does."""
    from dflash_pipeline.hidden_states.compile_choice import should_compile

    part = (rates or {}).get("extract") or {}
    modes = part.get("modes") or {}
    if len(modes) < 2:
        return rates
    chosen = "compiled" if should_compile(compile_setting, "cuda", job_tokens) else "eager"
    return {**rates, "extract": {**part, **modes[chosen], "compiled": chosen == "compiled"}}


def stage_time(tokens: float, rate: dict, jobs: int) -> dict:
    """A stage's job-seconds: every job pays its start-up, then the tokens at the rate."""
    seconds = jobs * rate["startup_s"] + tokens / max(rate["tok_s"], 1e-9)
    return {"jobs": jobs, "job_seconds": seconds, "gpu_hours": seconds / 3600,
            "startup_share": jobs * rate["startup_s"] / seconds if seconds else 0.0}
