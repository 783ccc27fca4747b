"""What a target's architecture lets the verification loops do, read from its config (no family names).

Each decoder layer has a kind (transformers' ``config.layer_types``, inferred where a config has none):

- ``full_attention``: attends to every earlier position.
- ``sliding_attention``: attends to the last ``sliding_window`` positions (itself included).  The
  adapter's KV cache keeps every position of these layers too (`TargetAdapter.new_cache`), so a chain
  rollback is a plain crop; a draft tree's mask carries the window (`decoding/tree_mask.py`, `targets/tree_masks.py`).
- ``linear_attention`` / ``conv`` (and the ``hybrid`` kinds that add attention to them): a recurrent
  or convolution state that follows one sequence.  Chains roll it back with the per-token states
  recorded during the verification forward (`targets/recurrent.py`); trees are refused.
- any other kind (e.g. ``chunked_attention``): neither policy is verified here; trees are refused.

Attention sinks (gpt-oss: one learned logit per head) and mixtures of experts change nothing in the
cache: both are noted for the description only.  Router outputs are never requested (the adapter turns
``output_router_logits`` off), so capture and the cache see the residual stream alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from ..errors import DeepSpecError

__all__ = ["Architecture", "TargetUnsupported", "architecture", "ATTENTION_KINDS", "RECURRENT_KINDS"]

ATTENTION_KINDS = ("full_attention", "sliding_attention")
RECURRENT_KINDS = ("linear_attention", "conv", "hybrid", "hybrid_sliding")
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


class TargetUnsupported(DeepSpecError, ValueError):
    """A decoding policy this target's architecture cannot run exactly (the message says why)."""


def _text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _layer_types(cfg) -> Tuple[str, ...]:
    types = getattr(cfg, "layer_types", None)
    n = int(cfg.num_hidden_layers)
    if types:
        return tuple(str(t) for t in types[:n])
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    if getattr(cfg, "attention_chunk_size", None):
        return ("chunked_attention",) * n
    return (("sliding_attention" if window else "full_attention"),) * n


def _experts(cfg) -> int:
    for key in _EXPERT_KEYS:
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 1:
            return v
    return 0


@dataclass(frozen=True)
class Architecture:
    model_type: str
    layer_types: Tuple[str, ...]
    sliding_window: Optional[int]       # of the sliding-window layers (None: there are none)
    attention_sinks: bool
    experts: int                        # routed experts per MoE layer (0 = dense)

    @property
    def kinds(self) -> Tuple[str, ...]:
        return tuple(sorted(set(self.layer_types)))

    @property
    def recurrent(self) -> bool:
        return any(t in RECURRENT_KINDS for t in self.layer_types)

    @property
    def sliding(self) -> bool:
        return "sliding_attention" in self.layer_types

    @property
    def unknown_kinds(self) -> Tuple[str, ...]:
        return tuple(t for t in self.kinds if t not in ATTENTION_KINDS + RECURRENT_KINDS)

    def tree_refusal(self) -> Optional[str]:
        """Why a draft tree cannot be verified on this architecture (None: it can, given the masks)."""
        if self.recurrent:
            kinds = ", ".join(t for t in self.kinds if t in RECURRENT_KINDS)
            return (f"its {kinds} layers carry a recurrent state that follows one sequence, not the "
                    "branches of a tree")
        if self.unknown_kinds:
            return f"its {', '.join(self.unknown_kinds)} layers have no tree mask here"
        return None

    def chain_refusal(self) -> Optional[str]:
        """Why chain verification cannot roll this architecture's cache back (None: it can)."""
        if self.unknown_kinds:
            return f"its {', '.join(self.unknown_kinds)} layers have no verified rollback here"
        return None

    def describe(self) -> Dict[str, Any]:
        return {"layer_kinds": {t: self.layer_types.count(t) for t in self.kinds},
                "sliding_window": self.sliding_window, "attention_sinks": self.attention_sinks,
                "experts": self.experts}


def architecture(model) -> Architecture:
    cfg = _text_config(model)
    types = _layer_types(cfg)
    window = getattr(cfg, "sliding_window", None) if "sliding_attention" in types else None
    sinks = any(hasattr(m, "sinks") for layer in list(model.get_decoder().layers)[:1] for m in layer.modules())
    return Architecture(model_type=str(getattr(cfg, "model_type", "")), layer_types=types,
                        sliding_window=int(window) if window else None, attention_sinks=sinks,
                        experts=_experts(cfg))
