"""The fused logits loss equals plain autograd through `token_terms`, in value, statistics and gradients,
for every chunking; and its peak memory does not hold [rows × V] tensors for all rows at once."""
import pytest
import torch

from deepspec.drafts.fused_loss import fused_logit_loss, rows_per_chunk
from deepspec.drafts.losses import token_terms

N, D, R, V = 23, 12, 5, 97


def _setup(seed=0, with_u=True, with_proj=True):
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(V, D, generator=g) * 0.5            # frozen "target" LM head
    proj = torch.nn.Linear(D, D, bias=False) if with_proj else None
    if proj is not None:
        torch.nn.init.normal_(proj.weight, std=0.3, generator=g)
    h = torch.randn(N, D, generator=g, requires_grad=True)
    u = torch.randn(N, R, generator=g, requires_grad=True) if with_u else None
    w2 = (torch.randn(R, V, generator=g) * 0.2).requires_grad_() if with_u else None
    tgt_h = torch.randn(N, D, generator=g)
    tokens = torch.randint(0, V, (N,), generator=g)
    coef = torch.rand(N, 3, generator=g)
    coef[3] = 0.0                                           # an invalid row
    return head, proj, h, u, w2, tgt_h, tokens, coef


def _reference(head, proj, h, u, w2, tgt_h, tokens, coef):
    z = (proj(h) if proj is not None else h) @ head.T
    if u is not None:
        z = z + u @ w2
    t = token_terms(z, tgt_h @ head.T, tokens)
    loss = (coef[:, 0] * t["ce"] + coef[:, 1] * 2 * t["tv"] + coef[:, 2] * t["soft_ce"]).sum()
    return loss, t


