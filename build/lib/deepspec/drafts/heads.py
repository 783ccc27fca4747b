"""DSpark heads on top of the parallel backbone.

Sequential heads add a prefix-dependent bias to the backbone's base logits
``U_k`` of block position k (k = 1..γ, x_0 = the anchor):

* Markov: ``bias_k = W1[x_{k-1}] · W2`` (W1: V×r embedding, W2: r×V).
* RNN:    ``z = [s_{k-1}; W1[x_{k-1}]; h_k]``,
          ``s_k = σ(W_g z) ⊙ s_{k-1} + (1 − σ(W_g z)) ⊙ tanh(W_c z)``,
          ``bias_k = tanh(W_o z) · W2``; one Linear produces gate/candidate/output, s_0 = 0.

Position k's bias depends on the block only through x_{<k} (and h_k).  In
training x_{k-1} is the true token (teacher forcing); in decoding it is the token
just sampled.  Both paths call the same `step`, so they agree exactly.  Every head
weight starts as in the reference (DeepSpec's ``_init_weights``): N(0, 0.02), biases 0.

Confidence head: ``c_k = σ(wᵀ[h_k; W1[x_{k-1}]])`` (returned as a logit; it shares
W1 with the sequential head, or owns one when there is none).

W1 is a learned V×r table (the paper; ``draft.head_embedding=table``) or, as a parameter-saving
ablation (``draft.head_embedding=target``), the target's frozen token embedding followed by a
learned r×H map: ``W1[x] = P·E[x]`` — H·r parameters instead of V·r (a 49k-token vocabulary at
r = 256: 0.15M instead of 12.6M).
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import nn

# The reference's initializer_range (HF ``_init_weights``: Linear and Embedding ~ N(0, 0.02)).
INIT_STD = 0.02


def _init_linear(m: nn.Linear) -> None:
    nn.init.normal_(m.weight, std=INIT_STD)
    if m.bias is not None:
        nn.init.zeros_(m.bias)


class SequentialHead(nn.Module):
    """Base: token embedding W1 and output matrix W2; subclasses define `step`.

    ``token_embed`` (ids -> frozen target embeddings [..., E], E = ``embed_dim``) selects the
    factored W1 (``P·E[x]``); without it W1 is a V×r table."""
    kind = "none"

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, out_vocab: Optional[int] = None,
                 token_embed: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 embed_dim: Optional[int] = None):
        super().__init__()
        self.rank = rank
        self.w1 = self.w1_proj = None
        self._token_embed = token_embed
        if token_embed is None:
            self.w1 = nn.Embedding(vocab_size, rank)                          # over every target token
            nn.init.normal_(self.w1.weight, std=INIT_STD)
        else:
            if not embed_dim:
                raise ValueError("a factored W1 (draft.head_embedding=target) needs the target's embedding width")
            self.w1_proj = nn.Linear(embed_dim, rank, bias=False)             # P: the target embedding -> rank r
            _init_linear(self.w1_proj)
        self.w2 = nn.Parameter(torch.empty(rank, out_vocab or vocab_size))    # over the draft vocabulary
        nn.init.normal_(self.w2, std=INIT_STD)

    def init_state(self, n: int, ref: torch.Tensor) -> Optional[torch.Tensor]:
        return None

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        if self.w1 is not None:
            return self.w1(prev)
        return self.w1_proj(self._token_embed(prev).to(self.w1_proj.weight.dtype))

    def low_rank_step(self, state, h: torch.Tensor, e: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One position: (state, h_k [R, H], e_k = W1[x_{k-1}] [R, r]) -> (u_k [R, r], new state);
        the bias is ``u_k · W2``."""
        raise NotImplementedError

    def step(self, state, h: torch.Tensor, e: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One position: (state, h_k, e_k) -> (bias [R, V], new state)."""
        u, state = self.low_rank_step(state, h, e)
        return u @ self.w2.to(u.dtype), state

    def low_rank(self, h: torch.Tensor, prev: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced: h [R, γ, H], prev = x_{k-1} [R, γ] -> (u [R, γ, r], e [R, γ, r]);
        bias = u · W2 (the fused loss multiplies by W2 chunk by chunk)."""
        e = self.embed(prev)
        state = self.init_state(h.shape[0], h)
        out = []
        for k in range(h.shape[1]):
            u, state = self.low_rank_step(state, h[:, k], e[:, k])
            out.append(u)
        return torch.stack(out, 1), e

    def forward(self, h: torch.Tensor, prev: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced: h [R, γ, H], prev [R, γ] -> (bias [R, γ, V], e [R, γ, r])."""
        u, e = self.low_rank(h, prev)
        return u @ self.w2.to(u.dtype), e


class MarkovHead(SequentialHead):
    kind = "markov"

    def low_rank_step(self, state, h, e):
        return e, None

    def low_rank(self, h, prev):  # vectorised, identical to looping `low_rank_step`
        e = self.embed(prev)
        return e, e


class RNNHead(SequentialHead):
    kind = "rnn"

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, out_vocab: Optional[int] = None, **w1):
        super().__init__(vocab_size, hidden_size, rank, out_vocab, **w1)
        self.cell = nn.Linear(2 * rank + hidden_size, 3 * rank)
        _init_linear(self.cell)

    def init_state(self, n, ref):
        return torch.zeros(n, self.rank, device=ref.device, dtype=ref.dtype)

    def low_rank_step(self, state, h, e):
        z = torch.cat([state.to(e.dtype), e, h.to(e.dtype)], dim=-1)
        g, c, o = self.cell(z).chunk(3, dim=-1)
        gate = torch.sigmoid(g)
        new = gate * state + (1 - gate) * torch.tanh(c)
        return torch.tanh(o), new


HEADS = {"markov": MarkovHead, "rnn": RNNHead}


def build_sequential_head(kind: str, vocab_size: int, hidden_size: int, rank: int,
                          out_vocab: Optional[int] = None,
                          token_embed: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                          embed_dim: Optional[int] = None) -> Optional[SequentialHead]:
    if kind in (None, "", "none"):
        return None
    if kind not in HEADS:
        raise ValueError(f"draft.sequential_head={kind!r}: choose from none, {', '.join(HEADS)}")
    return HEADS[kind](vocab_size, hidden_size, rank, out_vocab, token_embed=token_embed, embed_dim=embed_dim)


class ConfidenceHead(nn.Module):
    """Logit of c_k = σ(wᵀ[h_k; W1[x_{k-1}]]); owns W1 only when no sequential head provides one."""

    def __init__(self, hidden_size: int, rank: int, vocab_size: Optional[int] = None):
        super().__init__()
        self.w1 = None
        if vocab_size is not None:
            self.w1 = nn.Embedding(vocab_size, rank)
            nn.init.normal_(self.w1.weight, std=INIT_STD)
        self.proj = nn.Linear(hidden_size + rank, 1)
        _init_linear(self.proj)

    def forward(self, h: torch.Tensor, e: Optional[torch.Tensor] = None,
                prev: Optional[torch.Tensor] = None) -> torch.Tensor:
        if e is None:
            if self.w1 is None:
                raise ValueError("confidence head needs W1[x_{k-1}] from the sequential head")
            e = self.w1(prev)
        return self.proj(torch.cat([h.to(e.dtype), e], dim=-1)).squeeze(-1)
