"""Fused logits loss: LM head, low-rank bias, softmaxes, loss terms and their gradients, row chunk by chunk.

The largest tensors of a training step are the [rows × V] draft logits, the target's logits over the
same rows, their softmaxes and the gradient of the logits.  `fused_logit_loss` never holds them for
more than one chunk of rows: in the forward pass each chunk computes

    z = logits_fn(h) + u · W2                  (draft logits; ``u · W2`` is a sequential head's bias)
    q = softmax(z),  p = softmax(target_logits_fn(h_target))
    loss = Σ_rows  a_ce · CE(z, y)  +  a_l1 · Σ_v |q − p|  +  a_soft · (−Σ_v p log q)

with the gradient of that chunk's loss with respect to z in closed form

    ∂CE/∂z = q − onehot(y),   ∂L1/∂z = q ⊙ (s − ⟨s, q⟩) with s = sign(q − p),   ∂softCE/∂z = q − p,

and back-propagates it at once through ``logits_fn`` and the bias (a local autograd graph of one chunk).
What survives to the backward pass is only the gradients of the inputs (``h``, ``u``) and of the
trainable parameters the chunk used — no recomputation, no activation checkpointing.  The per-row
coefficients ``a_*`` carry the loss weights, position weights and validity, so the result is a plain
weighted sum; the caller divides by its denominator.  Chunked and unchunked results agree to fp32
rounding (tests/unit/test_drafts_fused_loss.py) and equal plain autograd through `token_terms`.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

# Logits per chunk (rows × V): 4M fp32 values = 16 MB per vocabulary-sized temporary (CPU caches);
# on a GPU 64M (256 MB): ~16x fewer chunks, i.e. fewer small kernels and autograd calls per step.
LOGITS_PER_CHUNK = 1 << 22
LOGITS_PER_CHUNK_CUDA = 1 << 26

STAT_NAMES = ("ce", "tv", "top1", "soft_ce")


def rows_per_chunk(vocab: int, budget: int = LOGITS_PER_CHUNK) -> int:
    return max(1, budget // max(int(vocab), 1))


def _chunk_terms(z: torch.Tensor, t: torch.Tensor, y: torch.Tensor, coef: torch.Tensor):
    """Per-row terms [4, n] and dLoss/dz [n, V] for draft logits z, target logits t (both fp32)."""
    logq = torch.log_softmax(z, dim=-1)
    q = logq.exp()
    p = torch.softmax(t, dim=-1)
    diff = q - p
    tv = 0.5 * diff.abs().sum(-1)
    s = diff.sign_()
    soft_ce = -(p * logq).sum(-1)
    ce = -logq.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    top1 = (z.gather(-1, y.unsqueeze(-1)).squeeze(-1) >= z.amax(-1)).float()   # argmax is ~10x slower on CPU
    a_ce, a_l1, a_soft = coef.unbind(-1)
    # dL/dz = a_ce (q − e_y) + a_l1 q (s − <s, q>) + a_soft (q − p), built in place over s
    sq = (s * q).sum(-1, keepdim=True)
    g = s.sub_(sq).mul_(q).mul_(a_l1.unsqueeze(-1))
    g.add_(q * (a_ce + a_soft).unsqueeze(-1)).sub_(p.mul_(a_soft.unsqueeze(-1)))
    g.scatter_add_(-1, y.unsqueeze(-1), -a_ce.unsqueeze(-1))
    loss = (a_ce * ce + a_l1 * 2.0 * tv + a_soft * soft_ce).sum()
    return loss, torch.stack([ce, tv, top1, soft_ce]), g


class _FusedLogitLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_fn, target_logits_fn, chunk, h, u, w2, tgt_h, tokens, coef, *params):
        n = h.shape[0]
        inputs = [x for x in (h, u, w2) if x is not None]
        grads = [torch.zeros_like(x) if x.requires_grad else None for x in inputs]
        pgrads = [torch.zeros_like(p) for p in params]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        stats = []
        dev = h.device.type
        mm_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        if w2 is not None:   # cast the [r, V] matrix once per call, not once per chunk
            w2c = w2.detach().to(mm_dtype or w2.dtype).requires_grad_(w2.requires_grad)
        for i in range(0, n, chunk):
            sl = slice(i, min(i + chunk, n))
            with torch.enable_grad():
                hc = h[sl].detach().requires_grad_(h.requires_grad)
                leaves = [hc]
                z = logits_fn(hc)
                if u is not None:
                    uc = u[sl].detach().requires_grad_(u.requires_grad)
                    leaves += [uc, w2c]
                    z = z.float() + (uc.to(w2c.dtype) @ w2c).float()
                z = z.float()
            with torch.no_grad():
                t = target_logits_fn(tgt_h[sl]).float()
                loss, st, gz = _chunk_terms(z.detach(), t, tokens[sl], coef[sl].float())
            total += loss
            stats.append(st)
            want = [x for x in leaves + list(params) if x.requires_grad]
            if want:
                got = iter(torch.autograd.grad(z, want, gz))
                for j, x in enumerate(leaves):
                    if x.requires_grad:
                        g = next(got)
                        if j < 2:
                            grads[j][sl] = g
                        else:
                            grads[2] += g.to(grads[2].dtype)
                for pg, p in zip(pgrads, params):
                    if p.requires_grad:
                        pg += next(got)
        ctx.save_for_backward(*[g for g in grads if g is not None], *pgrads)
        ctx.layout = [g is not None for g in grads], len(pgrads), u is not None
        st = torch.cat(stats, dim=1) if stats else h.new_zeros(len(STAT_NAMES), 0, dtype=torch.float32)
        ctx.mark_non_differentiable(st)
        return total, st

    @staticmethod
    def backward(ctx, grad_total, _grad_stats):
        has, n_params, has_u = ctx.layout
        saved = iter(ctx.saved_tensors)
        gi = [next(saved) * grad_total if flag else None for flag in has]
        if not has_u:
            gi = gi + [None, None]
        gp = [next(saved) * grad_total for _ in range(n_params)]
        return (None, None, None, gi[0], gi[1], gi[2], None, None, None, *gp)


def fused_logit_loss(h: torch.Tensor, tgt_h: torch.Tensor, tokens: torch.Tensor, coef: torch.Tensor,
                     logits_fn: Callable[[torch.Tensor], torch.Tensor],
                     target_logits_fn: Callable[[torch.Tensor], torch.Tensor],
                     u: Optional[torch.Tensor] = None, w2: Optional[torch.Tensor] = None,
                     params: Sequence[torch.Tensor] = (), chunk_rows: Optional[int] = None,
                     vocab: Optional[int] = None) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Weighted loss sum and per-row statistics over rows of h [N, D] (see the module docstring).

    tgt_h [N, H]: the target hidden states whose logits give p; tokens [N]: the true next tokens;
    coef [N, 3]: per-row weights of (CE, L1, soft CE); u [N, r] and w2 [r, V]: optional low-rank bias;
    params: trainable tensors ``logits_fn`` uses (their gradients are computed too).
    Returns (loss sum with gradients, {ce, tv, top1, soft_ce: [N] detached})."""
    if (u is None) != (w2 is None):
        raise ValueError("fused_logit_loss: u and w2 go together")
    if chunk_rows is None:
        chunk_rows = rows_per_chunk(vocab if vocab is not None else (w2.shape[-1] if w2 is not None else 1 << 16),
                                    LOGITS_PER_CHUNK_CUDA if h.is_cuda else LOGITS_PER_CHUNK)
    total, st = _FusedLogitLoss.apply(logits_fn, target_logits_fn, max(1, int(chunk_rows)), h, u, w2, tgt_h,
                                      tokens, coef, *params)
    return total, dict(zip(STAT_NAMES, st.unbind(0)))
