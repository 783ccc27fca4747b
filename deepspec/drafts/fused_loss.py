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

# Logits per chunk (rows × V): 2M fp32 values = 8 MB per vocabulary-sized temporary (measured at
# the SmolLM2 DSpark training config on one CPU thread: 1<<22 0.86 s/step, 1<<21 0.94 s, 1<<20 1.26 s; peak RSS falls with it).
LOGITS_PER_CHUNK = 1 << 21
# On a GPU 64M (256 MB): ~16x fewer chunks, i.e. fewer small kernels and autograd calls per step.
LOGITS_PER_CHUNK_CUDA = 1 << 26

STAT_NAMES = ("ce", "tv", "top1", "soft_ce", "in_vocab")


def autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The matmul dtype autocast would use for ``x``'s device, or None outside autocast."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


def rows_per_chunk(vocab: int, budget: int = LOGITS_PER_CHUNK) -> int:
    return max(1, budget // max(int(vocab), 1))


def _chunk_terms(z: torch.Tensor, t: torch.Tensor, y: torch.Tensor, coef: torch.Tensor,
                 rows: Optional[torch.Tensor] = None, t2d: Optional[torch.Tensor] = None,
                 lse: Optional[torch.Tensor] = None):
    """Per-row terms [5, n] and dLoss/dz [n, N] for draft logits z [n, N] and target logits t [n, V].

    With a draft vocabulary (``rows`` [N] target ids, ``t2d`` [V] their inverse, -1 elsewhere) q lives
    on those N tokens: p is restricted to them (p_S, not renormalised), the target mass outside,
    1 − Σ p_S, is unreachable and enters TV as a constant, CE counts only targets inside the vocabulary
    (``in_vocab``), and the soft CE is −Σ_S p log q (gradient q·Σp_S − p_S).  Given the target's
    log-normaliser ``lse`` [n] (logsumexp over all V), t holds only the N draft-vocabulary logits and
    p_S = exp(t − lse): the [n, V] target logits are never formed."""
    logq = torch.log_softmax(z, dim=-1)
    q = logq.exp()
    if lse is not None:
        if rows is None:
            raise ValueError("_chunk_terms: a target log-normaliser is only used with a draft vocabulary")
        # p_S from the stored normaliser; rounding (bf16 logits) can push Σ p_S a hair over 1
        p = (t - lse.unsqueeze(-1)).exp_().clamp_(max=1.0)
    else:
        p = torch.softmax(t, dim=-1)
    if rows is None:
        yd, inv, out, psum = y, torch.ones_like(y, dtype=z.dtype), 0.0, 1.0
    else:
        if lse is None:
            p = p.index_select(-1, rows)
        yd = t2d[y]
        inv = (yd >= 0).to(z.dtype)
        yd = yd.clamp(min=0)
        psum = p.sum(-1)
        out = (1.0 - psum).clamp(min=0.0)
        psum = psum.unsqueeze(-1)
    diff = q - p
    tv = 0.5 * (diff.abs().sum(-1) + out)
    s = diff.sign_()
    soft_ce = -(p * logq).sum(-1)
    ce = -logq.gather(-1, yd.unsqueeze(-1)).squeeze(-1) * inv
    top1 = (z.gather(-1, yd.unsqueeze(-1)).squeeze(-1) >= z.amax(-1)).float() * inv   # argmax: ~10x slower
    a_ce, a_l1, a_soft = coef.unbind(-1)
    a_ce = a_ce * inv
    # dL/dz = a_ce (q − e_y) + a_l1 q (s − <s, q>) + a_soft (q Σp − p), built in place over s
    sq = (s * q).sum(-1, keepdim=True)
    g = s.sub_(sq).mul_(q).mul_(a_l1.unsqueeze(-1))
    g.add_(q * (a_ce.unsqueeze(-1) + a_soft.unsqueeze(-1) * psum)).sub_(p.mul_(a_soft.unsqueeze(-1)))
    g.scatter_add_(-1, yd.unsqueeze(-1), -a_ce.unsqueeze(-1))
    loss = (a_ce * ce + a_l1 * 2.0 * tv + a_soft * soft_ce).sum()
    return loss, torch.stack([ce, tv, top1, soft_ce, inv]), g


class _FusedLogitLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_fn, target_logits_fn, chunk, vocab, h, u, w2, tgt_h, tgt_lse, tokens, coef, *params):
        rows, t2d = vocab if vocab is not None else (None, None)
        n = h.shape[0]
        inputs = [x for x in (h, u, w2) if x is not None]
        grads = [torch.zeros_like(x) if x.requires_grad else None for x in inputs]
        pgrads = [torch.zeros_like(p) for p in params]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        stats = []
        mm_dtype = autocast_dtype(h)
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
                loss, st, gz = _chunk_terms(z.detach(), t, tokens[sl], coef[sl].float(), rows, t2d,
                                            None if tgt_lse is None else tgt_lse[sl].float())
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
        return (None, None, None, None, gi[0], gi[1], gi[2], None, None, None, None, *gp)


