"""The lossless acceptance rule of speculative decoding (pure functions).

Sampling (Leviathan et al. 2023; Chen et al. 2023): draft tokens ``x_1..x_γ`` were
sampled from ``q_1..q_γ``; the target gives ``p_1..p_{γ+1}`` for the same positions
(``p_{γ+1}`` is the distribution after the last draft).  Left to right, ``x_k`` is
accepted with probability ``min(1, p_k(x_k) / q_k(x_k))``.  At the first rejection the
emitted token is sampled from ``norm(max(p_k − q_k, 0))``; if all ``γ`` drafts are
accepted, a bonus token is sampled from ``p_{γ+1}``.  Every round therefore emits
``accepted + 1`` tokens whose joint law equals sampling from the target.

Greedy: accept while ``x_k == argmax p_k``; the emitted token is ``argmax`` of the
first mismatching position (or of ``p_{γ+1}``).  With one-hot warps this *is* the
sampling rule, evaluated without random numbers.

All randomness comes from the explicit ``torch.Generator`` argument.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from .warp import greedy_ids, sample_token

__all__ = ["Verification", "accept_greedy", "verify_greedy", "verify_sampling", "verify", "residual_distribution"]


@dataclass(frozen=True)
class Verification:
    accepted: int      # number of draft tokens accepted (0..γ)
    next_token: int    # correction (first rejection) or bonus token
    draft: tuple = ()  # the verified draft tokens

    @property
    def tokens(self) -> List[int]:
        """Tokens this round emits: accepted drafts, then the correction/bonus token."""
        return list(self.draft[: self.accepted]) + [self.next_token]


def _as_list(tokens) -> List[int]:
    if isinstance(tokens, torch.Tensor):
        return [int(t) for t in tokens.reshape(-1).tolist()]
    return [int(t) for t in tokens]


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(p − q, 0))``; falls back to ``p`` when the residual has no mass."""
    r = torch.clamp(p.float() - q.float(), min=0.0)
    s = r.sum(dim=-1, keepdim=True)
    if r.dim() == 1 and r.device.type == "cpu":   # the common single-row case: avoid extra kernels
        return r / s if float(s) > 1e-12 else p.float()
    return torch.where(s > 1e-12, r / s.clamp_min(1e-30), p.float())


def verify_greedy(draft_tokens, target_scores: torch.Tensor) -> Verification:
    """Greedy verification.

    ``target_scores[γ+1, V]``: target logits or probabilities for the positions of the
    draft tokens plus one (only the argmax is used)."""
    draft = _as_list(draft_tokens)
    g = len(draft)
    if target_scores.shape[0] < g + 1:
        raise ValueError(f"need {g + 1} target rows for {g} draft tokens, got {target_scores.shape[0]}")
    return accept_greedy(draft, greedy_ids(target_scores[: g + 1]).tolist())


def accept_greedy(draft: List[int], best: List[int]) -> Verification:
    """Greedy verification from the target's argmax tokens ``best`` (γ + 1 of them, host ints):
    what `verify_greedy` computes once the argmax rows are on the host."""
    g = len(draft)
    if len(best) < g + 1:
        raise ValueError(f"need {g + 1} target argmax tokens for {g} draft tokens, got {len(best)}")
    n = 0
    while n < g and draft[n] == best[n]:
        n += 1
    return Verification(accepted=n, next_token=int(best[n]), draft=tuple(int(t) for t in draft))


def verify_sampling(draft_tokens, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                    generator: Optional[torch.Generator] = None) -> Verification:
    """Speculative sampling.

    ``draft_probs[γ, V]``: the (warped) ``q_k`` each draft token was sampled from;
    ``target_probs[γ+1, V]``: the warped target distributions."""
    draft = _as_list(draft_tokens)
    g = len(draft)
    if target_probs.shape[0] < g + 1:
        raise ValueError(f"need {g + 1} target rows for {g} draft tokens, got {target_probs.shape[0]}")
    p = target_probs if target_probs.dtype == torch.float32 else target_probs.float()
    if g == 0:
        return Verification(accepted=0, next_token=sample_token(p[0], generator), draft=())
    if draft_probs.shape[0] < g:
        raise ValueError(f"need {g} draft distributions, got {draft_probs.shape[0]}")
    q = draft_probs[:g].to(device=p.device, dtype=torch.float32)
    idx = torch.tensor(draft, device=p.device, dtype=torch.long)[:, None]
    # one transfer: p_k(x_k), q_k(x_k) and the uniforms
    u = torch.rand(g, generator=generator, device=p.device)
    px, qx, uu = torch.stack([p[:g].gather(1, idx)[:, 0], q.gather(1, idx)[:, 0], u]).tolist()
    # accept with probability min(1, p/q): u < p/q  <=>  u*q < p (q = 0 < p accepts, p = q = 0 rejects)
    n = 0
    while n < g and uu[n] * qx[n] < px[n]:
        n += 1
    dist = p[g] if n == g else residual_distribution(p[n], q[n])
    return Verification(accepted=n, next_token=sample_token(dist, generator), draft=tuple(draft))


def verify(draft_tokens, draft_probs: Optional[torch.Tensor], target_scores: torch.Tensor,
           generator: Optional[torch.Generator] = None, greedy: bool = False) -> Verification:
    """Dispatch: greedy (argmax of ``target_scores``) or sampling (``target_scores`` = warped probs)."""
    if greedy:
        return verify_greedy(draft_tokens, target_scores)
    if draft_probs is None:
        raise ValueError("sampling verification needs the draft distributions")
    return verify_sampling(draft_tokens, draft_probs, target_scores, generator)
