"""KV caches that roll back: attention layers keep every position, recurrent layers record their states.

A verification forward appends the anchor and the drafts to the cache; the rejected tail is then
removed (`TargetAdapter.rollback`).  For attention layers that is a crop, sliding-window layers
included, because the adapter's cache keeps all their positions (the window lives in the mask).
A linear-attention or convolution layer (Qwen3-Next's Gated DeltaNet, ...) holds one state that
every token updates in place; a crop cannot undo that.  transformers' *past recording*
(``Cache.activate_past_recording``) keeps, for the tokens of a forward, the state after each token
(the last ``recurrent_states_to_keep`` of them, computed token by token) and the raw convolution
inputs, and ``crop(-r)`` puts the layer back to the state after the first ``n - r`` tokens.

Here every forward of at most `MAX_RECORDED` new tokens over a non-empty cache records one state per
token, so any of its tokens (and those of the forwards since the last rollback, up to `MAX_RECORDED`)
can be rolled back.  A prefill, or a forward past that budget, commits what came before: those tokens
can no longer be removed, and asking for it raises `TargetUnsupported` with the reason.  A rollback
(any length, zero included) commits the rest, so the recorded states never pile up.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
try:
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin
except ImportError:         # transformers before per-layer recurrent caches
    DynamicLayer = LinearAttentionCacheLayerMixin = None

from .architecture import TargetUnsupported

__all__ = ["MAX_RECORDED", "new_cache", "is_recurrent", "before_forward", "after_forward", "rollback", "recorded"]

MAX_RECORDED = 64           # tokens of per-token recurrent states a cache keeps for rollbacks
_RECORDED = "_deepspec_recorded"
_PENDING = "_deepspec_pending"


def new_cache(config, layer_types) -> DynamicCache:
    """A cache for a model with recurrent layers: transformers' per-layer cache classes, except that
    attention layers (sliding ones included) keep every position; past recording switched on."""
    if LinearAttentionCacheLayerMixin is None:
        raise TargetUnsupported("decoding a model with recurrent layers needs transformers' per-layer recurrent "
                                "caches (transformers 5.x)")
    cache = DynamicCache(config=config)
    for i, kind in enumerate(layer_types):
        if kind in ("full_attention", "sliding_attention"):
            cache.layers[i] = DynamicLayer()
    cache.activate_past_recording(recurrent_states_to_keep=0)
    setattr(cache, _RECORDED, 0)
    return cache


def is_recurrent(cache) -> bool:
    return hasattr(cache, _RECORDED)


def _linear_layers(cache):
    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def _keep(cache, n: int) -> None:
    for layer in _linear_layers(cache):
        layer.recurrent_states_to_keep = n


@torch.inference_mode()      # the cache's tensors come from inference-mode forwards
def _commit(cache) -> None:
    if int(cache.get_seq_length()) > 0:
        cache.crop(0)           # drops the recorded states; trims the convolution inputs to the kernel
    setattr(cache, _RECORDED, 0)


def recorded(cache) -> int:
    """Trailing tokens of ``cache`` that can still be rolled back."""
    return int(getattr(cache, _RECORDED, 0))


def before_forward(cache, n_new: int) -> None:
    """Prepare ``cache`` for a forward over ``n_new`` tokens (record a state per token where it can)."""
    empty = int(cache.get_seq_length()) == 0
    if empty or n_new > MAX_RECORDED:
        _commit(cache)
        _keep(cache, 0)
        setattr(cache, _PENDING, None)          # commit again after the forward
        return
    if recorded(cache) + n_new > MAX_RECORDED:
        _commit(cache)
    _keep(cache, n_new)
    setattr(cache, _PENDING, n_new)


def after_forward(cache) -> None:
    pending = getattr(cache, _PENDING, None)
    if pending is None:
        _commit(cache)
    else:
        setattr(cache, _RECORDED, recorded(cache) + int(pending))
    setattr(cache, _PENDING, None)


@torch.inference_mode()
def rollback(cache, length: int) -> None:
    """Roll a recurrent cache back to ``length`` tokens (within its recorded tail) and commit the rest."""
    cur = int(cache.get_seq_length())
    drop = cur - int(length)
    if drop < 0 or length < 0:
        raise ValueError(f"cannot roll a cache of {cur} positions back to {length}")
    if cur == 0:
        return
    if drop > recorded(cache):
        raise TargetUnsupported(f"cannot roll back {drop} tokens of a cache with recurrent layers: their "
                                f"per-token states are kept for the last {recorded(cache)} tokens only")
    cache.crop(-drop)
    setattr(cache, _RECORDED, 0)
