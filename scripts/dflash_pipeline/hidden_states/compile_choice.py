"""extract.compile=auto, decided the same way by the extraction job and by the plan that projects it (no torch)."""

from __future__ import annotations

# compile=auto compiles a job of at least this many tokens (benchmarks/extract_compile_auto.py, docs/extraction.md):
# compilation costs seconds to tens of seconds whatever the shard; it paid back from ~5.2M tokens on the 135M
# SmolLM2 shape (H200: eager 494K tok/s launch-bound, compiled ~2.4M tok/s, +8 s to compile) and ~2.4M on the
# Qwen3-8B shape (1.3x, ~25 s); a 640-sequence shard of the 135M ran 2.8x slower compiled
COMPILE_MIN_TOKENS = 5_000_000


def should_compile(setting, device: str, tokens: float) -> bool:
    """compile=auto: on a GPU, for a job with enough tokens to amortise the compilation."""
    if setting != "auto":
        return bool(setting)
    return device.startswith("cuda") and tokens >= COMPILE_MIN_TOKENS
