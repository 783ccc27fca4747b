"""Target context features for the parallel drafters.

``H_ctx = RMSNorm(Linear(concat of the target's layer outputs))``.  The context
is *not* pushed through the draft layers: every draft layer projects ``H_ctx``
with its own k/v projections (and k-norm / RoPE at the context's absolute
positions) and uses the result as extra keys/values in front of the block's own.
Those per-layer context K/V depend only on the features, so decoding caches them
and projects only the new positions on `advance`.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import nn

from .feature_scale import scale_features, set_inv_rms
from .layers import KV, DraftLayer, RMSNorm, SwiGLU


class ContextProjector(nn.Module):
    """``RMSNorm(fc(features))``, the features times ``inv_rms`` first when given (`draft.feature_norm`);
    with ``mlp_size`` (the `draft.context_mlp` ablation) a residual SwiGLU over each position first:
    ``h = fc(f); h = h + mlp(RMSNorm(h)); RMSNorm(h)``."""

    def __init__(self, feature_dim: int, hidden_size: int, eps: float = 1e-6, mlp_size: Optional[int] = None,
                 inv_rms: Optional[torch.Tensor] = None):
        super().__init__()
        set_inv_rms(self, inv_rms)   # `draft.feature_norm=channel`: features / their per-channel RMS before fc
        self.fc = nn.Linear(feature_dim, hidden_size, bias=False)
        self.mlp_norm = RMSNorm(hidden_size, eps) if mlp_size else None
        self.mlp = SwiGLU(hidden_size, mlp_size) if mlp_size else None
        self.norm = RMSNorm(hidden_size, eps)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., L*H_target] -> H_ctx [..., H_draft]."""
        h = self.fc(scale_features(features, self.inv_rms, self.fc.weight.dtype, self.fc.weight.device))
        if self.mlp is not None:
            h = h + self.mlp(self.mlp_norm(h))
        return self.norm(h)


def context_kv(layers: Sequence[DraftLayer], h_ctx: torch.Tensor, positions: torch.Tensor) -> List[KV]:
    """Per-layer (K, V) of the context: [B, kv_heads, T, d] each, RoPE at ``positions``."""
    return [layer.attn.project_kv(h_ctx, positions) for layer in layers]


def append_kv(cache: List[KV], new: List[KV]) -> List[KV]:
    """Concatenate new positions onto a per-layer KV list along the sequence axis."""
    if not cache:
        return list(new)
    return [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(cache, new)]
