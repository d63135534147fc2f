"""Cross-entropy through the frozen LM head, chunked: the logits of all scored block tokens are never held
at once.

At the Qwen3-8B shape a step scores ~7,700 block tokens against a 151,936-row head: the plain path keeps
bf16 logits, their fp32 copy and the log-softmax for backward (~10 GB) and walks them several times. Here
the head is frozen, so the only gradient is d ce / d hidden, and each token's CE depends on its own hidden
row only: the forward computes, chunk by chunk, the CE, the argmax and d ce_t / d h_t = (softmax - onehot) W,
keeps that [T, H] gradient, and backward scales it by the incoming gradient. Same math as the plain path
(two matmuls per token, fp32 softmax), memory O(chunk x vocab).

`labels: distill` scores each token against the target's whole next-token distribution instead of one token:
the soft cross-entropy -sum_v p_v log q_v (the KL to the target plus its entropy, a constant), whose gradient
is softmax - p. The target's logits come from its final hidden state through the same frozen head, chunk by
chunk as well (a third matmul per token). A position is scored by up to block_size - 1 overlapping blocks (~9 on
average at the recipe's shape and 512 anchors: benchmarks/distill_head_speed.py), so the soft path takes the
target's rows once each (`inverse`: each scored token's row) and, per chunk, runs the head over the span of rows
that chunk reads only (`spans`, found on the host with the scored index): with sorted anchors a chunk of 2,048
scored tokens reads a few hundred rows.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def _ce_and_grad(logits: torch.Tensor, y: torch.Tensor):
    """(ce fp32, argmax, d ce / d logits = softmax - onehot in the logits' dtype) of one chunk of logits;
    on a GPU compiled into a few passes over the chunk."""
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    ce = lse - lf.gather(1, y[:, None]).squeeze(1)
    onehot = torch.arange(lf.shape[1], device=lf.device)[None, :] == y[:, None]
    grad = (lf - lse[:, None]).exp() - onehot.float()
    return ce, lf.argmax(-1), grad.to(logits.dtype)


_COMPILED: dict[str, object] = {}


def _on(device: torch.device, fn):
    """`fn` compiled on a GPU (into a few passes over the chunk), as written on CPU."""
    if device.type != "cuda":
        return fn
    if fn.__name__ not in _COMPILED:
        _COMPILED[fn.__name__] = torch.compile(fn, dynamic=None)
    return _COMPILED[fn.__name__]


def _soft_terms(lf: torch.Tensor, tf: torch.Tensor, rows: torch.Tensor | None):
    """(soft ce, argmax, the target's argmax y, -log q_y, log-sum-exp, p) of one chunk's fp32 logits: the drafter's
    `lf` [n, V] and the target's `tf`, [n, V] (one row per token) or with `rows` [n] the [R, V] rows the chunk
    reads (token t reads row rows[t]); -log q_y, the drafter's CE against the target's greedy token, is D-PACE's
    acceptance estimate."""
    lse = torch.logsumexp(lf, dim=-1)
    p, y = torch.softmax(tf, dim=-1), tf.argmax(-1)
    if rows is not None:
        p, y = p[rows], y[rows]
    return lse - (p * lf).sum(-1), lf.argmax(-1), y, lse - lf.gather(1, y[:, None]).squeeze(1), lse, p


def _soft_ce_and_grad(logits: torch.Tensor, target_logits: torch.Tensor, rows: torch.Tensor | None):
    """(soft ce fp32, argmax, the target's argmax, -log q of it, d ce / d logits = softmax - p) of one chunk."""
    lf = logits.float()
    ce, top, y, nll_y, lse, p = _soft_terms(lf, target_logits.float(), rows)
    return ce, top, y, nll_y, ((lf - lse[:, None]).exp() - p).to(logits.dtype)


def _chunk_stats(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, need_grad: bool,
                 rows: torch.Tensor | None = None):
    """(ce [n] fp32, argmax [n], label [n], -log q(label) [n], d ce / d h [n, H] or None) of one chunk of hidden
    rows. `target`: the chunk's labels (token ids; -log q(label) is then the ce), or the target's final hidden
    states (soft CE against their distribution; the label is then the target's argmax): one row per token, or
    with `rows` [n] the rows the chunk reads, each once, and the one each token reads."""
    logits = F.linear(h, weight)
    if target.is_floating_point():
        target_logits = F.linear(target.to(weight.dtype), weight)
        if not need_grad:
            ce, top, y, nll_y, _, _ = _soft_terms(logits.float(), target_logits.float(), rows)
            return ce, top, y, nll_y, None
        ce, top, y, nll_y, grad = _on(logits.device, _soft_ce_and_grad)(logits, target_logits, rows)
    else:
        y = target
        if not need_grad:
            lf = logits.float()
            ce = torch.logsumexp(lf, -1) - lf.gather(1, y[:, None]).squeeze(1)
            return ce, lf.argmax(-1), y, ce, None  # forward's torch.cat gives each output its own storage
        ce, top, grad = _on(logits.device, _ce_and_grad)(logits, y)
        nll_y = ce.detach()
    return ce, top, y, nll_y, grad.to(weight.dtype) @ weight


class _ChunkedHeadCE(torch.autograd.Function):
    """Hard or soft CE (`target`: labels or the target's hidden states, `_chunk_stats`), chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, target, chunk, inverse=None, spans=()):
        need = ctx.needs_input_grad[0]
        ces, tops, ys, nlls, grads = [], [], [], [], []
        for j, i in enumerate(range(0, hidden.shape[0], chunk)):
            if inverse is None:
                rows, tgt = None, target[i:i + chunk]
            else:  # the span of rows this chunk reads, each once
                lo, hi = spans[j]
                rows, tgt = inverse[i:i + chunk] - lo, target[lo:hi]
            ce, top, y, nll_y, g = _chunk_stats(hidden[i:i + chunk].to(weight.dtype), weight, tgt, need, rows)
            ces.append(ce)
            tops.append(top)
            ys.append(y)
            nlls.append(nll_y)
            grads.append(g)
        ctx.save_for_backward(torch.cat(grads) if need else None)
        ctx.hidden_dtype = hidden.dtype
        top, y, nll_y = torch.cat(tops), torch.cat(ys), torch.cat(nlls)
        ctx.mark_non_differentiable(top, y, nll_y)
        return torch.cat(ces), top, y, nll_y

    @staticmethod
    def backward(ctx, grad_ce, _grad_top, _grad_y, _grad_nll):
        (dce_dh,) = ctx.saved_tensors
        grad = None if dce_dh is None else (dce_dh.float() * grad_ce[:, None]).to(ctx.hidden_dtype)
        return grad, None, None, None, None, None


def head_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                       chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token CE [T] fp32, argmax [T]) of `hidden` [T, H] through the frozen head `weight` [V, H].

    chunk 0: the plain path (all logits at once, autograd through them); chunk > 0: rows per chunk.
    """
    if chunk <= 0:
        logits = F.linear(hidden.to(weight.dtype), weight)
        return F.cross_entropy(logits.float(), labels, reduction="none"), logits.detach().argmax(-1)
    ce, top, _, _ = _ChunkedHeadCE.apply(hidden, weight, labels, int(chunk))
    return ce, top


def chunk_spans(inverse, chunk: int) -> tuple[tuple[int, int], ...]:
    """Per chunk of `chunk` scored tokens (all of them when chunk <= 0), the span [lo, hi) of the rows its tokens
    read (`inverse`, on the host: the training step finds them without a device synchronisation)."""
    inv = np.asarray(inverse)
    step = chunk if chunk > 0 else max(1, inv.size)
    return tuple((int(inv[i:i + step].min()), int(inv[i:i + step].max()) + 1) for i in range(0, inv.size, step))


def head_soft_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target_hidden: torch.Tensor,
                            chunk: int = 0, inverse: torch.Tensor | None = None,
                            spans: tuple[tuple[int, int], ...] | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token soft CE [T] fp32, argmax [T], the target's argmax y [T], -log q_y [T] detached) of `hidden`
    [T, H] through the frozen head `weight` [V, H], against the distribution of the target's final hidden state
    (no gradient) through the same head; q_y is the drafter's probability of the target's greedy token (D-PACE's
    acceptance estimate). `target_hidden`: [T, H], one row per token, or with `inverse` [T] the rows the tokens
    read, each once ([U, H]; token t reads row inverse[t]) and `spans` (chunk_spans of inverse at `chunk`; found
    here, with a device synchronisation, when not given). chunk 0: the plain path (autograd through all logits)."""
    target_hidden = target_hidden.detach()
    if inverse is not None and spans is None and chunk > 0:
        spans = chunk_spans(inverse.cpu(), chunk)
    if chunk <= 0:
        logits = F.linear(hidden.to(weight.dtype), weight).float()
        with torch.no_grad():
            target_logits = F.linear(target_hidden.to(weight.dtype), weight).float()
            _, top, y, nll_y, _, p = _soft_terms(logits.detach(), target_logits, inverse)
        ce = F.cross_entropy(logits, p, reduction="none")
        return ce, top, y, nll_y
    return _ChunkedHeadCE.apply(hidden, weight, target_hidden, int(chunk), inverse, spans)
