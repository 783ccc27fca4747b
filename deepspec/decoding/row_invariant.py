"""Row-invariant verification: verification rows that round exactly like one-token decoding steps.

A verification forward computes ℓ + 1 (or a tree's n + 1) rows at once.  In bf16 its rows can round
differently from plain decoding's one-token forwards, so a speculative output may differ from plain bf16
decoding's (measured 2026-12-05, SmolLM2-135M bf16 on one CPU thread: 70 of 120 eval outputs identical;
fp32: all).  Two things round differently: a masked multi-query SDPA call reduces differently from the
unmasked one-query call of a decoding step, and a bf16 GEMM over several rows can accumulate differently from
a one-row call (oneDNN on this CPU: SmolLM2's MLP down-projection, 1,536 → 576, differs in some rows at 2, 8
and 17 rows; its q/k/v/o, gate and up projections matched in the rows traced, 2026-12-07).

`row_invariant_attention` therefore runs each query row through exactly the call a decoding step makes —
one query, its own keys (the cache, then its ancestors in order: a chain's earlier rows, a tree path's
nodes), no mask — so each row's logits are bit-identical to plain decoding of its path wherever the
target's matmuls are batch-invariant (tested on tiny targets: `tests/unit/test_decoding_row_invariant.py`).  The
GEMMs are left as they are: on SmolLM2 in bf16 the option raised identical outputs only from 68 to 71 of 120
(`bench/results/decoding_table-t120_greedy`); a float32 target gives 120 of 120.  The price is
one small attention call per row and layer (`bench/decode_cost.py row-invariant` measures it).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from ..targets.attention import attention_implementation, full_attention

__all__ = ["NAME", "check_row_invariant_target", "row_invariant", "row_invariant_attention"]

NAME = "deepspec_row_invariant"
_registered = False
_rows: Dict[tuple, List[torch.Tensor]] = {}     # key indices per row of the forward in flight


def _row_keys(attention_mask: torch.Tensor, q: int) -> List[torch.Tensor]:
    """Each row's allowed keys among the forward's own q rows (its ancestors and itself, in order) of a 4-D
    additive mask, computed once per forward (all layers share the mask)."""
    key = (attention_mask.data_ptr(), tuple(attention_mask.shape))
    got = _rows.get(key)
    if got is None:
        allowed = attention_mask[0, 0, -q:, -q:] == 0
        got = [allowed[i].nonzero().reshape(-1) for i in range(q)]
        _rows.clear()
        _rows[key] = got
    return got


def row_invariant_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                            scaling: Optional[float] = None, **kwargs):
    """transformers attention-interface signature; returns (out [B, q, heads, d], None).  Without a mask the
    rows are a chain (row i sees the first kv − q + i + 1 keys); a 4-D mask (a draft tree) gives row i the
    cache and its ancestors, which are written behind one copy of the cache per layer (no copy per row)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    past = kv_len - q_len
    gqa = query.shape[1] != key.shape[1]
    if attention_mask is None:
        rows, kbuf, vbuf = None, key, value
    else:
        rows = _row_keys(attention_mask, q_len)
        depth = max(int(r.numel()) for r in rows)
        kbuf = key.new_empty(key.shape[0], key.shape[1], past + depth, key.shape[3])
        vbuf = value.new_empty(value.shape[0], value.shape[1], past + depth, value.shape[3])
        kbuf[:, :, :past], vbuf[:, :, :past] = key[:, :, :past], value[:, :, :past]
    outs = []
    for i in range(q_len):
        n = past + i + 1
        if rows is not None:
            n = past + int(rows[i].numel())
            kbuf[:, :, past:n] = key[:, :, past:].index_select(2, rows[i])
            vbuf[:, :, past:n] = value[:, :, past:].index_select(2, rows[i])
        outs.append(F.scaled_dot_product_attention(query[:, :, i:i + 1], kbuf[:, :, :n], vbuf[:, :, :n],
                                                   dropout_p=dropout, scale=scaling, enable_gqa=gqa))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
        AttentionInterface.register(NAME, row_invariant_attention)
        AttentionMaskInterface.register(NAME, lambda *args, **kwargs: None)
        _registered = True


def check_row_invariant_target(target) -> None:
    """Full attention in every layer: a sliding window or a recurrent layer would need more than the
    rows' key sets (refused, naming the key)."""
    arch = getattr(target, "arch", None)
    kinds = tuple(arch.kinds) if arch is not None else ("full_attention",)
    if kinds != ("full_attention",) or not full_attention(target.model):
        raise ValueError(f"eval.row_invariant: target {getattr(target, 'name', '')} has {', '.join(kinds)} layers; "
                         "row-invariant verification needs full attention in every layer")


@contextmanager
def row_invariant(target):
    """Run ``target.decode`` calls inside through `row_invariant_attention` (the adapter's own fast paths
    are switched off for the duration, so the model reads this implementation)."""
    check_row_invariant_target(target)
    _register()
    saved = target.fast_attention
    target.fast_attention = False
    try:
        with attention_implementation(target.model, NAME):
            yield
    finally:
        target.fast_attention = saved
        _rows.clear()
