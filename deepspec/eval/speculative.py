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

`target_generate` is the plain target-only decode (same warp, KV cache, one token
per forward): the baseline for tokens/s and the reference for greedy equality.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Optional, Sequence

import torch

from .acceptance import verify_greedy, verify_sampling
from .sampling import Warp, sample_token

log = logging.getLogger(__name__)

__all__ = ["RoundStats", "GenerationResult", "speculative_generate", "target_generate",
           "FixedLengthPolicy"]


@dataclass
class RoundStats:
    """One verification round."""
    drafted: int                  # draft tokens proposed by the drafter (γ)
    proposed: int                 # draft tokens sent to verification (ℓ ≤ γ)
    accepted: int                 # draft tokens accepted (0..ℓ)
    emitted: int                  # tokens appended to the output (accepted + 1, less if EOS/max cut)
    draft_tokens: List[int]
    confidence: Optional[List[float]]
    t_draft: float = 0.0          # propose + advance (seconds)
    t_verify: float = 0.0         # the target's verification forward
    t_overhead: float = 0.0       # everything else in the round (acceptance, rollback, bookkeeping)

    @property
    def tau(self) -> int:
        return self.accepted + 1

    def to_json(self) -> dict:
        return {"drafted": self.drafted, "proposed": self.proposed, "accepted": self.accepted,
                "emitted": self.emitted, "draft_tokens": self.draft_tokens, "confidence": self.confidence,
                "t_draft": self.t_draft, "t_verify": self.t_verify, "t_overhead": self.t_overhead}


@dataclass
class GenerationResult:
    prompt_len: int
    tokens: List[int]                         # generated tokens (EOS included when hit)
    stop_reason: str                          # "eos" | "max_new_tokens"
    rounds: List[RoundStats] = field(default_factory=list)
    t_prefill: float = 0.0                    # prompt forward + drafter init + first token
    t_total: float = 0.0                      # whole call (prefill included)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def t_decode(self) -> float:
        return max(self.t_total - self.t_prefill, 0.0)

    @property
    def t_draft(self) -> float:
        return sum(r.t_draft for r in self.rounds)

    @property
    def t_verify(self) -> float:
        return sum(r.t_verify for r in self.rounds)

    @property
    def t_overhead(self) -> float:
        return sum(r.t_overhead for r in self.rounds)

    @property
    def tau(self) -> float:
        return sum(r.tau for r in self.rounds) / len(self.rounds) if self.rounds else float("nan")


class FixedLengthPolicy:
    """Verify every drafted token (ℓ = γ); the default policy."""
    name = "fixed"

    def lengths(self, confidences) -> List[int]:
        if confidences is None:
            raise ValueError("FixedLengthPolicy.lengths needs the [R, γ] shape; the loop passes γ itself")
        c = torch.as_tensor(confidences)
        c = c[None] if c.dim() == 1 else c
        return [int(c.shape[-1])] * int(c.shape[0])


def _clock(device: torch.device):
    if device.type == "cuda":
        def now():
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return now
    return time.perf_counter


def _ids_tensor(ids, device) -> torch.Tensor:
    t = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids), dtype=torch.long)
    t = t.reshape(-1).to(device=device, dtype=torch.long)
    if t.numel() == 0:
        raise ValueError("empty prompt: the target needs at least one prompt token")
    return t


def _eos_set(target, eos_token_ids: Optional[Iterable[int]]) -> frozenset:
    ids = target.eos_token_ids if eos_token_ids is None else eos_token_ids
    return frozenset(int(i) for i in ids)


def _append(out: List[int], new: Sequence[int], eos: frozenset, max_new_tokens: int) -> Optional[str]:
    """Append ``new`` to ``out`` stopping at the first EOS / the token budget."""
    for t in new:
        out.append(int(t))
        if int(t) in eos:
            return "eos"
        if len(out) >= max_new_tokens:
            return "max_new_tokens"
    return None


def _conf_list(conf) -> Optional[List[float]]:
    if conf is None:
        return None
    return [float(x) for x in torch.as_tensor(conf).reshape(-1).float().tolist()]


_warned_no_conf = False


def _verify_length(policy, conf: Optional[List[float]], drafted: int) -> int:
    global _warned_no_conf
    if policy is None or drafted == 0 or isinstance(policy, FixedLengthPolicy):
        return drafted
    if conf is None and getattr(policy, "name", "") == "fixed":
        return drafted
    if conf is None:
        if not _warned_no_conf:
            log.warning("verification policy %s needs confidences but the drafter gives none: "
                        "verifying the whole draft", getattr(policy, "name", type(policy).__name__))
            _warned_no_conf = True
        return drafted
    ell = policy.lengths(torch.tensor([conf[:drafted]], dtype=torch.float32))
    return max(0, min(int(ell[0]), drafted))


