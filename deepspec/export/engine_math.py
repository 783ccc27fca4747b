"""What the independent engine forwards share (`engine_parallel`, `engine_eagle3`), and the self-check's distance.

Written from the engines' code, not from `deepspec.drafts`: RMSNorm as the engines compute it
and rotate-half (neox) RoPE at integer positions.
"""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # Qwen3RMSNorm: fp32 variance, normalise, then scale by the weight
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w.float() * x32


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [heads, n, d] rotated (neox / rotate-half style) at integer positions pos [n]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos.double().unsqueeze(-1) * inv                       # [n, d/2]
    emb = torch.cat([ang, ang], -1).float()
    cos, sin = emb.cos(), emb.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| in fp32 on the CPU; equal infinities (the −inf of tokens outside a draft vocabulary)
    count as equal, an infinity against a finite value or a NaN as an infinite difference."""
    a, b = a.float().cpu(), b.float().cpu()
    if a.shape != b.shape:
        return float("inf")
    d = (a - b).abs()
    d = torch.where(torch.isinf(a) & (a == b), torch.zeros_like(d), d)
    return float(torch.nan_to_num(d, nan=float("inf")).max()) if d.numel() else 0.0
