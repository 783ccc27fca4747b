"""Per-sample deterministic sampling for batched generation.

Each row carries its own 63-bit seed.  The noise for (row seed, step, token) is a
counter-based hash (splitmix64 in int64 tensor ops), turned into Gumbel noise;
``argmax(log p + G)`` is an exact sample from ``p``.  No generator state is shared
between rows, so a sample's tokens do not depend on which other samples share its
batch, on the batch order, or on the device (integer ops are exact everywhere).  The warp
(temperature, top-k, top-p, min-p) is the speculative loops' own (`deepspec.decoding.warp`).
"""
from __future__ import annotations

import torch

from ..decoding.warp import warp_logits

_M64 = (1 << 64) - 1


def _s64(x: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    x &= _M64
    return x - (1 << 64) if x >= (1 << 63) else x


_GOLDEN = _s64(0x9E3779B97F4A7C15)
_C1 = _s64(0xBF58476D1CE4E5B9)
_C2 = _s64(0x94D049BB133111EB)


def _lsr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    z = x + _GOLDEN
    z = (z ^ _lsr(z, 30)) * _C1
    z = (z ^ _lsr(z, 27)) * _C2
    return z ^ _lsr(z, 31)


def uniform_noise(seeds: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """U(0,1) float64 noise [B, V] from per-row int64 seeds and the step number."""
    dev = seeds.device
    row = splitmix64(seeds.to(torch.int64) ^ splitmix64(torch.full_like(seeds, step, dtype=torch.int64)))
    tok = torch.arange(vocab, device=dev, dtype=torch.int64)
    z = splitmix64(row[:, None] + splitmix64(tok)[None, :])
    return (_lsr(z, 11).to(torch.float64) + 0.5) / float(1 << 53)


def gumbel_noise(seeds: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    u = uniform_noise(seeds, step, vocab)
    return -torch.log(-torch.log(u))


def sample_tokens(logits: torch.Tensor, seeds: torch.Tensor, step: int, temperature: float, top_k: int = 0,
                  top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """One token per row [B] (argmax when temperature is 0)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logp = warp_logits(logits, temperature, top_k, top_p, min_p)
    g = gumbel_noise(seeds.to(logits.device), step, logits.shape[-1])
    return (logp.double() + g).argmax(dim=-1)


class PerRowSampler:
    """A transformers `LogitsProcessor` that samples each row with its own seed.

    It returns a one-hot score (0 for the chosen token, -inf elsewhere), so run
    `generate` with ``do_sample=False``: greedy decoding then takes our sample.
    """

    def __init__(self, seeds: torch.Tensor, prompt_len: int, temperature: float, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0):
        self.seeds = seeds
        self.prompt_len = prompt_len
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, min_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_len
        tok = sample_tokens(scores, self.seeds, step, self.temperature, self.top_k, self.top_p, self.min_p)
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, tok[:, None], 0.0)
        return out
