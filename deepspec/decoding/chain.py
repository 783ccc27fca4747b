"""Batch-size-1 lossless speculative decoding with the target's KV cache.

The loop never names an algorithm: it talks to the drafter only through the
decoding API of the contract (``init_state / propose / advance``)::

    prefill   target.decode(prompt)            -> cache, features of every prompt token
              state = drafter.init_state(prompt, features)
              x_0 ~ warp(p(· | prompt))        (the "prefill token", the first anchor)
    round     proposal = drafter.propose(state, anchor, γ, warp, generator)
              ℓ = policy(confidences) ≤ γ      (fixed γ by default)
              target.decode([anchor, d_1..d_ℓ], cache)          ONE forward
              accept / reject (acceptance.verify)  -> n accepted, next token
              target.rollback(cache, len + 1 + n)
              drafter.advance(state, [anchor, d_1..d_n], their verify features)
              anchor = next token (correction or bonus)

Each round emits ``n + 1`` tokens.  A sequence ends at the first EOS among the
emitted tokens (tokens after it in the same block are dropped) or when
``max_new_tokens`` tokens exist; the verification length is capped so that a
round never produces more tokens than are still allowed.

The loop state, the records and plain decoding are `deepspec.decoding.loop`; the verification-length
policy hook is `deepspec.decoding.policy`.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from .acceptance import accept_greedy, verify_sampling
from .loop import DecodeLoop, GenerationResult, RoundStats
from .policy import confidence_list, needs_confidences, verify_length
from .warp import Warp, greedy_ids

__all__ = ["speculative_generate"]


@torch.inference_mode()
def speculative_generate(target, drafter, prompt_ids, *, gamma: int, max_new_tokens: int, warp: Warp,
                         generator: Optional[torch.Generator] = None,
                         eos_token_ids: Optional[Iterable[int]] = None, policy: Any = None,
                         on_round=None, row_invariant: bool = False) -> GenerationResult:
    """Lossless speculative decoding of one prompt (batch size 1).

    ``policy``: an object with ``lengths(confidences[R, γ]) -> list[int]`` choosing how many
    draft tokens to verify (None = all).  ``on_round(round_index, RoundStats)`` is called
    after each round (rollout logging).  ``row_invariant``: verification rows round like one-token steps
    (`deepspec.decoding.row_invariant`)."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    loop = DecodeLoop(target, drafter, prompt_ids, warp, generator, eos_token_ids, max_new_tokens, on_round,
                      row_invariant)
    device, marks, state = loop.device, loop.marks, loop.state
    while loop.stop is None:
        anchor = loop.anchor
        m0 = marks.mark()
        prop = drafter.propose(state, anchor, gamma, warp, generator)
        m1 = marks.mark()
        draft_t = torch.as_tensor(prop.tokens).reshape(-1)[:gamma].to(device=device, dtype=torch.long)
        drafted = int(draft_t.numel())
        conf_t = getattr(prop, "confidence", None)
        conf = confidence_list(conf_t) if drafted > 0 and needs_confidences(policy) else None
        # never verify more than the token budget can still use (the round emits ℓ + 1 tokens)
        ell = max(min(verify_length(policy, conf, drafted), loop.room), 0)
        # the anchor as a non-blocking host → device copy: no wait for the draft pass still queued on a GPU
        verify_ids = torch.cat([torch.tensor([anchor], dtype=torch.long).to(device, non_blocking=True),
                                draft_t[:ell]])
        m2 = marks.mark()
        vout = loop.verify(verify_ids[None])
        loop.cache = vout.past_key_values
        m3 = marks.mark()
        if warp.greedy:
            # one device -> host transfer per round: the drafts and the target's argmax at ℓ + 1 rows
            best = greedy_ids(vout.logits[0, : ell + 1])
            host = torch.cat([draft_t, best]).tolist()
            draft, res = host[:drafted], accept_greedy(host[:ell], host[drafted:])
        else:
            draft = draft_t.tolist()
            res = verify_sampling(draft[:ell], prop.probs[:ell] if ell else None, warp(vout.logits[0]), generator)
        if conf is None and conf_t is not None:
            conf = confidence_list(conf_t)
        n = res.accepted
        target.rollback(loop.cache, loop.cache_len + 1 + n)
        loop.cache_len += 1 + n
        emitted = loop.emit(res.tokens)
        m4 = marks.mark()
        if loop.stop is None:
            drafter.advance(state, verify_ids[: n + 1], vout.features[0, : n + 1])
        m5 = marks.mark()
        loop.record(RoundStats(drafted=drafted, proposed=ell, accepted=n, emitted=emitted,
                               draft_tokens=draft, confidence=conf), (m0, m1, m2, m3, m4, m5))
        loop.anchor = res.next_token
    return loop.finish()


