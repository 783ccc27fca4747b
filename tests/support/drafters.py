"""A test-only drafter: i.i.d. draft tokens from one fixed distribution, no model run (the cheapest
poor draft, for the losslessness tests).  Importing this module registers it as
``fixed_distribution_draft``."""
from __future__ import annotations

from typing import Optional

import torch

from deepspec.config.draft import DraftConfig
from deepspec.drafts.base import Proposal
from deepspec.drafts.model_free import ModelFreeDrafter
from deepspec.drafts.registry import register_drafter

__all__ = ["FixedDistributionDraft"]


@register_drafter("fixed_distribution_draft")
class FixedDistributionDraft(ModelFreeDrafter):
    """Drafts i.i.d. tokens from ``warp(log(dist))`` (uniform when ``dist`` is None)."""

    def __init__(self, target, cfg: Optional[DraftConfig] = None, *, gamma: Optional[int] = None,
                 dist: Optional[torch.Tensor] = None, confidence: float = 0.5):
        super().__init__(target, cfg, gamma=gamma, algorithm="fixed_distribution_draft")
        v = self.vocab_size
        d = torch.full((v,), 1.0 / v) if dist is None else torch.as_tensor(dist, dtype=torch.float32).cpu()
        if d.shape != (v,) or (d < 0).any() or d.sum() <= 0:
            raise ValueError("dist must be a non-negative vector over the vocabulary")
        self.dist = d / d.sum()
        self.const_confidence = float(confidence)

    def init_state(self, input_ids, features=None):
        return {"device": torch.as_tensor(input_ids).device}

    @torch.inference_mode()
    def propose(self, state, anchor: int, gamma: int, warp, generator=None) -> Proposal:
        dev = state["device"] if generator is None else generator.device
        q = warp(torch.log(self.dist.to(dev)))
        qs = q.expand(int(gamma), -1).contiguous()
        toks = torch.multinomial(qs, 1, replacement=True, generator=generator).reshape(-1) if gamma else \
            torch.zeros(0, dtype=torch.long, device=dev)
        return Proposal(tokens=toks, probs=qs, confidence=torch.full((int(gamma),), self.const_confidence))

    def advance(self, state, tokens, features=None):
        return None
