"""`train.labels: distill`: the soft cross-entropy against the target's next-token distribution (head_loss.py) and
the target's final hidden states that give it (features.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_pipeline.drafter.head_loss import chunk_spans, head_cross_entropy, head_soft_cross_entropy


def _case(t=37, h=16, v=301, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h, generator=g), torch.randn(v, h, generator=g) * 0.5, torch.randn(t, h, generator=g))


@pytest.mark.parametrize("chunk", [5, 16, 64])
def test_chunked_soft_ce_equals_the_plain_path_values_and_gradients(chunk):
    hidden, weight, target_hidden = _case()
    a = hidden.clone().requires_grad_()
    ce_a, top_a, y_a, nll_a = head_soft_cross_entropy(a, weight, target_hidden, 0)
    (ce_a * torch.linspace(0.1, 1.0, len(ce_a))).sum().backward()
    b = hidden.clone().requires_grad_()
    ce_b, top_b, y_b, nll_b = head_soft_cross_entropy(b, weight, target_hidden, chunk)
    (ce_b * torch.linspace(0.1, 1.0, len(ce_b))).sum().backward()
    assert torch.allclose(ce_a, ce_b, atol=1e-5) and torch.equal(top_a, top_b) and torch.equal(y_a, y_b)
    assert torch.allclose(a.grad, b.grad, atol=1e-5)
    with torch.no_grad():  # without a gradient to keep: the same values by the cheaper path
        ce_c, top_c, y_c, nll_c = head_soft_cross_entropy(hidden, weight, target_hidden, chunk)
    assert torch.allclose(ce_c, ce_a.detach(), atol=1e-5) and torch.equal(top_c, top_a) and torch.equal(y_c, y_a)
    # the definition: -sum_v p_v log q_v, p the target's softmax through the same head
    p = torch.softmax(target_hidden @ weight.T, -1)
    ref = -(p * torch.log_softmax(hidden @ weight.T, -1)).sum(-1)
    assert torch.allclose(ce_a, ref, atol=1e-5) and torch.equal(y_a, p.argmax(-1))
    # D-PACE's estimate: -log q of the target's greedy token, the same on every path, with no gradient
    log_q = torch.log_softmax(hidden @ weight.T, -1)
    nll_ref = -log_q.gather(1, y_a[:, None]).squeeze(1)
    for nll in (nll_a, nll_b, nll_c):
        assert torch.allclose(nll, nll_ref, atol=1e-5) and not nll.requires_grad


@pytest.mark.parametrize("chunk", [0, 4, 16, 64])
def test_each_position_read_once_gives_the_per_token_values_and_gradients(chunk):
    """Overlapping blocks score a position many times: the target's rows passed once each with every token's row
    (`inverse`, and per chunk the span it reads) give exactly what one row per token gives."""
    hidden, weight, rows = _case(t=37)
    g = torch.Generator().manual_seed(1)
    inverse = torch.sort(torch.randint(0, 12, (37,), generator=g)).values  # sorted, as sorted anchors give
    inverse[5] = 11  # and a token out of order: spans stay right, only wider
    expanded = rows[:12][inverse]
    outs = []
    for target, inv in ((expanded, None), (rows[:12], inverse)):
        h = hidden.clone().requires_grad_()
        ce, top, y, nll = head_soft_cross_entropy(h, weight, target, chunk, inv)
        (ce * torch.linspace(0.1, 1.0, len(ce))).sum().backward()
        outs.append((ce, top, y, nll, h.grad))
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-6) if a.is_floating_point() else torch.equal(a, b)
    if chunk:
        spans = chunk_spans(inverse, chunk)
        assert len(spans) == -(-37 // chunk) and spans[0] == (0, int(inverse[:chunk].max()) + 1)
        again = head_soft_cross_entropy(hidden, weight, rows[:12], chunk, inverse, spans)
        assert torch.allclose(again[0], outs[0][0].detach(), atol=1e-6)


def test_a_sharp_target_distribution_is_the_hard_label_and_a_flat_one_is_not():
    hidden, weight, target_hidden = _case()
    sharp = target_hidden * 200.0  # a near one-hot distribution on the target's argmax
    ce_soft, _, y, _ = head_soft_cross_entropy(hidden, weight, sharp, 8)
    ce_hard, _ = head_cross_entropy(hidden, weight, y, 8)
    assert torch.allclose(ce_soft, ce_hard, atol=1e-3)
    ce_flat, _, _, _ = head_soft_cross_entropy(hidden, weight, torch.zeros_like(target_hidden), 8)
    uniform = -torch.log_softmax(hidden @ weight.T, -1).mean(-1)
    assert torch.allclose(ce_flat, uniform, atol=1e-5) and not torch.allclose(ce_flat, ce_hard, atol=1e-2)


def test_the_gradient_points_to_the_target_distribution():
    """Descending the soft CE moves the drafter's distribution onto the target's (the KL falls to ~0), which
    one sampled label per position would not do."""
    _, weight, target_hidden = _case(t=8)
    h = torch.zeros_like(target_hidden, requires_grad=True)
    opt = torch.optim.Adam([h], lr=0.05)
    p = torch.softmax(target_hidden @ weight.T, -1)

    def kl():
        with torch.no_grad():
            return float(F.kl_div(torch.log_softmax(h @ weight.T, -1), p, reduction="batchmean"))

    start = kl()
    for _ in range(400):
        opt.zero_grad()
        head_soft_cross_entropy(h, weight, target_hidden, 3)[0].mean().backward()
        opt.step()
    assert kl() < 0.02 * start


def test_next_hidden_through_the_head_is_the_targets_own_next_token_distribution(tiny_target):
    """The hidden state kept for position t is the one the target's head reads to predict token t: through the
    head it gives the target's logits at t - 1 (so its argmax is `labels: target`'s token)."""
    from transformers import AutoModelForCausalLM

    from dflash_pipeline.drafter.features import (target_features, target_features_and_next_hidden,
                                                  target_features_and_predictions)

    target = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (2, 24), generator=g)
    lengths = torch.tensor([24, 17])
    layers = [0, 1]
    feats, nxt = target_features_and_next_hidden(target, ids, lengths, layers)
    assert torch.equal(feats, target_features(target, ids, lengths, layers))
    _, pred = target_features_and_predictions(target, ids, lengths, layers)
    with torch.no_grad():
        logits = target(input_ids=ids, attention_mask=(torch.arange(24)[None] < lengths[:, None]).long()).logits
        via_head = target.lm_head(nxt)
    for b, n in enumerate(lengths.tolist()):
        assert torch.allclose(via_head[b, 1:n], logits[b, :n - 1], atol=1e-4)
        assert torch.equal(via_head[b, 1:n].argmax(-1), pred[b, 1:n])
    assert not nxt[:, 0].any()


def test_the_distill_speed_benchmark_runs_its_variants_and_checks_they_agree():
    """benchmarks/distill_head_speed.py (the GPU side-by-side of hard, soft and soft-once steps) on CPU, tiny."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root / 'scripts'}{os.pathsep}{root / 'benchmarks'}"}
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "distill_head_speed.py"), "--tiny", "--device",
                           "cpu"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "check soft-once vs soft" in proc.stdout
    table = [line.split("|") for line in proc.stdout.splitlines() if line.startswith(("hard ", "soft ", "soft-once"))]
    assert [row[0].strip() for row in table] == ["hard", "soft", "soft-once"]
    assert all(float(row[1]) > 0 for row in table)
