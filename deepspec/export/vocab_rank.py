"""A reduced draft vocabulary written as one more Markov rank dimension (the sglang format's DSpark).

SGLang's DSpark (`models/dspark.py`) and SpecForge's score every target token: base logits from the
target's LM head plus the Markov bias ``markov_w2(u)``, ``u = markov_w1[x_{k-1}]`` (vanilla) or
``u = tanh(o)`` of the RNN step, and they read no ``d2t``.  A draft trained on N of the V tokens is
written there exactly by appending one rank dimension (index r = the trained rank) to the head:

* ``markov_w1[:, r] = 1`` for every token, so ``u_r = 1`` whatever x_{k-1} is.  RNN head
  (``joint_proj``: input ``[state; e; h]``, output chunks gate / candidate / output): the output row
  of dimension r has zero weights and bias `RNN_OUTPUT_BIAS` (``tanh`` of it is 1.0 in fp32, bf16 and
  fp16); the gate and candidate rows of r and every weight reading state r or embedding r are 0,
  so state r stays 0 and no trained dimension sees the new one;
* ``markov_w2[v, r] = 0`` on the N draft tokens and `VOCAB_BIAS` on every other token; its first r
  columns hold our W2 on the draft tokens and 0 elsewhere;
* the confidence head, which reads ``[h; markov_w1[x_{k-1}]]``, gets weight 0 on the new coordinate.

A draft token's logit is then its LM-head logit plus its trained bias plus 1·0 — the draft's logit
— and every other token's logit is its LM-head logit + `VOCAB_BIAS`: after the softmax exactly 0
in fp32 and bf16 (``exp`` underflows to 0 below −103.97) as long as the spread of the LM-head logits
stays under 16384 − 104.  The config states ``markov_rank`` = the trained rank + 1 (1 without
sequential head); confidences are unchanged.

`VOCAB_BIAS` = −2¹⁴: a power of two, so the export holds exactly that value in fp32, bf16 and fp16
and the importer recognises it; finite, so no engine arithmetic on the logits (temperature,
penalties, ``p·log p``) meets an ``inf·0`` or ``inf − inf``; and far from fp16's −65504, so a
temperature down to 0.25 keeps it finite.  The most negative finite value of the dtype would
overflow to −inf at any temperature below 1.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .errors import ImportUnsupported

VOCAB_BIAS = -2.0 ** 14
RNN_OUTPUT_BIAS = 16.0
W1, W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"
CELL_W, CELL_B = "markov_head.joint_proj.weight", "markov_head.joint_proj.bias"
CONF_W = "confidence_head.proj.weight"
KEYS = (W1, W2, CELL_W, CELL_B, CONF_W)


def _cell_index(r: int, hidden: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns) of a rank-r RNN ``joint_proj`` inside the rank-(r+1) one."""
    R = r + 1
    rows = torch.tensor([c * R + i for c in range(3) for i in range(r)], dtype=torch.long)
    cols = torch.cat([torch.arange(r), R + torch.arange(r), 2 * R + torch.arange(hidden)])
    return rows, cols