@torch.inference_mode()
def speculative_generate(target, drafter, prompt_ids, *, gamma: int, max_new_tokens: int, warp: Warp,
                         generator: Optional[torch.Generator] = None,
                         eos_token_ids: Optional[Iterable[int]] = None, policy: Any = None,
                         on_round=None) -> GenerationResult:
    """Lossless speculative decoding of one prompt (batch size 1).

    ``policy``: an object with ``lengths(confidences[R, γ]) -> list[int]`` choosing how many
    draft tokens to verify (None = all).  ``on_round(round_index, RoundStats)`` is called
    after each round (rollout logging)."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = target.device
    now = _clock(device)
    eos = _eos_set(target, eos_token_ids)
    ids = _ids_tensor(prompt_ids, device)

    t_start = now()
    out = target.decode(ids[None])
    cache = out.past_key_values
    cache_len = ids.numel()
    state = drafter.init_state(ids, out.features[0])
    anchor = sample_token(warp(out.logits[0, -1]), generator)
    tokens: List[int] = []
    stop = _append(tokens, [anchor], eos, max_new_tokens)
    t_prefill = now() - t_start
    result = GenerationResult(prompt_len=ids.numel(), tokens=tokens, stop_reason=stop or "", t_prefill=t_prefill)

    while stop is None:
        t0 = now()
        prop = drafter.propose(state, anchor, gamma, warp, generator)
        t1 = now()
        draft = [int(x) for x in torch.as_tensor(prop.tokens).reshape(-1).tolist()][:gamma]
        conf = _conf_list(getattr(prop, "confidence", None))
        drafted = len(draft)
        # never verify more than the token budget can still use (the round emits ℓ + 1 tokens)
        ell = min(_verify_length(policy, conf, drafted), max_new_tokens - len(tokens) - 1)
        ell = max(ell, 0)
        verify_ids = torch.tensor([anchor] + draft[:ell], dtype=torch.long, device=device)
        t2 = now()
        vout = target.decode(verify_ids[None], cache)
        cache = vout.past_key_values
        t3 = now()
        if warp.greedy:
            res = verify_greedy(draft[:ell], vout.logits[0])
        else:
            res = verify_sampling(draft[:ell], prop.probs[:ell] if ell else None, warp(vout.logits[0]), generator)
        n = res.accepted
        target.rollback(cache, cache_len + 1 + n)
        cache_len += 1 + n
        before = len(tokens)
        stop = _append(tokens, res.tokens, eos, max_new_tokens)
        t4 = now()
        if stop is None:
            drafter.advance(state, verify_ids[: n + 1], vout.features[0, : n + 1])
        t5 = now()
        rs = RoundStats(drafted=drafted, proposed=ell, accepted=n, emitted=len(tokens) - before,
                        draft_tokens=draft, confidence=conf,
                        t_draft=(t1 - t0) + (t5 - t4), t_verify=t3 - t2, t_overhead=(t2 - t1) + (t4 - t3))
        result.rounds.append(rs)
        if on_round is not None:
            on_round(len(result.rounds) - 1, rs)
        anchor = res.next_token
    result.stop_reason = stop
    result.t_total = now() - t_start
    return result


@torch.inference_mode()
def target_generate(target, prompt_ids, *, max_new_tokens: int, warp: Warp,
                    generator: Optional[torch.Generator] = None,
                    eos_token_ids: Optional[Iterable[int]] = None) -> GenerationResult:
    """Plain autoregressive decoding with the target alone (one token per forward)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = target.device
    now = _clock(device)
    eos = _eos_set(target, eos_token_ids)
    ids = _ids_tensor(prompt_ids, device)
    t_start = now()
    out = target.decode(ids[None])
    cache = out.past_key_values
    tok = sample_token(warp(out.logits[0, -1]), generator)
    tokens: List[int] = []
    stop = _append(tokens, [tok], eos, max_new_tokens)
    t_prefill = now() - t_start
    step = torch.empty(1, 1, dtype=torch.long, device=device)
    while stop is None:
        step.fill_(tok)
        out = target.decode(step, cache)
        cache = out.past_key_values
        tok = sample_token(warp(out.logits[0, -1]), generator)
        stop = _append(tokens, [tok], eos, max_new_tokens)
    return GenerationResult(prompt_len=ids.numel(), tokens=tokens, stop_reason=stop,
                            t_prefill=t_prefill, t_total=now() - t_start)
