"""Speculative decoding of the target with a DFlash drafter (transformers target, KV caches), one prompt at a time:
the reference that the batched decoder (drafter/batched_decoding.py) is tested against, and the path of targets
it does not support.

One step: the drafter drafts a block `[anchor, MASK x (bs-1)]` conditioned on the target features of every
accepted token (its context K/V cached); the target verifies the block in one forward; a verification rule
decides how many drafts to keep and which token follows them; both caches are cropped to what was kept.

Verification rules:
- `GreedyVerification` (temperature 0): drafts are the drafter's argmaxes; the leading drafts equal to the
  target's own argmax are kept, plus the target's next token (bonus). Output = plain greedy decoding.
- `SpeculativeSampling` (temperature T > 0; Leviathan et al. 2023, Chen et al. 2023): draft k is sampled
  from q_k = softmax(drafter logits / T) and kept with probability min(1, p_k(x)/q_k(x)), p_k the target's
  softmax(logits / T) after the kept prefix; the first rejected position is replaced by a sample of
  norm(max(0, p_k - q_k)); when every draft is kept the bonus is sampled from p. The output is distributed
  exactly as plain sampling from the target at T (checked statistically in tests/test_evaluate.py). The
  DFlash drafter predicts all block positions in parallel, so q_k does not depend on the earlier drafts:
  the argument holds for any proposal that is fixed before x_k is drawn. Temperature only (no top-k/top-p).
"""

from __future__ import annotations

import torch

from dflash_pipeline.target_layers import LayerOutputs


class GreedyVerification:
    temperature = 0.0

    def first_token(self, logits: torch.Tensor) -> int:
        return int(logits.argmax())

    def propose(self, draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return draft_logits.argmax(-1), None

    def verify(self, draft: torch.Tensor, q, target_logits: torch.Tensor) -> tuple[int, int]:
        """(drafts kept, the token after them); target_logits[j] predicts the token after draft j."""
        post = target_logits.argmax(-1)
        kept = int((draft == post[:-1]).int().cumprod(0).sum())
        return kept, int(post[kept])


class SpeculativeSampling:
    def __init__(self, temperature: float, generator: torch.Generator):
        if temperature <= 0:
            raise ValueError(f"speculative sampling needs a temperature > 0, got {temperature}")
        self.temperature = temperature
        self.generator = generator

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.float() / self.temperature, dim=-1)

    def sample(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def first_token(self, logits: torch.Tensor) -> int:
        return self.sample(self.probs(logits))

    def propose(self, draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.probs(draft_logits)
        return torch.multinomial(q, 1, generator=self.generator).squeeze(-1), q

    def verify(self, draft: torch.Tensor, q: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
        p = self.probs(target_logits)
        n = draft.shape[0]
        rows = torch.arange(n, device=draft.device)
        u = torch.rand(n, generator=self.generator, device=draft.device)
        keep = u * q[rows, draft] < p[rows, draft]  # u < p(x)/q(x), without dividing by a tiny q
        kept = int(keep.int().cumprod(0).sum())
        if kept == n:
            return kept, self.sample(p[n])
        return kept, self.sample(self.residual(p[kept], q[kept]))

    @staticmethod
    def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """norm(max(0, p - q)): what p still owes after q's accepted mass (p itself if q covers p exactly)."""
        r = (p - q).clamp_min(0)
        total = r.sum()
        return r / total if total > 0 else p


GREEDY = GreedyVerification()


@torch.no_grad()
def greedy_generate(target, prompt: list[int], max_new: int, stop_ids: set[int], device) -> tuple[list[int], list[float]]:
    """Plain greedy decoding with the KV cache; also the top-1 minus top-2 logit gap of each step."""
    out = target(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    past, kw = _cache_of(out), _cache_kw(target)
    tokens, gaps = [], []
    logits = out.logits[0, -1].float()
    while True:
        top = torch.topk(logits, 2)
        tok = int(top.indices[0])
        tokens.append(tok)
        gaps.append(float(top.values[0] - top.values[1]))
        if tok in stop_ids or len(tokens) >= max_new:
            return tokens, gaps
        out = target(input_ids=torch.tensor([[tok]], device=device), **{kw: past}, use_cache=True)
        past = _cache_of(out)
        logits = out.logits[0, -1].float()


@torch.no_grad()
def speculative_generate(target, drafter, head, prompt: list[int], max_new: int, stop_ids: set[int],
                         device, rule=GREEDY) -> tuple[list[int], list[int]]:
    """Speculative decoding under `rule`; returns (generated tokens, drafts kept per target forward)."""
    from dflash_pipeline.drafter.model import ContextCache

    cfg = drafter.config
    bs = cfg.block_size
    dtype = next(drafter.parameters()).dtype
    # the drafter's context: the outputs of the target's decoder layers (target_layers.py), from hooks
    with LayerOutputs(target, cfg.target_layer_ids) as cap:
        out = target(input_ids=torch.tensor([prompt], device=device), use_cache=True)
        past, kw = _cache_of(out), _cache_kw(target)
        feats = cap.features()
        feat_pos = torch.arange(len(prompt), device=device)[None]
        cache = ContextCache(len(drafter.layers))
        generated = [rule.first_token(out.logits[0, -1])]
        accepted: list[int] = []
        while generated[-1] not in stop_ids and len(generated) < max_new:
            start = len(prompt) + len(generated) - 1  # position of the anchor: the last token, not yet verified
            block = torch.full((1, bs), cfg.mask_token_id, dtype=torch.long, device=device)
            block[0, 0] = generated[-1]
            hidden = drafter(head.embed(block).to(dtype), feats.to(dtype), feat_pos,
                             torch.arange(start, start + bs, device=device)[None], cache=cache)
            draft, q = rule.propose(head.lm_head(hidden[0, 1:].to(head.lm_head.weight.dtype)))
            out = target(input_ids=torch.cat([block[0, :1], draft])[None], **{kw: past}, use_cache=True)
            kept, nxt = rule.verify(draft, q, out.logits[0])
            accepted.append(kept)
            _crop(past, start + kept + 1)
            feats = cap.features()[:, : kept + 1]
            feat_pos = torch.arange(start, start + kept + 1, device=device)[None]
            for tok in draft[:kept].tolist() + [nxt]:
                generated.append(tok)
                if tok in stop_ids or len(generated) >= max_new:
                    break
    return generated, accepted


def _cache_kw(target) -> str:
    """The forward's cache argument: `cache` from transformers 5.2x on (`past_key_values` deprecated), else the old."""
    import inspect

    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def _cache_of(out):
    return getattr(out, "cache", None) if getattr(out, "past_key_values", None) is None else out.past_key_values


def _crop(past, keep: int) -> None:
    """Keep the first `keep` positions of a transformers cache (crop takes a negative count to remove)."""
    extra = past.get_seq_length() - keep
    if extra > 0:
        past.crop(-extra)
