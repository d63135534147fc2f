"""Verification rules of batched speculative decoding (drafter/batched_decoding.py), one row per prompt.

The same rules as drafter/speculative.py (greedy; speculative sampling, Leviathan et al. 2023), on tensors
[B, ...] and without host synchronisation, so that a whole step can be captured as a CUDA graph.

Randomness is counter-based: the uniforms of a row are a hash of (seed, the prompt's id, the row's step,
the slot in the step), so a row draws the same numbers whatever the batch it runs in (batch N equals batch
1 per seed) and nothing depends on a generator's state; sampling is by inverse CDF with one uniform.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2**32 for h < 2**32 in int64, without signed overflow (c split in 16-bit halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & _M32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser: every input bit flips each output bit with probability ~1/2."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniforms(seed: int, uid: torch.Tensor, step: torch.Tensor, slots: int) -> torch.Tensor:
    """[B, slots] float32 uniforms in [0, 1) for rows `uid` [B] at their step counters `step` [B]."""
    h = _mix32(torch.full_like(uid, (int(seed) * 0x9E3779B9) & _M32) ^ (uid & _M32))
    h = _mix32(h ^ (step & _M32))
    slot = torch.arange(slots, device=uid.device)
    h = _mix32(h[:, None] ^ _mul32(slot[None, :] + 1, 0x27D4EB2F))
    return (h >> 8).to(torch.float32) / float(1 << 24)


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from `probs` [..., V] with uniforms `u` [...]: the first token whose CDF exceeds u."""
    cdf = probs.float().cumsum(-1)
    pick = torch.searchsorted(cdf, (u * cdf[..., -1]).unsqueeze(-1).contiguous(), right=True).squeeze(-1)
    return pick.clamp_max(probs.shape[-1] - 1)


class BatchedGreedy:
    """Drafts are the drafter's argmaxes; keep the leading drafts equal to the target's argmax, then its next."""

    temperature = 0.0

    def slots_for(self, block: int) -> int:
        return 0  # no randomness: a step draws no uniforms (72 kernels of hashing a step at batch 1)

    def first(self, logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return logits.argmax(-1)

    def propose(self, draft_logits: torch.Tensor, u: torch.Tensor):
        return draft_logits.argmax(-1), None

    def accept(self, draft, q, logits, u) -> tuple[torch.Tensor, torch.Tensor]:
        """(kept [B], emitted [B, K+1]); emitted[:, :kept+1] are the drafts kept and the target's next token."""
        post = logits.argmax(-1)
        kept = (draft == post[:, :-1]).int().cumprod(1).sum(1)
        return kept, post


class BatchedSampling:
    """Speculative sampling at temperature T: draft k kept with probability min(1, p_k(x)/q_k(x)); the first
    rejection resampled from norm(max(0, p - q)); all kept: the bonus from p (q taken as 0 there)."""

    def __init__(self, temperature: float):
        if temperature <= 0:
            raise ValueError(f"speculative sampling needs a temperature > 0, got {temperature}")
        self.temperature = float(temperature)

    def slots_for(self, block: int) -> int:
        return 2 * block  # K = block - 1 proposals, K acceptance tests, one final draw (+1 spare)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.float() / self.temperature, dim=-1)

    def first(self, logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return sample(self.probs(logits), u[:, 0])

    def propose(self, draft_logits: torch.Tensor, u: torch.Tensor):
        q = self.probs(draft_logits)
        return sample(q, u[:, : q.shape[1]]), q

    def accept(self, draft, q, logits, u) -> tuple[torch.Tensor, torch.Tensor]:
        k = draft.shape[1]
        p = self.probs(logits)
        p_draft = p[:, :k].gather(-1, draft[..., None]).squeeze(-1)
        q_draft = q.gather(-1, draft[..., None]).squeeze(-1)
        keep = u[:, k: 2 * k] * q_draft < p_draft  # u < p(x)/q(x), without dividing by a tiny q
        kept = keep.int().cumprod(1).sum(1)
        at = kept[:, None, None].expand(-1, 1, p.shape[-1])
        p_at = p.gather(1, at).squeeze(1)
        q_at = torch.cat([q, torch.zeros_like(q[:, :1])], 1).gather(1, at).squeeze(1)
        nxt = sample(self.residual(p_at, q_at), u[:, 2 * k])
        emitted = torch.cat([draft, draft[:, :1]], 1).scatter(1, kept[:, None], nxt[:, None])
        return kept, emitted

    @staticmethod
    def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """norm(max(0, p - q)) per row (p itself where q covers p exactly); q = 0 gives p."""
        r = (p - q).clamp_min(0)
        total = r.sum(-1, keepdim=True)
        return torch.where(total > 0, r / total.clamp_min(1e-30), p)


BATCHED_GREEDY = BatchedGreedy()
