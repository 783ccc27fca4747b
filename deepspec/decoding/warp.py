"""Logit warping: temperature, top-k, top-p and min-p, the one implementation every sampler uses.

The speculative loops need the draft's proposal distribution ``q`` and the target's distribution
``p`` warped identically, and plain decoding must warp exactly as the loops warp the target: the eval
loop builds one :class:`Warp` and hands it to the drafter (``propose(..., warp, generator)``), applies
it to the target's verification logits and to plain decoding's.  The generation engines
(`deepspec.engines.sampling`) sample from `warp_logits`, the same filters as log-probabilities.

Order of the filters (as transformers and the serving engines apply them): temperature, then top-k,
then top-p on what top-k kept, then min-p on what top-p kept.

``temperature == 0`` is greedy decoding: the warp returns a one-hot distribution at the argmax
(first index on ties, like ``torch.argmax``), so sampling from it is deterministic and the acceptance
rule reduces to "accept while draft == argmax".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["Warp", "greedy_ids", "make_warp", "sample_token", "filtered_logits", "warp_logits"]


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last axis (the first index on ties, as ``torch.argmax``), through ``max``:
    on the CPU a third faster over [17, 49k] fp32 logits (1.1 against 1.7 ms), once per round."""
    return logits.max(dim=-1).indices


def filtered_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> torch.Tensor:
    """fp32 ``logits / temperature`` with the tokens top-k, top-p and min-p remove set to −inf (at least
    the most likely token is always kept).  ``temperature`` must be > 0."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        # drop a token once the tokens ranked above it already reach top_p (the first one is always kept)
        drop_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= top_p
        drop_sorted[..., 0] = False
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    if min_p > 0.0:
        # p < min_p · max p  <=>  x < max x + log(min_p): no softmax needed
        x = x.masked_fill(x < x.max(dim=-1, keepdim=True).values + float(torch.tensor(min_p).log()), float("-inf"))
    return x


def warp_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                min_p: float = 0.0) -> torch.Tensor:
    """Log-probabilities (fp32) after the filters of `filtered_logits`; −inf = removed."""
    return torch.log_softmax(filtered_logits(logits, temperature, top_k, top_p, min_p), dim=-1)


@dataclass(frozen=True)
class Warp:
    """Callable ``logits[..., V] -> probs[..., V]`` (float32, rows sum to 1)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.greedy:
            logits = logits.float()
            return torch.zeros_like(logits).scatter_(-1, greedy_ids(logits).unsqueeze(-1), 1.0)
        return torch.softmax(filtered_logits(logits, self.temperature, self.top_k, self.top_p, self.min_p), dim=-1)

    def describe(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p,
                "greedy": self.greedy}


def make_warp(temperature: float = 1.0, top_k: Optional[int] = 0, top_p: Optional[float] = 1.0,
              min_p: Optional[float] = 0.0) -> Warp:
    """The warp for ``eval.temperature/top_k/top_p/min_p`` (``temperature == 0`` = greedy)."""
    return Warp(float(temperature), int(top_k or 0), float(1.0 if top_p is None else top_p), float(min_p or 0.0))


def sample_token(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> int:
    """One token from a probability vector ``[V]`` (unnormalised is fine): the inverse CDF of one uniform
    (float64 cumulative sum), exact like ``torch.multinomial`` and on a CPU ~20× faster over 49k tokens
    (0.2 against 5 ms, 2026-12-06) — plain sampling and every speculative loop draw through it."""
    p = probs.reshape(-1).double()
    cdf = p.cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64, device=p.device)
    t = int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True))
    if t >= p.numel() or float(p[t]) <= 0:          # rounding at the very top of the CDF
        t = int(torch.nonzero(p > 0)[-1])
    return t
