"""Draft-tree masks for targets with sliding-window layers.

A tree row at position ``q`` may see a key at position ``k`` when the key is in the cache or is one of
the row's ancestors (`deepspec.decoding.tree_mask.ancestor_mask`) — and, in a sliding-window layer, when ``q - k < window``
as well (transformers' ``sliding_window_overlay``: the window counts the row itself).  Cache rows sit
at positions ``0 .. past-1`` (the adapter's cache keeps every position, compacted after each round),
tree node ``i`` at ``past + depth_i``: along a root-to-node path these are exactly the positions of
the chain over that path, so each path sees what its chain would see.

When every layer has the same kind one 4-D mask serves all of them.  When full and sliding layers
mix, the decoder must take one mask per layer kind (transformers' ``{"full_attention": ...,
"sliding_attention": ...}`` mapping); `accepts_mask_mapping` checks that once with a two-token
forward, and targets whose decoder does not are refused (`deepspec.decoding.tree_mask.check_tree_target`).
"""
from __future__ import annotations

from typing import Dict, Union

import torch

__all__ = ["additive", "layer_masks", "accepts_mask_mapping"]


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool → additive (0 / most negative finite): what every attention path takes."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def _windowed(allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    return allowed & ((q_pos[:, None] - k_pos[None, :]) < int(window))


def layer_masks(arch, allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                dtype: torch.dtype) -> Union[torch.Tensor, Dict[str, torch.Tensor]]:
    """The [1, 1, q, k] additive mask (all layers of one kind) or one per layer kind.
    ``allowed`` [q, k] bool (cache + ancestors), ``q_pos`` [q] and ``k_pos`` [k] positions."""
    masks = {}
    for kind in arch.kinds:
        a = _windowed(allowed, q_pos, k_pos, arch.sliding_window) if kind == "sliding_attention" else allowed
        masks[kind] = additive(a[None, None], dtype)
    return next(iter(masks.values())) if len(masks) == 1 else masks


@torch.inference_mode()
def accepts_mask_mapping(target) -> bool:
    """Whether the decoder takes a mapping layer kind → 4-D mask (a two-token forward; cached)."""
    known = target.__dict__.get("_mask_mapping_ok")
    if known is not None:
        return known
    arch = target.arch
    allowed = torch.ones(2, 2, dtype=torch.bool).tril()
    pos = torch.arange(2)
    masks = {kind: additive(allowed[None, None], target.dtype).to(target.device) for kind in arch.kinds}
    ids = torch.zeros(1, 2, dtype=torch.long, device=target.device)
    try:
        target.decoder(input_ids=ids, attention_mask=masks, position_ids=pos[None].to(target.device),
                       use_cache=False)
        ok = True
    except (AttributeError, TypeError, KeyError, ValueError, RuntimeError):
        ok = False
    target.__dict__["_mask_mapping_ok"] = ok
    return ok
