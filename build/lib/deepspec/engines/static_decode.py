"""Batched decoding on a static KV cache, replayed as one CUDA graph per step on a GPU.

At regeneration sizes (a small target, hundreds of rows) a decode step is bound by the host: every
layer's Python and kernel launches cost more than the GPU's work.  Here a batch is prefilled once
into a `transformers.StaticCache` sized prompt + ``max_new_tokens``, and the one-token decode forward
reads fixed buffers (input ids, positions, a key mask) — so on CUDA it is captured once per batch
and each later step is a single graph replay.  The same loop runs eagerly on a CPU (tests).

Attention goes through `static_attention`, registered with transformers under `IMPLEMENTATION`
without a mask function (transformers builds no mask for it): it reads the batch's key mask from
`_MASK` — bool [B, 1, q, L], True = may attend — which the loop keeps in a fixed buffer.  One query
row per sequence (decode) groups the query heads of each key/value head into rows of that head (no
K/V repeat, the mask broadcasts); the prefill repeats K/V to the query heads once.

Rows that reached an end-of-sequence token keep their slot (the graph's shapes are fixed) and the
loop stops when every row has finished.  Sampling is the engine's per-row sampler, outside the graph.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from transformers import StaticCache

from ..targets.attention import attention_implementation, cache_kwarg
from ..targets.attention import supported as plain_causal

log = logging.getLogger(__name__)
IMPLEMENTATION = "deepspec_static_masked"
_MASK: dict = {"mask": None}
# What the last batch ran on (read by tests and the device benchmark): graph replays or eager steps.
LAST: dict = {"graph": False, "replays": 0, "capture_error": None}
_registered = False


def static_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     dropout: float = 0.0, scaling: Optional[float] = None, **kwargs):
    mask = _MASK["mask"]
    B, Hq, q, d = query.shape
    Hk = key.shape[1]
    rep = Hq // Hk
    if q == 1 and rep > 1:   # heads sharing a K/V head become rows of it: [B, Hk, rep, d]
        out = F.scaled_dot_product_attention(query.reshape(B, Hk, rep, d), key, value, attn_mask=mask,
                                             dropout_p=dropout, scale=scaling).reshape(B, Hq, 1, d)
    else:
        if rep > 1:
            key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def supported(model) -> bool:
    """Plain causal decoders on sdpa (no sliding window, no soft-capping) with transformers' StaticCache."""
    global _registered
    if not plain_causal(model):
        return False
    try:
        from transformers import AttentionInterface, StaticCache  # noqa: F401
    except ImportError:
        return False
    if not _registered:
        AttentionInterface.register(IMPLEMENTATION, static_attention)
        _registered = True
    return True


@contextmanager
def _attention(model):
    try:
        with attention_implementation(model, IMPLEMENTATION):
            yield
    finally:
        _MASK["mask"] = None


@torch.inference_mode()
def static_decode(model, input_ids: torch.Tensor, attn: torch.Tensor, *, max_new_tokens: int, sample,
                  eos_token_ids: Sequence[int], pad_token_id: int, use_graph: Optional[bool] = None) -> List[List[int]]:
    """Generate ``max_new_tokens`` per row of the left-padded batch ``input_ids``/``attn`` [B, T].

    ``sample(logits [B, V] fp32, step) -> tokens [B]`` draws each row's token.  Returns the generated
    ids per row (after a row's EOS: padding).  ``use_graph`` None = on CUDA."""
    dev = input_ids.device
    B, T = input_ids.shape
    N = int(max_new_tokens)
    L = T + N
    graph = dev.type == "cuda" if use_graph is None else bool(use_graph)
    cache = StaticCache(config=model.config, max_cache_len=L)
    kw = {cache_kwarg(model.forward): cache, "use_cache": True, "logits_to_keep": 1}
    valid = attn.bool()
    key_ok = torch.zeros(B, L, dtype=torch.bool, device=dev)
    key_ok[:, :T] = valid
    eos_t = torch.tensor(list(eos_token_ids), dtype=torch.long, device=dev)
    out = torch.full((B, N), pad_token_id, dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    with _attention(model):
        # prefill: causal over the prompt, valid keys only; a padding row attends to itself (finite values)
        i = torch.arange(T, device=dev)
        causal = (i[None, :] <= i[:, None])
        pre = (causal[None] & valid[:, None, :]) | torch.eye(T, dtype=torch.bool, device=dev)[None]
        _MASK["mask"] = torch.cat([pre, pre.new_zeros(B, T, N)], dim=-1)[:, None]          # [B, 1, T, L]
        pos0 = (attn.long().cumsum(-1) - 1).clamp_(min=0)
        logits = model(input_ids=input_ids, attention_mask=None, position_ids=pos0, **kw).logits[:, -1, :].float()
        # fixed buffers of the decode step
        ids_buf = torch.zeros(B, 1, dtype=torch.long, device=dev)
        pos_buf = pos0[:, -1:].clone()
        mask_buf = key_ok[:, None, None, :].clone()                                         # [B, 1, 1, L]
        _MASK["mask"] = mask_buf

        def step_fn():
            return model(input_ids=ids_buf, attention_mask=None, position_ids=pos_buf, **kw).logits[:, -1, :].float()

        side = torch.cuda.Stream() if graph else None
        LAST.update(graph=False, replays=0, capture_error=None)
        g = g_out = None
        for step in range(N):
            tok = sample(logits, step)
            out[:, step] = tok.masked_fill(done, pad_token_id)
            done |= torch.isin(tok, eos_t)
            if step + 1 == N or bool(done.all()):        # the one host synchronisation of a step
                break
            ids_buf.copy_(tok[:, None])
            pos_buf.add_(1)
            mask_buf[:, :, :, T + step] = True
            if graph and g is None and step >= 2:        # two eager steps first, on the capture stream
                captured = _capture(step_fn, side)
                graph = captured is not None
                if graph:
                    g, g_out = captured
            if g is not None:
                g.replay()
                logits = g_out
                LAST["graph"], LAST["replays"] = True, LAST["replays"] + 1
            elif side is not None:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    logits = step_fn()
                torch.cuda.current_stream().wait_stream(side)
            else:
                logits = step_fn()
    return out.tolist()


def _capture(step_fn, side):
    """(graph, its output) of ``step_fn`` captured on the stream ``side``; None where capture fails."""
    try:
        side.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            out = step_fn()
        torch.cuda.current_stream().wait_stream(side)
        return g, out
    except Exception as e:   # any capture problem: decode eagerly (same results, slower)
        LAST["capture_error"] = f"{type(e).__name__}: {e}"
        log.warning("CUDA graph capture of the decode step failed (%s: %s): decoding without graphs",
                    type(e).__name__, e)
        return None
