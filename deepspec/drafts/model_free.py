"""Drafters without trained weights: the baselines a trained draft is measured against.

- `NoDraft` (``draft.algorithm=no_draft``) proposes nothing: chains verify the anchor alone (plain
  decoding through the speculative loop) and trees are empty, so with ``eval.lookup_ngram`` a round
  verifies only the prompt-lookup chain: prompt-lookup decoding with no draft model, the baseline that
  tells what a draft adds to the lookup.
- `TargetAsDraft` (``draft.algorithm=target_as_draft``) runs the target itself autoregressively with its
  own KV cache.  With ``logit_scale=1`` it is the oracle: under greedy decoding it drafts exactly the
  target's tokens (τ = γ + 1 per round), under sampling q = p (every draft accepted) — the upper bound of
  any draft.  ``logit_scale=-1`` drafts the target's *least* likely token (always rejected greedily: τ = 1).

Both implement only the decoding API of the contract (``init_state / propose / advance``, and
``tree_expansion`` for `NoDraft`); `ModelFreeDrafter` is their base (nothing to train, lives on the
target's device).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from ..config.draft import DraftConfig
from .base import Drafter, Proposal
from .checkpoint import coerce_draft_config
from .registry import register_drafter

__all__ = ["ModelFreeDrafter", "NoDraft", "TargetAsDraft"]


@dataclass
class _TargetDraftState:
    cache: object
    committed: int                                   # verified tokens in the cache
    fed: List[int] = field(default_factory=list)     # unverified tokens in the cache (last propose)
    pending: List[int] = field(default_factory=list)  # verified tokens not yet in the cache


class ModelFreeDrafter(Drafter):
    """No trainable weights: nothing to train, lives on the target's device."""
    model_free = True

    def __init__(self, target, cfg: Optional[DraftConfig] = None, *, gamma: Optional[int] = None,
                 algorithm: str = ""):
        cfg = coerce_draft_config(cfg if cfg is not None else DraftConfig())
        cfg = dataclasses.replace(cfg, algorithm=algorithm, **({} if gamma is None else {"gamma": int(gamma)}))
        if cfg.mask_token_id is None:      # never fed to anything: no block positions to mask, no search for one
            cfg = dataclasses.replace(cfg, mask_token_id=0)
        super().__init__(target, cfg)

    @property
    def gamma(self) -> int:
        return int(self.cfg.gamma)

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.float32

    @classmethod
    def from_target(cls, target, cfg=None, **kw):
        return cls(target, cfg, **kw)

    def forward(self, batch):
        raise NotImplementedError(f"{type(self).__name__} has no trained weights; it drafts for evaluation "
                                  "only and has nothing to train")


@register_drafter("target_as_draft")
class TargetAsDraft(ModelFreeDrafter):
    """The target drafting for itself (optionally with scaled logits)."""

    def __init__(self, target, cfg: Optional[DraftConfig] = None, *, gamma: Optional[int] = None,
                 logit_scale: float = 1.0):
        super().__init__(target, cfg, gamma=gamma, algorithm="target_as_draft")
        self.logit_scale = float(logit_scale)

    # -- decoding API -----------------------------------------------------------------
    @torch.inference_mode()
    def init_state(self, input_ids: torch.Tensor, features: Optional[torch.Tensor] = None):
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1).to(self.target.device)
        out = self.target.decode(ids[None])
        return _TargetDraftState(cache=out.past_key_values, committed=ids.numel())

    @torch.inference_mode()
    def propose(self, state: _TargetDraftState, anchor: int, gamma: int, warp, generator=None) -> Proposal:
        t = self.target
        feed = state.pending + [int(anchor)]
        toks, probs, conf = [], [], []
        for _ in range(int(gamma)):
            out = t.decode(torch.tensor([feed], dtype=torch.long, device=t.device), state.cache)
            state.cache = out.past_key_values
            logits = out.logits[0, -1] * self.logit_scale
            q = warp(logits)
            d = int(torch.multinomial(q, 1, generator=generator).item())
            toks.append(d)
            probs.append(q)
            conf.append(torch.softmax(logits.float(), -1)[d])
            feed = [d]
        # the cache now holds the pending tokens, the anchor and d_1..d_{γ-1}
        state.committed += len(state.pending)
        state.pending = []
        state.fed = [int(anchor)] + toks[:-1]
        dev = t.device
        return Proposal(tokens=torch.tensor(toks, dtype=torch.long, device=dev),
                        probs=torch.stack(probs).float() if probs else torch.zeros(0, t.vocab_size, device=dev),
                        confidence=torch.stack(conf).float() if conf else torch.zeros(0, device=dev))

    def advance(self, state: _TargetDraftState, tokens: torch.Tensor, features: Optional[torch.Tensor] = None):
        new = [int(x) for x in torch.as_tensor(tokens).reshape(-1).tolist()]
        m = 0
        while m < min(len(new), len(state.fed)) and new[m] == state.fed[m]:
            m += 1
        # keep the cached prefix that was verified; the rest is fed with the next anchor
        self.target.rollback(state.cache, state.committed + m)
        state.committed += m
        state.pending = new[m:]
        state.fed = []


@register_drafter("no_draft")
class NoDraft(ModelFreeDrafter):
    """Proposes no token: an empty chain, an empty tree."""
    drafts_trees = True
    # eval.decoding=auto: prompt-lookup decoding (n ≤ 3, the n-gram chosen on the tuning prompts; 2026-12-05,
    # eval prompts, bf16, one thread: τ 1.45, 1.25× over plain, bench/results/tree_speed-lookup_only.md)
    decoding_defaults = {mode: {"tree_nodes": 16, "tree_width": 8, "lookup_ngram": 3} for mode in ("greedy", "sampled")}

    def __init__(self, target, cfg: Optional[DraftConfig] = None, *, gamma: Optional[int] = None):
        super().__init__(target, cfg, gamma=gamma, algorithm="no_draft")

    def init_state(self, input_ids, features=None):
        return None

    def propose(self, state, anchor: int, gamma: int, warp, generator=None) -> Proposal:
        dev = self.target.device
        return Proposal(tokens=torch.zeros(0, dtype=torch.long, device=dev),
                        probs=torch.zeros(0, self.vocab_size, device=dev), confidence=None)

    def tree_expansion(self, state, anchor: int, gamma: int):
        return None

    def advance(self, state, tokens, features=None):
        return None