@pytest.mark.parametrize("chunk", [1, 4, N, 1000])
@pytest.mark.parametrize("with_u,with_proj", [(True, True), (False, False), (True, False)])
def test_fused_equals_autograd(chunk, with_u, with_proj):
    head, proj, h, u, w2, tgt_h, tokens, coef = _setup(with_u=with_u, with_proj=with_proj)
    ref, t = _reference(head, proj, h, u, w2, tgt_h, tokens, coef)
    leaves = [x for x in (h, u, w2) if x is not None] + (list(proj.parameters()) if proj is not None else [])
    ref_g = torch.autograd.grad(ref * 1.7, leaves)

    def logits_fn(x):
        return (proj(x) if proj is not None else x) @ head.T

    got, st = fused_logit_loss(h, tgt_h, tokens, coef, logits_fn, lambda x: x @ head.T, u=u, w2=w2,
                               params=list(proj.parameters()) if proj is not None else [], chunk_rows=chunk)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for k in ("ce", "tv", "soft_ce", "top1"):
        torch.testing.assert_close(st[k], t[k].detach().float(), rtol=1e-5, atol=1e-6)
    got_g = torch.autograd.grad(got * 1.7, leaves)
    for a, b in zip(got_g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_chunk_rows_follow_the_vocabulary():
    assert rows_per_chunk(49152) == (1 << 21) // 49152
    assert rows_per_chunk(10 ** 9) == 1


def test_u_without_w2_is_an_error():
    head, proj, h, u, w2, tgt_h, tokens, coef = _setup()
    with pytest.raises(ValueError, match="u and w2"):
        fused_logit_loss(h, tgt_h, tokens, coef, lambda x: x @ head.T, lambda x: x @ head.T, u=u)


def test_peak_memory_is_bounded_by_the_chunk():
    """The fused loss keeps O(chunk × V) logits, not O(rows × V): every tensor autograd saves (in the
    chunk-local graphs and for the backward pass) is smaller than rows × V (the frozen head, D × V, is a
    view of an existing weight)."""
    head, proj, h, u, w2, tgt_h, tokens, coef = _setup()
    sizes = []

    def pack(x):
        sizes.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss, _ = fused_logit_loss(h, tgt_h, tokens, coef, lambda x: proj(x) @ head.T, lambda x: x @ head.T,
                                   u=u, w2=w2, params=list(proj.parameters()), chunk_rows=4)
    assert max(sizes) < N * V
    loss.backward()
    assert h.grad is not None and u.grad is not None and w2.grad is not None


@pytest.mark.parametrize("chunk", [3, N])
def test_fused_with_a_draft_vocabulary_equals_autograd(chunk):
    """q on a subset S of the vocabulary: TV adds the unreachable target mass, CE counts targets in S,
    soft CE is −Σ_S p log q; value, statistics and gradients equal plain autograd on the formulas."""
    head, proj, h, u, w2, tgt_h, tokens, coef = _setup()
    g = torch.Generator().manual_seed(5)
    rows = torch.randperm(V, generator=g)[:40].sort().values
    tokens[:8] = rows[torch.randint(0, 40, (8,), generator=g)]          # some targets inside S for sure
    t2d = torch.full((V,), -1, dtype=torch.long)
    t2d[rows] = torch.arange(40)
    w2s = w2.detach()[:, :40].clone().requires_grad_()
    zs = proj(h) @ head[rows].T + u @ w2s
    logq = torch.log_softmax(zs, -1)
    p = torch.softmax(tgt_h @ head.T, -1)[:, rows]
    inv = t2d[tokens] >= 0
    tv = 0.5 * ((logq.exp() - p).abs().sum(-1) + 1 - p.sum(-1))
    ce = -logq.gather(-1, t2d[tokens].clamp(min=0)[:, None]).squeeze(-1) * inv
    soft = -(p * logq).sum(-1)
    ref = (coef[:, 0] * ce + coef[:, 1] * 2 * tv + coef[:, 2] * soft).sum()
    leaves = [h, u, w2s] + list(proj.parameters())
    ref_g = torch.autograd.grad(ref, leaves)
    got, st = fused_logit_loss(h, tgt_h, tokens, coef, lambda x: proj(x) @ head[rows].T, lambda x: x @ head.T,
                               u=u, w2=w2s, params=list(proj.parameters()), chunk_rows=chunk,
                               draft_vocab=rows, t2d=t2d)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st["tv"], tv.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(st["ce"], ce.detach(), rtol=1e-5, atol=1e-6)
    assert st["in_vocab"].tolist() == inv.float().tolist()
    for a, b in zip(torch.autograd.grad(got, leaves), ref_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("chunk", [3, N])
def test_stored_log_normaliser_gives_the_same_loss(chunk):
    """With the target's log-normaliser per row (a cache column), the target side scores only the draft
    vocabulary: p_S = exp(t_S − lse) — value, statistics and gradients equal the full-V computation."""
    head, proj, h, u, w2, tgt_h, tokens, coef = _setup()
    g = torch.Generator().manual_seed(7)
    rows = torch.randperm(V, generator=g)[:40].sort().values
    tokens[:8] = rows[torch.randint(0, 40, (8,), generator=g)]
    t2d = torch.full((V,), -1, dtype=torch.long)
    t2d[rows] = torch.arange(40)
    w2s = w2.detach()[:, :40].clone().requires_grad_()
    leaves = [h, u, w2s] + list(proj.parameters())
    kw = dict(u=u, w2=w2s, params=list(proj.parameters()), chunk_rows=chunk, draft_vocab=rows, t2d=t2d)
    full, st_full = fused_logit_loss(h, tgt_h, tokens, coef, lambda x: proj(x) @ head[rows].T,
                                     lambda x: x @ head.T, **kw)
    g_full = torch.autograd.grad(full, leaves)
    lse = torch.logsumexp(tgt_h @ head.T, -1)
    sub, st_sub = fused_logit_loss(h, tgt_h, tokens, coef, lambda x: proj(x) @ head[rows].T,
                                   lambda x: x @ head[rows].T, target_lse=lse, **kw)
    torch.testing.assert_close(sub, full, rtol=1e-5, atol=1e-5)
    for k in ("ce", "tv", "soft_ce", "top1", "in_vocab"):
        torch.testing.assert_close(st_sub[k], st_full[k], rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(sub, leaves), g_full):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_log_normaliser_needs_a_draft_vocabulary():
    head, proj, h, u, w2, tgt_h, tokens, coef = _setup()
    with pytest.raises(ValueError, match="target_lse"):
        fused_logit_loss(h, tgt_h, tokens, coef, lambda x: x @ head.T, lambda x: x @ head.T,
                         target_lse=torch.zeros(N))
