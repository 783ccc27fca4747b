"""Attention for KV-cached decoding of ONE unpadded sequence: causal kernels instead of mask tensors.

`TargetAdapter.decode` (the eval loop's prefill, verification and plain-decode forwards) runs one
sequence without padding, so the attention pattern is always "the new queries are the last rows of a
causal matrix".  transformers' ``sdpa`` path builds a boolean mask for a multi-token forward over a
non-empty cache (the verification forward) and, with grouped-query attention, repeats K/V to the
query heads because CUDA's kernels do not take GQA and a mask together; CUDA then turns the boolean
mask into a dense float bias per layer.  Here instead:

- one query row (plain decoding):      no mask, GQA inside SDPA (as transformers does);
- queries == keys (prefill):           ``is_causal=True`` (upper-left = lower-right here), GQA in SDPA;
- queries  < keys (verification):      a lower-right causal bias (`torch.nn.attention.bias.causal_lower_right`),
                                       which CUDA's flash / memory-efficient kernels apply without any mask
                                       tensor (K/V repeated to the query heads for them); on the CPU one
                                       materialised boolean mask with GQA inside SDPA (transformers repeats
                                       K/V whenever there is a mask: twice the attention time);
- a draft tree (`decoding/tree_mask.py`): its 4-D ancestor mask, GQA inside SDPA (`tree_attention`).

They are registered with transformers under `IMPLEMENTATION` / `TREE_IMPLEMENTATION` together with a
mask function that returns no mask, and switched on only for the duration of such a forward
(`offset_causal`, `tree_causal`).  Models with sliding-window or soft-capped attention keep the stock
path (`supported`).
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

IMPLEMENTATION = "deepspec_offset_causal"
TREE_IMPLEMENTATION = "deepspec_tree"
_registered = False


def offset_causal_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                            scaling: Optional[float] = None, **kwargs):
    """transformers attention-interface signature; returns (out [B, q, heads, d], None)."""
    if attention_mask is not None:
        raise RuntimeError(f"{IMPLEMENTATION} is for unpadded single sequences: it got an attention mask")
    q_len, kv_len = query.shape[2], key.shape[2]
    rep = query.shape[1] // key.shape[1]
    if q_len == 1 or q_len == kv_len:
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling,
                                             is_causal=q_len > 1, enable_gqa=rep > 1)
    elif query.device.type != "cuda":
        # CPU: one materialised lower-right mask, GQA inside SDPA (no K/V copies; bit-identical, half the time)
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                             enable_gqa=rep > 1)
    else:
        if rep > 1:
            key = key.repeat_interleave(rep, dim=1)
            value = value.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(q_len, kv_len),
                                             dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def tree_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                   scaling: Optional[float] = None, **kwargs):
    """A tree verification (`decoding/tree_mask.py`): the given 4-D mask, GQA inside SDPA (no K/V copies)."""
    if attention_mask is None:
        raise RuntimeError(f"{TREE_IMPLEMENTATION} needs the tree's attention mask")
    rep = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=rep > 1)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None


def register() -> bool:
    """Register the attention and its (empty) mask function with transformers; False where it cannot."""
    global _registered
    if _registered:
        return True
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return False
    AttentionInterface.register(IMPLEMENTATION, offset_causal_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, _no_mask)
    AttentionInterface.register(TREE_IMPLEMENTATION, tree_attention)
    AttentionMaskInterface.register(TREE_IMPLEMENTATION, _no_mask)
    _registered = True
    return True


def full_attention(model) -> bool:
    """Every layer attends to the whole context (no sliding windows)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    types = getattr(cfg, "layer_types", None)
    if types:
        return all(t == "full_attention" for t in types)
    return not (getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True))


def supported(model) -> bool:
    """A plain causal decoder on the stock ``sdpa`` attention: no sliding windows, no soft-capping."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    if getattr(cfg, "attn_logit_softcapping", None) or not full_attention(model):
        return False
    return register()


@contextmanager
def attention_implementation(model, name: str):
    """Run the model's forwards inside on the registered attention ``name`` (and back to what it had after)."""
    saved = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = saved


def offset_causal(model):
    """`attention_implementation` with `offset_causal_attention`."""
    return attention_implementation(model, IMPLEMENTATION)


def tree_causal(model):
    """`attention_implementation` with `tree_attention`."""
    return attention_implementation(model, TREE_IMPLEMENTATION)


def cache_kwarg(forward) -> str:
    """The KV-cache argument of a transformers forward: ``cache`` (5.2x) or ``past_key_values`` (earlier)."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
