"""AdamW with fp32 state, decoupled weight decay on matrices only, warmup + cosine schedule."""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Tuple

import torch
from torch import nn


def trainable_named_parameters(model: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """(name, param) of every parameter that trains, in module order (shared params once)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def param_groups(named: Iterable[Tuple[str, nn.Parameter]], weight_decay: float) -> List[Dict]:
    """Two groups: matrices decay, vectors (biases, norms, scalars) don't."""
    decay, no_decay = [], []
    for _, p in named:
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_adamw(named: Iterable[Tuple[str, nn.Parameter]], cfg) -> torch.optim.AdamW:
    """Plain torch AdamW; parameters (and so its state) stay fp32 — autocast only changes compute."""
    named = list(named)
    bad = [n for n, p in named if p.dtype != torch.float32]
    if bad:
        raise TypeError(f"trainable parameters must be fp32 (master weights); got {bad[:3]} ...")
    # The fused kernel (one pass per tensor) is ~5x faster than the foreach one on CPU for the
    # vocabulary-sized head matrices; sharded (DTensor) parameters keep the foreach path.
    fused = all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda") for _, p in named)
    return torch.optim.AdamW(param_groups(named, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.betas_1, cfg.betas_2), eps=cfg.eps, fused=fused or None)


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    return int(math.ceil(max(warmup_ratio, 0.0) * total_steps))


def lr_at(step: int, total_steps: int, base_lr: float, warmup_ratio: float, min_lr_ratio: float) -> float:
    """LR of optimizer step ``step`` (0-based): linear warmup to ``base_lr`` over ``warmup_ratio`` of
    the run, then cosine decay to ``min_lr_ratio * base_lr`` at ``total_steps``."""
    w = warmup_steps(total_steps, warmup_ratio)
    if step < w:
        return base_lr * (step + 1) / w
    span = max(total_steps - w, 1)
    progress = min(max(step - w, 0) / span, 1.0)
    cos = 0.5 * (1.0 + math.cos(math.pi * progress))
    return base_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cos)
