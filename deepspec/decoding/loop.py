"""What every speculative loop shares, and plain decoding.

`DecodeLoop` holds the state the chain loop (`deepspec.decoding.chain`) and the tree loop
(`deepspec.decoding.tree_loop`) share: the prefill (the prompt's forward, the drafter's state, the first
token), the emitted tokens, each round's `RoundStats` and its timing marks, the finish.  A sequence ends
at the first EOS among the emitted tokens (tokens after it in the same round are dropped) or when
``max_new_tokens`` tokens exist.

`target_generate` is the plain target-only decode (same warp, KV cache, one token per forward): the
baseline for tokens/s and the reference for greedy equality.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence

import torch

from .row_invariant import row_invariant
from .warp import Warp, greedy_ids, sample_token

__all__ = ["RoundStats", "GenerationResult", "DecodeLoop", "target_generate"]


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
    lookup_accepted: int = 0      # accepted tokens that only the prompt-lookup chain proposed (trees)

    @property
    def tau(self) -> int:
        return self.accepted + 1

    def to_json(self) -> dict:
        return {"drafted": self.drafted, "proposed": self.proposed, "accepted": self.accepted,
                "emitted": self.emitted, "draft_tokens": self.draft_tokens, "confidence": self.confidence,
                "t_draft": self.t_draft, "t_verify": self.t_verify, "t_overhead": self.t_overhead,
                "lookup_accepted": self.lookup_accepted}


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


class _Marks:
    """Phase marks of the loop: CUDA events on a GPU (recorded on the stream, read once the generation
    is over: no host synchronisation inside a round), ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        """Time from mark ``a`` to mark ``b`` (on a GPU: after `finish`)."""
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def finish(self, device: torch.device) -> None:
        if self.cuda:
            torch.cuda.synchronize(device)


def _first_token(logits: torch.Tensor, warp: Warp, generator: Optional[torch.Generator]) -> int:
    """A token from target logits [V]: argmax under greedy (what sampling the one-hot warp gives,
    without drawing V exponentials), else a draw from the warped distribution."""
    if warp.greedy:
        return int(greedy_ids(logits))
    return sample_token(warp(logits), generator)


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


class DecodeLoop:
    """What the chain loop and the tree loop (`tree_loop`) share: the prefill (the prompt's forward,
    the drafter's state, the first token), the emitted tokens, each round's record and the finish."""

    def __init__(self, target, drafter, prompt_ids, warp: Warp, generator, eos_token_ids, max_new_tokens: int,
                 on_round=None, row_invariant: bool = False):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.device = target.device
        self.marks = _Marks(self.device)
        self.eos = _eos_set(target, eos_token_ids)
        self.max_new_tokens = max_new_tokens
        self.on_round = on_round
        self.target, self.row_invariant = target, bool(row_invariant)
        ids = _ids_tensor(prompt_ids, self.device)
        self.wall0 = time.perf_counter()
        self.m_start = self.marks.mark()
        out = target.decode(ids[None])
        self.cache = out.past_key_values
        self.cache_len = ids.numel()
        self.state = drafter.init_state(ids, out.features[0])
        self.anchor = _first_token(out.logits[0, -1], warp, generator)
        self.tokens: List[int] = []
        self.stop = _append(self.tokens, [self.anchor], self.eos, max_new_tokens)
        self.m_prefill = self.marks.mark()
        self.result = GenerationResult(prompt_len=ids.numel(), tokens=self.tokens, stop_reason=self.stop or "")
        self.pending = []   # (RoundStats, its six marks) on a GPU: timings are read at the end

    def verify(self, ids: torch.Tensor, **kw):
        """The round's verification forward over ``ids`` [1, n] (``kw``: a tree's mask and positions); with
        ``row_invariant`` every row through the one-token attention call (`deepspec.decoding.row_invariant`)."""
        if not self.row_invariant:
            return self.target.decode(ids, self.cache, **kw)
        with row_invariant(self.target):
            return self.target.decode(ids, self.cache, **kw)

    @property
    def room(self) -> int:
        """Draft tokens a round can still use (it emits accepted + 1 tokens)."""
        return self.max_new_tokens - len(self.tokens) - 1

    def emit(self, new: Sequence[int]) -> int:
        """Append a round's tokens (up to EOS / the budget); returns how many were appended."""
        before = len(self.tokens)
        self.stop = _append(self.tokens, new, self.eos, self.max_new_tokens)
        return len(self.tokens) - before

    def record(self, rs: "RoundStats", marks6) -> None:
        if not self.marks.cuda:
            _set_times(rs, self.marks, marks6)
        else:
            self.pending.append((rs, marks6))
        self.result.rounds.append(rs)
        if self.on_round is not None:
            self.on_round(len(self.result.rounds) - 1, rs)

    def finish(self) -> GenerationResult:
        m_end = self.marks.mark()
        self.marks.finish(self.device)
        for rs, m in self.pending:
            _set_times(rs, self.marks, m)
        r = self.result
        r.stop_reason = self.stop
        r.t_prefill = self.marks.seconds(self.m_start, self.m_prefill)
        r.t_total = self.marks.seconds(self.m_start, m_end) if self.marks.cuda else time.perf_counter() - self.wall0
        return r


def _set_times(rs: RoundStats, marks: _Marks, m) -> None:
    m0, m1, m2, m3, m4, m5 = m
    rs.t_draft = marks.seconds(m0, m1) + marks.seconds(m4, m5)
    rs.t_verify = marks.seconds(m2, m3)
    rs.t_overhead = marks.seconds(m1, m2) + marks.seconds(m3, m4)


@torch.inference_mode()
def target_generate(target, prompt_ids, *, max_new_tokens: int, warp: Warp,
                    generator: Optional[torch.Generator] = None,
                    eos_token_ids: Optional[Iterable[int]] = None) -> GenerationResult:
    """Plain autoregressive decoding with the target alone (one token per forward)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = target.device
    marks = _Marks(device)
    eos = _eos_set(target, eos_token_ids)
    ids = _ids_tensor(prompt_ids, device)
    wall0 = time.perf_counter()
    m_start = marks.mark()
    out = target.decode(ids[None])
    cache = out.past_key_values
    tok = _first_token(out.logits[0, -1], warp, generator)
    tokens: List[int] = []
    stop = _append(tokens, [tok], eos, max_new_tokens)
    m_prefill = marks.mark()
    step = torch.empty(1, 1, dtype=torch.long, device=device)
    while stop is None:
        step.fill_(tok)
        out = target.decode(step, cache)
        cache = out.past_key_values
        tok = _first_token(out.logits[0, -1], warp, generator)
        stop = _append(tokens, [tok], eos, max_new_tokens)
    m_end = marks.mark()
    marks.finish(device)
    return GenerationResult(prompt_len=ids.numel(), tokens=tokens, stop_reason=stop,
                            t_prefill=marks.seconds(m_start, m_prefill),
                            t_total=marks.seconds(m_start, m_end) if marks.cuda else time.perf_counter() - wall0)
