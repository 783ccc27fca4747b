"""The target side of tree verification: one forward over the anchor and every node of a draft tree.

Query row 0 is the anchor, row ``i ≥ 1`` the tree's node ``i − 1``.  Each row attends to the whole
KV cache and to its own ancestors in the tree (itself included), and sits at position
``cache length + depth`` — so every root-to-node path sees exactly what a chain forward over that path
would see, and its logits are that chain's logits (up to the rounding of a different kernel shape).
transformers takes such a 4-D (additive) mask as it is; `TargetAdapter.decode` runs it through
`deepspec.targets.attention.tree_attention` (GQA inside SDPA) where the model allows, else through the stock
attention.  Sliding-window layers get the window inside their mask (`deepspec.targets.tree_masks`); targets
with recurrent layers, or whose decoder cannot take a mask per layer kind where full and sliding layers mix,
are refused.
"""
from __future__ import annotations

from typing import Tuple

import torch

from ..targets.architecture import TargetUnsupported
from ..targets.tree_masks import accepts_mask_mapping, additive, layer_masks

__all__ = ["check_tree_target", "ancestor_mask", "tree_inputs"]


def check_tree_target(target) -> None:
    """Raise `TargetUnsupported` (one line, with the reason) where trees cannot be verified exactly."""
    arch = target.arch
    why = arch.tree_refusal()
    if why is None and len(arch.kinds) > 1 and not accepts_mask_mapping(target):
        why = "its decoder takes one attention mask for layers that mix full and sliding-window attention"
    if why:
        raise TargetUnsupported(f"target {target.name}: tree verification (eval.tree_nodes) refused: {why} "
                                "(use chain verification)")


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[n+1, n+1] bool: row i attends to column j when j is i or an ancestor of i; ``parents`` [n] are
    the nodes' parent indices (−1 = the anchor), each smaller than the node's own index."""
    n = int(parents.shape[0])
    m = torch.eye(n + 1, dtype=torch.bool)
    for i, p in enumerate(parents.tolist()):
        if not -1 <= p < i:
            raise ValueError(f"tree node {i} has parent {p}: parents must come before their children")
        m[i + 1] |= m[p + 1]
    return m


def tree_inputs(target, parents: torch.Tensor, depths: torch.Tensor, past: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(attention mask [1, 1, n+1, past+n+1] — one per layer kind where full and sliding-window layers
    mix —, position ids [1, n+1]) for `TargetAdapter.decode`."""
    anc = ancestor_mask(parents)
    pos = torch.cat([torch.zeros(1, dtype=torch.long), depths.long().cpu()]) + past
    allowed = torch.cat([torch.ones(anc.shape[0], past, dtype=torch.bool), anc], dim=1)
    if target.arch.sliding:       # the window inside the mask of the sliding layers
        masks = layer_masks(target.arch, allowed, pos, torch.cat([torch.arange(past), pos]), target.dtype)
        if isinstance(masks, dict):
            return {k: m.to(target.device) for k, m in masks.items()}, pos[None].to(target.device)
        return masks.to(target.device), pos[None].to(target.device)
    # additive (0 / −∞-like): what every attention path takes, and SDPA's fastest form on the CPU
    return additive(allowed[None, None], target.dtype).to(target.device), pos[None].to(target.device)
