"""Logit warping shared by the target and the draft (temperature, top-k, top-p).

Lossless speculative sampling needs the draft's proposal distribution ``q`` and the
target's distribution ``p`` to be warped identically: the eval loop builds one
:class:`Warp` and hands it to the drafter (``propose(..., warp, generator)``) and
applies it to the target's verification logits.

``temperature == 0`` is greedy decoding: the warp returns a one-hot distribution at
the argmax (first index on ties, like ``torch.argmax``), so sampling from it is
deterministic and the acceptance rule reduces to "accept while draft == argmax".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["Warp", "greedy_ids", "make_warp", "sample_token"]


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last axis (the first index on ties, as ``torch.argmax``), through ``max``:
    on the CPU a third faster over [17, 49k] fp32 logits (1.1 against 1.7 ms), once per round."""
    return logits.max(dim=-1).indices


@dataclass(frozen=True)
class Warp:
    """Callable ``logits[..., V] -> probs[..., V]`` (float32, rows sum to 1)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.greedy:
            idx = greedy_ids(logits).unsqueeze(-1)
            return torch.zeros_like(logits).scatter_(-1, idx, 1.0)
        x = logits / self.temperature
        vocab = x.shape[-1]
        if 0 < self.top_k < vocab:
            kth = torch.topk(x, self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_x, order = torch.sort(x, dim=-1, descending=True)
            sorted_p = torch.softmax(sorted_x, dim=-1)
            mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
            # drop a token once the tokens ranked above it already reach top_p
            # (the most likely token is always kept)
            drop_sorted = mass_before >= self.top_p
            drop_sorted[..., 0] = False
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            x = x.masked_fill(drop, float("-inf"))
        return torch.softmax(x, dim=-1)

    def describe(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "greedy": self.greedy}


def make_warp(temperature: float = 1.0, top_k: Optional[int] = 0, top_p: Optional[float] = 1.0) -> Warp:
    """The warp for ``eval.temperature/top_k/top_p`` (``temperature == 0`` = greedy)."""
    return Warp(float(temperature), int(top_k or 0), float(1.0 if top_p is None else top_p))


def sample_token(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> int:
    """One token from a probability vector ``[V]`` (the same call the drafters use)."""
    return int(torch.multinomial(probs.float(), 1, generator=generator).item())
