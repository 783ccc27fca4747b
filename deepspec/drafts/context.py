"""Target context features for the parallel drafters.

``H_ctx = RMSNorm(Linear(concat of the target's layer outputs))``.  The context
is *not* pushed through the draft layers: every draft layer projects ``H_ctx``
with its own k/v projections (and k-norm / RoPE at the context's absolute
positions) and uses the result as extra keys/values in front of the block's own.
Those per-layer context K/V depend only on the features, so decoding caches them
and projects only the new positions on `advance`.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import nn

from .layers import KV, DraftLayer, RMSNorm


class ContextProjector(nn.Module):
    """``RMSNorm(fc(features))``."""

    def __init__(self, feature_dim: int, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.fc = nn.Linear(feature_dim, hidden_size, bias=False)
        self.norm = RMSNorm(hidden_size, eps)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., L*H_target] -> H_ctx [..., H_draft]."""
        return self.norm(self.fc(as_input(features, self.fc.weight.dtype, self.fc.weight.device)))


def as_input(features: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """``features`` on ``device`` in ``dtype`` (a copy when they come from inference mode, e.g. straight
    from `target.capture`, so that autograd may save them)."""
    if features.is_inference():
        features = features.clone()
    return features.to(device=device, dtype=dtype)


def context_kv(layers: Sequence[DraftLayer], h_ctx: torch.Tensor, positions: torch.Tensor) -> List[KV]:
    """Per-layer (K, V) of the context: [B, kv_heads, T, d] each, RoPE at ``positions``."""
    return [layer.attn.project_kv(h_ctx, positions) for layer in layers]


def append_kv(cache: List[KV], new: List[KV]) -> List[KV]:
    """Concatenate new positions onto a per-layer KV list along the sequence axis."""
    if not cache:
        return list(new)
    return [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(cache, new)]
