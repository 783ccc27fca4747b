"""A generic draft transformer layer, sized from the target's config.

One layer type serves every target family (Llama, Qwen3, Gemma3, ...): pre-norm
RMSNorm, rotary embeddings with the target's base frequency and head size,
grouped-query attention with per-head q/k RMSNorm (optional: Eagle3's engine
layout has none), and a SwiGLU MLP.  It is not
a copy of any family's modeling code; only the sizes and the RoPE base come from
the target config (`DraftDims.from_target`).

Attention always goes through `torch.nn.functional.scaled_dot_product_attention`
with an explicit boolean mask (True = may attend).  A layer call receives the
new positions' hidden states plus an optional *prefix* of keys/values that the
caller built elsewhere (DFlash: the projected target context; Eagle3: its KV
cache or earlier training-time-test steps).  The mask covers ``[prefix ; new]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

KV = Tuple[torch.Tensor, torch.Tensor]


def rope_theta_from_config(config) -> float:
    """The base RoPE frequency of a HF text config (global/full-attention layers).

    transformers 5 keeps it in ``rope_parameters`` (flat, or per layer type for
    Gemma 3: we take ``full_attention``); older configs have ``rope_theta``."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        if "rope_theta" in params:
            return float(params["rope_theta"])
        for key in ("full_attention", "global", "default"):
            sub = params.get(key)
            if isinstance(sub, dict) and "rope_theta" in sub:
                return float(sub["rope_theta"])
        for sub in params.values():
            if isinstance(sub, dict) and "rope_theta" in sub:
                return float(sub["rope_theta"])
    theta = getattr(config, "rope_theta", None)
    return float(theta) if theta else 10000.0


@dataclass
class DraftDims:
    """Sizes of the draft layers (defaults: the target's own, with our fewer layers)."""
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float

    @classmethod
    def from_target(cls, config, draft_cfg) -> "DraftDims":
        H = draft_cfg.hidden_size or int(config.hidden_size)
        heads = draft_cfg.num_attention_heads or int(config.num_attention_heads)
        kv = draft_cfg.num_key_value_heads or int(getattr(config, "num_key_value_heads", None) or heads)
        if draft_cfg.head_dim:
            hd = int(draft_cfg.head_dim)
        elif draft_cfg.hidden_size is None and getattr(config, "head_dim", None):
            hd = int(config.head_dim)
        else:
            hd = H // heads
        inter = draft_cfg.intermediate_size or int(getattr(config, "intermediate_size", 0) or 4 * H)
        if heads % kv:
            raise ValueError(f"draft num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
        eps = float(getattr(config, "rms_norm_eps", None) or 1e-6)
        return cls(H, inter, heads, kv, hd, rope_theta_from_config(config), eps)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and returned in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class Rotary(nn.Module):
    """Rotate-half RoPE at explicit integer positions (any shape of position tensor)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [B, heads, n, d]; positions: [B, n] (or [n]) long."""
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)
        ang = positions.to(self.inv_freq.device).float().unsqueeze(-1) * self.inv_freq  # [B, n, d/2]
        ang = torch.cat([ang, ang], dim=-1).unsqueeze(1)                                # [B, 1, n, d]
        cos, sin = ang.cos(), ang.sin()
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        rot = torch.cat([-x2, x1], dim=-1)
        return (xf * cos + rot * sin).to(x.dtype)


class Attention(nn.Module):
    """GQA attention with RoPE and (by default) per-head q/k RMSNorm; keys/values may carry a prefix.

    ``in_features`` (default: hidden size) is the width q/k/v project from; ``qk_norm=False``
    leaves out the per-head RMSNorm (Llama-style attention)."""

    def __init__(self, dims: DraftDims, in_features: Optional[int] = None, qk_norm: bool = True):
        super().__init__()
        self.dims = dims
        H, hd = dims.hidden_size, dims.head_dim
        n_in = in_features or H
        self.q_proj = nn.Linear(n_in, dims.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(n_in, dims.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(n_in, dims.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(dims.num_heads * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, dims.rms_eps) if qk_norm else None
        self.k_norm = RMSNorm(hd, dims.rms_eps) if qk_norm else None
        self.rotary = Rotary(hd, dims.rope_theta)

    def _heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        B, n, _ = x.shape
        return x.view(B, n, n_heads, self.dims.head_dim).transpose(1, 2)

    def project_kv(self, x: torch.Tensor, positions: torch.Tensor) -> KV:
        """Keys (normed, rotated) and values of ``x`` [B, n, H] -> [B, kv_heads, n, d] each."""
        k = self._heads(self.k_proj(x), self.dims.num_kv_heads)
        k = k if self.k_norm is None else self.k_norm(k)
        v = self._heads(self.v_proj(x), self.dims.num_kv_heads)
        return self.rotary(k, positions), v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, prefix: Optional[KV] = None,
                mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, KV]:
        """x: [B, n, H] (already normed). mask: bool [B or 1, 1, n, P + n] over [prefix ; x].

        Returns the attention output [B, n, H] and the new positions' (k, v)."""
        q = self._heads(self.q_proj(x), self.dims.num_heads)
        q = self.rotary(q if self.q_norm is None else self.q_norm(q), positions)
        k, v = self.project_kv(x, positions)
        K, V = (k, v) if prefix is None else (torch.cat([prefix[0], k], 2), torch.cat([prefix[1], v], 2))
        K, V = K.to(q.dtype), V.to(q.dtype)
        rep = self.dims.num_heads // self.dims.num_kv_heads
        gqa = rep > 1
        if gqa and mask is not None and q.device.type == "cuda":
            # CUDA's memory-efficient kernel takes an explicit mask only without GQA: repeat K/V there.
            # The CPU kernels take both (grouped heads read the shared K/V: 1.5x faster, bit-exact).
            K, V = K.repeat_interleave(rep, dim=1), V.repeat_interleave(rep, dim=1)
            gqa = False
        out = F.scaled_dot_product_attention(q, K, V, attn_mask=mask, enable_gqa=gqa)
        B, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, n, -1)), (k, v)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)); x + mlp(norm(x)).

    With ``attn_in`` set the layer has no input norm: ``x`` is the (already normed)
    attention input of that width and the first residual is the ``residual`` argument —
    EAGLE-3's first layer, whose q/k/v read concat[norm(embed), norm(hidden)] and whose
    residual stream is the hidden state itself."""

    def __init__(self, dims: DraftDims, attn_in: Optional[int] = None, qk_norm: bool = True):
        super().__init__()
        self.input_norm = RMSNorm(dims.hidden_size, dims.rms_eps) if attn_in is None else None
        self.attn = Attention(dims, attn_in, qk_norm)
        self.post_attn_norm = RMSNorm(dims.hidden_size, dims.rms_eps)
        self.mlp = SwiGLU(dims.hidden_size, dims.intermediate_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, prefix: Optional[KV] = None,
                mask: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, KV]:
        if self.input_norm is None:
            if residual is None:
                raise ValueError("a DraftLayer built with attn_in needs the residual stream")
            a, kv = self.attn(x, positions, prefix, mask)
            x = residual + a
        else:
            a, kv = self.attn(self.input_norm(x), positions, prefix, mask)
            x = x + a
        x = x + self.mlp(self.post_attn_norm(x))
        return x, kv