def fused_logit_loss(h: torch.Tensor, tgt_h: torch.Tensor, tokens: torch.Tensor, coef: torch.Tensor,
                     logits_fn: Callable[[torch.Tensor], torch.Tensor],
                     target_logits_fn: Callable[[torch.Tensor], torch.Tensor],
                     u: Optional[torch.Tensor] = None, w2: Optional[torch.Tensor] = None,
                     params: Sequence[torch.Tensor] = (), chunk_rows: Optional[int] = None,
                     vocab: Optional[int] = None, draft_vocab: Optional[torch.Tensor] = None,
                     t2d: Optional[torch.Tensor] = None, target_lse: Optional[torch.Tensor] = None
                     ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Weighted loss sum and per-row statistics over rows of h [N, D] (see the module docstring).

    tgt_h [N, H]: the target hidden states whose logits give p; tokens [N]: the true next tokens;
    coef [N, 3]: per-row weights of (CE, L1, soft CE); u [N, r] and w2 [r, V]: optional low-rank bias;
    params: trainable tensors ``logits_fn`` uses (their gradients are computed too).
    draft_vocab [N] / t2d [V]: ``logits_fn`` scores only these target ids (see `_chunk_terms`); tokens
    stay target ids.  target_lse [N rows]: the target's log-normaliser per row (a cache column); with a
    draft vocabulary ``target_logits_fn`` then returns only the draft vocabulary's target logits, so
    the step's head cost scales with the draft vocabulary, not V.
    Returns (loss sum with gradients, {ce, tv, top1, soft_ce, in_vocab: [rows]})."""
    if (u is None) != (w2 is None):
        raise ValueError("fused_logit_loss: u and w2 go together")
    if chunk_rows is None:   # the widest per-row temporaries: V target logits, or only N with target_lse
        width = vocab if vocab is not None else (w2.shape[-1] if w2 is not None else 1 << 16)
        if target_lse is not None and draft_vocab is not None:
            width = draft_vocab.numel()
        chunk_rows = rows_per_chunk(width, LOGITS_PER_CHUNK_CUDA if h.is_cuda else LOGITS_PER_CHUNK)
    if (draft_vocab is None) != (t2d is None):
        raise ValueError("fused_logit_loss: draft_vocab and t2d go together")
    if target_lse is not None and draft_vocab is None:
        raise ValueError("fused_logit_loss: target_lse goes with a draft vocabulary")
    pair = None if draft_vocab is None else (draft_vocab, t2d)
    total, st = _FusedLogitLoss.apply(logits_fn, target_logits_fn, max(1, int(chunk_rows)), pair, h, u, w2,
                                      tgt_h, target_lse, tokens, coef, *params)
    return total, dict(zip(STAT_NAMES, st.unbind(0)))
