"""The slot engine's live-column decode attention (generation/live_attention): its torch reference equals the
masked SDPA path; the pool keeps each row's first live column in step with the mask through refills,
compaction and shifts; a pool decoding through the live-range path gives the masked path's greedy tokens; the
Triton kernel itself (interpreter mode on CPU; skipped without triton) equals the reference."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_pipeline.generation import live_attention
from dflash_pipeline.generation.live_attention import reference
from dflash_pipeline.generation.slot_decode import Request, slot_attention, use_slot_attention
from dflash_pipeline.generation.slot_pool import SlotScheduler

# rows: a full row, one live column (start = t), stale starts past t (a free row: reads column t only), chunk
# edges around 64 / 128 / 256
STARTS = [0, 280, 17, 255, 400, 64, 127, 129, 1]
T = 280


def _inputs(dtype, dim=64, kv=2, group=3, width=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = len(STARTS)
    q = torch.randn(rows, kv * group, 1, dim, generator=gen).to(dtype)
    k = torch.randn(rows, kv, width, dim, generator=gen).to(dtype)
    v = torch.randn(rows, kv, width, dim, generator=gen).to(dtype)
    return q, k, v, torch.tensor(STARTS, dtype=torch.int32), torch.tensor([T])


def _masked(q, k, v, start, pos, scale):
    """The pool's mask for these starts: 0 on [min(start, t), t], the dtype's min elsewhere; through SDPA."""
    t, width = int(pos), k.shape[2]
    cols = torch.arange(width)
    live = (cols >= start.clamp(max=t).unsqueeze(1)) & (cols <= t)
    mask = torch.where(live, 0.0, torch.finfo(q.dtype).min).to(q.dtype)[:, None, None, :]
    out, _ = slot_attention(None, q, k, v, mask, scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("group", [1, 3])
def test_reference_equals_masked_sdpa(group):
    q, k, v, start, pos = _inputs(torch.float32, group=group)
    torch.testing.assert_close(reference(q, k, v, start, pos, 0.125), _masked(q, k, v, start, pos, 0.125),
                               atol=1e-5, rtol=1e-5)


def _tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=1024)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()
    use_slot_attention(model)
    return model


def _requests(n=14, seed=1):
    rng = random.Random(seed)
    return [Request(prompt=[rng.randrange(3, 300) for _ in range(rng.randint(1, 30))], budget=rng.randint(2, 40),
                    seed=i) for i in range(n)]


def _run(model, mode, check=None):
    """14 requests through 4 slots of 48 columns (refills, compaction, right shifts) and a wide pool."""
    sched = SlotScheduler(model, set(), rows=4, width=48, context=128, min_refill=1, decode_attention=mode)
    if check:
        for pool_name in ("main",):
            pool = getattr(sched, pool_name)
            step = pool.step
            pool.step = lambda step=step, pool=pool: (step(), check(pool))
    with torch.inference_mode():
        done = sched.run(_requests())
    return {tuple(r.prompt): r.tokens for r in done}, sched


def test_row_start_follows_the_mask_through_refills_and_compaction():
    model = _tiny_model()
    seen = []

    def check(pool):
        t = pool.t - 1  # the column the step wrote
        for r in pool.slots:
            if r is not None and pool.live[r.slot]:
                live = (pool.mask[r.slot, 0, 0] == 0).nonzero().flatten().tolist()
                assert live == list(range(int(pool.cache.start[r.slot]), t + 1)) and r.start == live[0]
                seen.append(len(live))

    _, sched = _run(model, "sdpa", check)
    assert sched.main.shifts > 0 and min(seen) == 2 and max(seen) >= 40


def test_a_pool_through_the_live_range_path_gives_the_masked_tokens(monkeypatch):
    """The wiring (the key buffer's tag, `start`, the output layout) with the torch reference as the kernel."""
    model = _tiny_model()
    masked, _ = _run(model, "sdpa")
    calls = []

    def fake_kernel(*args):
        calls.append(1)
        return reference(*args)

    monkeypatch.setattr(live_attention, "triton_importable", lambda: True)
    monkeypatch.setattr(live_attention, "attend_live", fake_kernel)
    live, sched = _run(model, "triton")
    assert live == masked and len(calls) >= 2 * sched.main.step_count
    assert sched.main.live_attention.name == "triton live columns"


def test_modes():
    start, pos = torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.long)
    assert not live_attention.LiveAttention("auto", torch.device("cpu"), start, pos).enabled
    assert not live_attention.LiveAttention("sdpa", torch.device("cpu"), start, pos).enabled
    with pytest.raises(ValueError):
        live_attention.LiveAttention("flash", torch.device("cpu"), start, pos)


def _kernel_cases():
    """Run in a process started with TRITON_INTERPRET=1 (read when the kernels are defined): kernel vs reference."""
    out = []
    for dtype, group, dim, chunk in [(torch.float32, 3, 64, 128), (torch.bfloat16, 3, 64, 256),
                                     (torch.float32, 1, 48, 64)]:
        q, k, v, start, pos = _inputs(dtype, dim=dim, group=group)
        got = live_attention.attend_live(q, k, v, start, pos, 0.125, chunk=chunk).float()
        out.append((str(dtype), (got - reference(q, k, v, start, pos, 0.125).float()).abs().max().item()))
    return out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernel_equals_the_reference_in_the_interpreter():
    code = "import json, test_live_attention as t; print(json.dumps(t._kernel_cases()))"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(__file__).parent, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    for dtype, diff in json.loads(res.stdout.strip().splitlines()[-1]):
        assert diff < (1e-5 if dtype == "torch.float32" else 1e-2), (dtype, diff)


def test_the_environment_overrides_auto_only(monkeypatch):
    """DFLASH_DECODE_ATTENTION picks the mode an `auto` engine runs (an operator's switch); an explicit mode stays."""
    import pytest as _pytest

    from dflash_pipeline.generation.live_attention import ENV_MODE, LiveAttention

    start, pos = torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.long)
    monkeypatch.setattr(live_attention, "triton_importable", lambda: True)  # as on a GPU machine
    monkeypatch.delenv(ENV_MODE, raising=False)
    assert LiveAttention("auto", torch.device("cuda"), start, pos).enabled
    monkeypatch.setenv(ENV_MODE, "sdpa")
    assert not LiveAttention("auto", torch.device("cuda"), start, pos).enabled
    monkeypatch.setenv(ENV_MODE, "bogus")
    with _pytest.raises(ValueError, match="decode_attention must be one of"):
        LiveAttention("auto", torch.device("cpu"), start, pos)
    assert not LiveAttention("sdpa", torch.device("cpu"), start, pos).enabled
