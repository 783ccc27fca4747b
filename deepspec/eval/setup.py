"""What an eval decodes with: the drafter (loaded, in ``eval.draft_dtype``).  The verification policy is
`deepspec.decoding.policy.build_policy`, the chain / tree setting `deepspec.decoding.settings`."""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

import torch

from ..config import ConfigError
from ..drafts.checkpoint import read_checkpoint_config
from ..drafts.registry import build_drafter, load_drafter
from ..targets.loader import resolve_dtype

log = logging.getLogger(__name__)

__all__ = ["adopt_checkpoint_layers", "draft_dtype", "drafter_gamma", "load_eval_drafter"]


def drafter_gamma(drafter, default: int = 7) -> int:
    g = getattr(drafter, "gamma", None)
    if g is None:
        g = getattr(getattr(drafter, "cfg", None), "gamma", None)
    return int(g or default)


def draft_dtype(name: Optional[str], target) -> Optional[torch.dtype]:
    """``eval.draft_dtype``: None keeps the drafter as saved; "target" is the target's dtype."""
    if name is None:
        return None
    if name == "target":
        return target.dtype
    if name == "auto":
        raise ConfigError("eval.draft_dtype=auto: name a dtype (float32, bfloat16, float16), target, or null")
    try:
        return resolve_dtype(name)
    except ValueError:
        raise ConfigError(f"eval.draft_dtype={name!r}: choose float32, bfloat16, float16, target or null") from None


def adopt_checkpoint_layers(cfg) -> None:
    """With ``target.layer_ids`` unset, read the target layers ``eval.checkpoint`` was trained on (an Eagle3
    reads 3, a parallel drafter the target group's default 5, a recipe its own) instead of the target group's
    default, so that any checkpoint evaluates without naming its layers.  Set ids that differ stay an error
    (`deepspec.drafts.checkpoint.check_target`)."""
    if not cfg.eval.checkpoint or cfg.target.layer_ids is not None:
        return
    saved = (read_checkpoint_config(cfg.eval.checkpoint).get("target") or {}).get("layer_ids")
    if saved:
        cfg.target.layer_ids = [int(i) for i in saved]
        log.info("eval: target.layer_ids=%s, as eval.checkpoint was trained on", cfg.target.layer_ids)


def load_eval_drafter(cfg, target) -> Tuple[Any, Dict[str, Any]]:
    """The drafter of ``eval.checkpoint`` (or a random-init ``cfg.draft`` with a warning)."""
    ckpt = cfg.eval.checkpoint
    if ckpt:
        drafter = load_drafter(ckpt, target)
        source = str(ckpt)
    else:
        drafter = build_drafter(target, cfg.draft)
        reference = getattr(drafter, "model_free", False)
        if not reference:
            log.warning("eval.checkpoint is not set: evaluating a RANDOMLY INITIALISED %s drafter "
                        "(τ will be close to 1)", cfg.draft.algorithm)
        source = "reference" if reference else "random-init"
    if isinstance(drafter, torch.nn.Module):
        drafter.eval()
        dtype = draft_dtype(cfg.eval.draft_dtype, target)
        if dtype is not None:
            drafter.to(dtype)
    n_params = sum(p.numel() for p in drafter.parameters()) if isinstance(drafter, torch.nn.Module) else 0
    info = {"algorithm": getattr(drafter, "algorithm", type(drafter).__name__), "class": type(drafter).__name__,
            "source": source, "gamma": drafter_gamma(drafter, cfg.draft.gamma), "parameters": int(n_params),
            "dtype": str(next(drafter.parameters()).dtype).replace("torch.", "") if n_params else None}
    return drafter, info
