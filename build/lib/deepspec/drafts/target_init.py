"""Initialise draft layers from one decoder layer of the target (`draft.init_from_target_layer`).

An ablation, not part of the DSpark or DFlash papers: the draft layers have the target's own
sizes (`DraftDims.from_target`), so a target decoder layer's attention projections
(``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``) and MLP (``gate_proj``, ``up_proj``,
``down_proj``) fit them one to one.  They are found by those names anywhere inside the
target layer (``self_attn.q_proj``, ``mlp.gate_proj`` in the HF Llama/Qwen/Gemma layouts),
so no family is named here.  Norms keep their init: families scale them differently
(Gemma stores ``weight − 1``) and they are the cheapest parameters to learn.
"""
from __future__ import annotations

import logging
from typing import Dict, List

import torch
from torch import nn

log = logging.getLogger(__name__)

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _linears_by_name(layer: nn.Module) -> Dict[str, nn.Module]:
    """The target layer's modules named like a projection, by their last name component."""
    found: Dict[str, List[str]] = {}
    mods: Dict[str, nn.Module] = {}
    for path, mod in layer.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        if leaf in ATTN + MLP and getattr(mod, "weight", None) is not None:
            found.setdefault(leaf, []).append(path)
            mods[leaf] = mod
    twice = {k: v for k, v in found.items() if len(v) > 1}
    if twice:
        raise ValueError(f"draft.init_from_target_layer: the target layer has several modules named {twice}")
    return mods


@torch.no_grad()
def init_layers_from_target(layers: nn.ModuleList, target, index: int) -> List[str]:
    """Copy target layer ``index``'s projections into every draft layer (an ``attn`` with
    q/k/v/o and an ``mlp`` with gate/up/down each); returns the draft parameter names set."""
    n = len(target.layers)
    if not -n <= int(index) < n:
        raise ValueError(f"draft.init_from_target_layer={index}: the target has {n} decoder layers "
                         f"(valid: {-n}..{n - 1})")
    src = _linears_by_name(target.layers[int(index)])
    missing = [k for k in ATTN + MLP if k not in src]
    if missing:
        raise ValueError(f"draft.init_from_target_layer={index}: target layer has no {missing}")
    copied = []
    for li, layer in enumerate(layers):
        for group, names in (("attn", ATTN), ("mlp", MLP)):
            owner = getattr(layer, group, None)
            for name in names:
                dst = getattr(owner, name, None) if owner is not None else None
                if dst is None:
                    raise ValueError(f"draft.init_from_target_layer: draft layer {li} has no {group}.{name}")
                w = src[name].weight
                if tuple(dst.weight.shape) != tuple(w.shape):
                    raise ValueError(f"draft.init_from_target_layer={index}: {group}.{name} is "
                                     f"{tuple(dst.weight.shape)} in the draft, {tuple(w.shape)} in the target "
                                     "(leave draft.hidden_size/heads unset to use the target's sizes)")
                dst.weight.copy_(w.to(device=dst.weight.device, dtype=dst.weight.dtype))
                copied.append(f"layers.{li}.{group}.{name}.weight")
    log.info("draft.init_from_target_layer=%d: %d draft layers start from target layer %d",
             index, len(layers), index % n)
    return copied
