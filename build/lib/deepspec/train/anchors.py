"""Anchor positions: where training blocks start (see docs/CONTRACTS.md, "Block semantics").

A block anchored at position ``p`` feeds ``x_p`` and predicts ``x_{p+1} … x_{p+γ}``.  As in the
reference implementation, ``p`` is a valid anchor when ``x_p`` and ``x_{p+1}`` are both answer
tokens (``loss_mask[p]`` and ``loss_mask[p+1]``) and ``p + 1 < length``; a block cut by the end of
the answer or of the sequence is supervised as a prefix (the drafter masks its later positions).
Each sequence gets up to ``N`` anchors drawn uniformly without replacement among its valid
positions, from a generator seeded by ``(seed, epoch, sample index)`` only — so a sample gets the
same anchors whatever the world size, rank, worker or resume point.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch


def valid_anchor_mask(loss_mask: torch.Tensor, length: Optional[int] = None) -> torch.Tensor:
    """Bool[T]: position p is a valid anchor (loss_mask[p] and loss_mask[p+1], p + 1 < length)."""
    mask = loss_mask.bool().reshape(-1)
    T = mask.numel() if length is None else int(length)
    mask = mask[:T]
    out = torch.zeros(mask.numel(), dtype=torch.bool)
    if T >= 2:
        out[: T - 1] = mask[:-1] & mask[1:]
    return out


def anchor_seed(seed: int, epoch: int, index: int) -> int:
    """A well-mixed 63-bit seed for one (run seed, epoch, sample) triple."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(epoch) & 0xFFFFFFFF, int(index) & 0xFFFFFFFF,
                                 0x5EED])
    lo, hi = (int(x) for x in ss.generate_state(2, dtype=np.uint32))
    return (lo | (hi << 32)) & ((1 << 63) - 1)


def sample_anchors(loss_mask: torch.Tensor, max_anchors: Optional[int], seed: int,
                   length: Optional[int] = None) -> torch.Tensor:
    """Sorted LongTensor[n] (n <= max_anchors) of anchors drawn uniformly among the valid ones.

    ``max_anchors`` None or <= 0 keeps every valid position."""
    valid = valid_anchor_mask(loss_mask, length).nonzero().reshape(-1)
    if max_anchors is None or max_anchors <= 0 or valid.numel() <= max_anchors:
        return valid
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(valid.numel(), generator=g)[:max_anchors]
    return valid[pick].sort().values
