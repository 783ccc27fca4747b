"""Reference drafters: real drafters with known acceptance, for tests and upper bounds.

- `TargetAsDraft` (registered as ``target_as_draft``) runs the target itself
  autoregressively with its own KV cache.  With ``logit_scale=1`` it is the oracle:
  under greedy decoding it drafts exactly the target's tokens (τ = γ + 1 per round),
  under sampling q = p (every draft accepted).  ``logit_scale=-1`` drafts the target's
  *least* likely token (always rejected in greedy mode: τ = 1); other scales give
  deliberately poor drafts for the losslessness tests.
- `FixedDistributionDraft` proposes i.i.d. tokens from one fixed distribution
  (uniform by default) without running any model: the cheapest poor draft.
- `NoDraft` (``no_draft``) proposes nothing: chains verify the anchor alone (plain decoding through
  the speculative loop), and trees are empty, so with ``eval.lookup_ngram`` a round verifies only
  the prompt-lookup chain: prompt-lookup decoding with no draft model, the baseline that tells
  what a draft adds to the lookup.

They implement only the decoding API of the contract (``init_state / propose / advance``, and
``tree_expansion`` for `NoDraft`); they have no trainable weights.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from deepspec.config.draft import DraftConfig
from deepspec.drafts.base import Drafter, Proposal
from deepspec.drafts.checkpoint import coerce_draft_config
from deepspec.drafts.registry import register_drafter

__all__ = ["TargetAsDraft", "FixedDistributionDraft", "NoDraft", "Proposal"]


@dataclass
class _TargetDraftState:
    cache: object
    committed: int                                   # verified tokens in the cache
    fed: List[int] = field(default_factory=list)     # unverified tokens in the cache (last propose)
    pending: List[int] = field(default_factory=list)  # verified tokens not yet in the cache


class _ReferenceDrafter(Drafter):
    """No trainable weights: nothing to train, lives on the target's device."""
    is_reference = True

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
        raise NotImplementedError(f"{type(self).__name__} is a reference drafter for evaluation; "
                                  "it has nothing to train")


@register_drafter("target_as_draft")
class TargetAsDraft(_ReferenceDrafter):
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


@register_drafter("fixed_distribution_draft")
class FixedDistributionDraft(_ReferenceDrafter):
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


@register_drafter("no_draft")
class NoDraft(_ReferenceDrafter):
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
