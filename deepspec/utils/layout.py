"""Memory layout of linear weights for few-row inference on a CPU.

`nn.Linear` keeps its weight as a row-major ``[out, in]`` tensor and computes ``x @ W.T``.  MKL's fp32
kernel for that transposed operand streams the weight once per three rows of ``x``: a forward over 4-8
rows (a verification block, a draft block) costs 2-3x one row.  Stored column-major (the same
``[out, in]`` values as a transposed view of a contiguous ``[in, out]`` tensor) the product takes the
non-transposed kernel, whose cost is nearly flat from 1 to 8 rows (`bench/verify_cost.py --layouts`).  Values,
shapes, state dicts and fingerprints are unchanged; only the strides differ.  bf16 kernels on CPUs with
AMX go the other way, so ``auto`` picks column-major for fp32 on a CPU only.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

LAYOUTS = ("auto", "row", "column")


def resolve_layout(setting: str, device: torch.device, dtype: torch.dtype) -> str:
    """``row`` or ``column`` for ``setting`` (``auto`` | ``row`` | ``column``) on this device and dtype."""
    if setting not in LAYOUTS:
        raise ValueError(f"target.weight_layout={setting!r}: choose from {', '.join(LAYOUTS)}")
    if setting != "auto":
        return setting
    return "column" if torch.device(device).type == "cpu" and dtype == torch.float32 else "row"


def is_column_major(w: torch.Tensor) -> bool:
    return w.dim() == 2 and w.stride(0) == 1 and w.stride(1) == w.shape[0] and w.shape[1] > 1


def to_column_major(w: torch.Tensor) -> torch.Tensor:
    """The same ``[out, in]`` values stored as the transpose of a contiguous ``[in, out]`` tensor."""
    return w.t().contiguous().t()


def column_major_linears(module: nn.Module, dtype: Optional[torch.dtype] = None) -> int:
    """Store every `nn.Linear` weight under ``module`` (of ``dtype``, if given) column-major, in place;
    returns how many changed.

    A weight shared by several modules (a tied embedding / LM head) is converted once, and the modules
    that share it keep sharing it.  Idempotent."""
    seen, changed = set(), 0
    for m in module.modules():
        if not isinstance(m, nn.Linear) or id(m.weight) in seen:
            continue
        if dtype is not None and m.weight.dtype != dtype:
            continue
        seen.add(id(m.weight))
        if m.weight.dim() == 2 and not is_column_major(m.weight):
            with torch.no_grad():
                m.weight.data = to_column_major(m.weight.data)
            changed += 1
    return changed
