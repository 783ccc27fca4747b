"""Draft losses and metrics, computed chunk by chunk.

Per draft position k (1-based; weight index k-1 so the first position has weight 1):

* ``ce``      cross-entropy to the target's actual next token,
* ``soft_ce`` cross-entropy to the target distribution ``p_t`` (Eagle3),
* ``tv``      ½‖q − p_t‖₁, the probability that lossless verification rejects
              the draft at that position (so 1 − TV_k is the acceptance probability),
* ``bce``     BCE(c_k, 1 − TV_k) for the confidence head (target detached).

`token_terms` is the plain-autograd definition of the terms (tests, teacher-forced
scoring); training goes through `fused_loss`, which computes the same terms and
their gradients a chunk of rows at a time.
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch
import torch.nn.functional as F

# Rows of the per-position statistics tensor [len(STAT_ROWS), γ] (sums over items).
# ``in_vocab``: positions whose target token is inside the draft vocabulary (all of them without one);
# CE is averaged over those only.
STAT_ROWS = ("count", "ce", "tv", "bce", "top1", "chain_count", "chain_accept", "in_vocab")


def position_weights(n: int, decay: float, device=None) -> torch.Tensor:
    """w_k = exp(-k / decay) for k = 0..n-1; decay <= 0 means all ones."""
    k = torch.arange(n, dtype=torch.float32, device=device)
    return torch.exp(-k / decay) if decay and decay > 0 else torch.ones_like(k)


def step_weights(n: int, decay: float, device=None) -> torch.Tensor:
    """Eagle3's w_k = decay ** k for k = 0..n-1."""
    return torch.tensor([float(decay) ** k for k in range(n)], dtype=torch.float32, device=device)


def token_terms(draft_logits: torch.Tensor, target_logits: torch.Tensor, tokens: torch.Tensor,
                conf_logits: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """Per-position terms for draft logits [..., V] vs target logits [..., V] (no grad needed)."""
    logq = torch.log_softmax(draft_logits.float(), dim=-1)
    with torch.no_grad():
        p_t = torch.softmax(target_logits.float(), dim=-1)
    ce = -logq.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    tv = 0.5 * (logq.exp() - p_t).abs().sum(-1)
    out = {"ce": ce, "soft_ce": -(p_t * logq).sum(-1), "tv": tv,
           "top1": (draft_logits.argmax(-1) == tokens).float()}
    if conf_logits is not None:
        out["bce"] = F.binary_cross_entropy_with_logits(conf_logits.float(), (1 - tv).detach(), reduction="none")
    return out


def stat_sums(terms: Dict[str, torch.Tensor], valid: torch.Tensor) -> torch.Tensor:
    """Sums over items of each per-position statistic -> [len(STAT_ROWS), γ] (detached).

    ``valid`` [..., γ] marks the positions that count; the acceptance chain of an
    item stops at its first invalid position."""
    v = valid.float().reshape(-1, valid.shape[-1])

    def s(x):
        return (x.detach().float().reshape(v.shape) * v).sum(0)

    chain = torch.cumprod(v, dim=-1)
    accept = torch.cumprod(1 - terms["tv"].detach().float().reshape(v.shape), dim=-1)
    zero = v.new_zeros(v.shape[-1])
    return torch.stack([v.sum(0), s(terms["ce"]), s(terms["tv"]),
                        s(terms["bce"]) if "bce" in terms else zero, s(terms["top1"]),
                        chain.sum(0), (accept * chain).sum(0),
                        s(terms["in_vocab"]) if "in_vocab" in terms else v.sum(0)])


def metrics_from_stats(stats: torch.Tensor) -> Dict[str, float]:
    """ce (over positions whose target is in the draft vocabulary), tv, conf_bce (means over valid
    positions), vocab_coverage, accept_rate/k, top1/k, expected_tau."""
    rows = dict(zip(STAT_ROWS, stats.detach().double().cpu().tolist()))
    n = sum(rows["count"])
    n_in = sum(rows["in_vocab"])
    out = {"ce": sum(rows["ce"]) / max(n_in, 1), "tv": sum(rows["tv"]) / max(n, 1),
           "conf_bce": sum(rows["bce"]) / max(n, 1), "positions": float(n),
           "vocab_coverage": n_in / n if n else math.nan}
    tau = 1.0
    for k, c in enumerate(rows["count"]):
        out[f"accept_rate/{k + 1}"] = 1 - rows["tv"][k] / c if c else math.nan
        out[f"top1/{k + 1}"] = rows["top1"][k] / c if c else math.nan
        cc = rows["chain_count"][k]
        tau += rows["chain_accept"][k] / cc if cc else 0.0
    out["expected_tau"] = tau
    return out