def add_vocab_rank(weights: Dict[str, torch.Tensor], ids: torch.Tensor, vocab_size: int,
                   dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
    """The engine ``weights`` (``markov_w2`` over the N draft tokens ``ids``, or no Markov head) with the
    draft vocabulary as one more Markov rank dimension over all ``vocab_size`` tokens (in ``dtype``,
    default: the weights' floating-point dtype)."""
    V, ids = int(vocab_size), ids.to("cpu", torch.long)
    dt = dtype or next(v.dtype for v in weights.values() if v.is_floating_point())
    w1 = weights.get(W1, torch.zeros(V, 0, dtype=dt))
    w2 = weights.get(W2, torch.zeros(ids.numel(), 0, dtype=dt))
    r = w1.shape[1]
    mask = torch.full((V, 1), VOCAB_BIAS, dtype=dt)
    mask[ids] = 0
    full = torch.zeros(V, r, dtype=dt)
    full[ids] = w2
    out = dict(weights)
    out[W1] = torch.cat([w1, torch.ones(V, 1, dtype=dt)], 1)
    out[W2] = torch.cat([full, mask], 1)
    if CELL_W in weights:
        w, b = weights[CELL_W], weights[CELL_B]
        rows, cols = _cell_index(r, w.shape[1] - 2 * r)
        out[CELL_W] = w.new_zeros(3 * (r + 1), 2 * (r + 1) + w.shape[1] - 2 * r)
        out[CELL_W][rows[:, None], cols[None]] = w
        out[CELL_B] = b.new_zeros(3 * (r + 1))
        out[CELL_B][rows] = b
        out[CELL_B][2 * (r + 1) + r] = RNN_OUTPUT_BIAS
    if CONF_W in weights and W1 in weights:        # a confidence head reading [h; markov_w1[x]]
        c = weights[CONF_W]
        out[CONF_W] = torch.cat([c, c.new_zeros(c.shape[0], 1)], 1)
    return out


def _without_rank(weights: Dict[str, torch.Tensor], ids: torch.Tensor) -> Dict[str, torch.Tensor]:
    """``weights`` minus their last Markov rank dimension, ``markov_w2`` cut to the rows ``ids``."""
    out = dict(weights)
    r = weights[W1].shape[1] - 1
    if r == 0:
        return {k: v for k, v in out.items() if k not in (W1, W2)}
    out[W1] = weights[W1][:, :r].contiguous()
    out[W2] = weights[W2][ids, :r].contiguous()
    if CELL_W in weights:
        w = weights[CELL_W]
        rows, cols = _cell_index(r, w.shape[1] - 2 * (r + 1))
        out[CELL_W] = w[rows[:, None], cols[None]].contiguous()
        out[CELL_B] = weights[CELL_B][rows].contiguous()
    if CONF_W in weights:
        out[CONF_W] = weights[CONF_W][:, :-1].contiguous()
    return out


def marked_vocab(weights: Dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
    """The sorted target ids [N] the last Markov rank dimension marks as the draft vocabulary
    (``markov_w1[:, -1]`` all 1, ``markov_w2[:, -1]`` 0 on N tokens and `VOCAB_BIAS` on the others,
    0 < N < V), or None when that dimension is an ordinary one."""
    w1, w2 = weights.get(W1), weights.get(W2)
    if w1 is None or w2 is None or w1.dim() != 2 or w1.shape[1] == 0 or w2.shape[0] != w1.shape[0]:
        return None
    col = w2[:, -1]
    inside = col == 0
    if not bool((w1[:, -1] == 1).all()) or not bool((inside | (col == VOCAB_BIAS)).all()):
        return None
    if bool(inside.all()) or not bool(inside.any()):
        return None
    return inside.nonzero().flatten()


def split_vocab_rank(where: str, weights: Dict[str, torch.Tensor]
                     ) -> Tuple[Optional[torch.Tensor], Dict[str, torch.Tensor]]:
    """(draft vocabulary, weights without its rank dimension) of a draft written by `add_vocab_rank`;
    (None, weights) when the last Markov dimension marks no draft vocabulary.  A marked dimension that
    any other weight reads (or that is not exactly what `add_vocab_rank` writes) is `ImportUnsupported`,
    naming the keys."""
    ids = marked_vocab(weights)
    if ids is None:
        return None, weights
    stripped = _without_rank(weights, ids)
    again = add_vocab_rank(stripped, ids, weights[W1].shape[0], weights[W1].dtype)
    bad = [k for k in KEYS if k in weights and not (k in again and torch.equal(again[k], weights[k]))]
    if bad:
        raise ImportUnsupported(f"{where}: the last Markov rank dimension marks a draft vocabulary of {ids.numel()} "
                                f"tokens, but {', '.join(bad)} do not hold it as deepspec writes it (the other "
                                "dimensions must not read it): the draft's distribution cannot be recovered")
    return ids, stripped


def mass_outside(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """The largest softmax probability mass [..., V] puts outside the token ids ``ids`` (fp32)."""
    p = torch.softmax(logits.float(), -1)
    p[..., ids.to(p.device)] = 0
    return float(p.sum(-1).max()) if p.numel() else 0.0


def rank_problems(where: str, weights: Dict[str, torch.Tensor]) -> Tuple[Optional[torch.Tensor], List[str]]:
    """(draft vocabulary or None, problems) of `split_vocab_rank`, for ``deepspec check``."""
    try:
        return split_vocab_rank(where, weights)[0], []
    except ImportUnsupported as e:
        return None, [str(e)]
