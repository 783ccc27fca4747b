"""Sampled draft trees: draws without replacement, and the multi-candidate acceptance rule's output law.

The rounds run the real tree grower (`grow_tree`, draws without replacement, the ``nodes`` best kept,
pruned draws left as candidates), the real prompt-lookup graft (point-mass candidates) and the real
acceptance rule, over a Markov-chain target P and a poor Markov draft Q.  The joint law of the first
three emitted tokens must be the warped target chain's (χ² over seeded draws), at T = 1 and at T = 0.7
with top-p 0.9.  Two planted bugs — testing later draws against q instead of the renormalised q_i, and
skipping the residual update — must be caught by the same test."""
import random

import pytest
import torch

from deepspec.decoding import tree_accept
from deepspec.decoding.lookup import NgramIndex, graft
from deepspec.decoding.tree import grow_tree
from deepspec.decoding.tree_accept import accept_tree_sampling, proposal_law
from deepspec.decoding.warp import make_warp
from tests.support.stats import chi_square_gof, total_variation

V, N_TOK = 5, 3
P_MIN = 1e-3


def _chains(seed=5):
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(V, V, generator=g) * 1.5, -1)       # target: P[prev] = p(next | prev)
    logq = torch.log_softmax(torch.randn(V, V, generator=g) * 1.5, -1)       # a different, poor draft
    return logp, logq


def _round(context, logp, logq, warp, g, nodes, width, lookup):
    """One round on the host: grow a sampled tree from Q below the context's last token, graft the lookup
    chain, accept against P; returns the emitted tokens."""
    anchor = context[-1]
    tree = grow_tree(lambda k, toks, s: (logq[toks], s), anchor, None, 3, nodes, width, warp=warp, generator=g)
    if lookup:
        chain = NgramIndex(context, 2, 1).continuation(2)
        if chain:
            tree, _ = graft(tree, chain)
    rows = [anchor] + tree.tokens.tolist()
    path, nxt = accept_tree_sampling(tree.candidates, lambda r: warp(logp[rows[r]]), g)
    return [rows[i + 1] for i in path] + [nxt]


def _joint(logp, logq, warp, draws, seed, nodes=4, width=3, lookup=True):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    counts = torch.zeros(V ** N_TOK)
    accepted = 0
    for _ in range(draws):
        ctx = [rng.randrange(V) for _ in range(3)] + [0]          # varied contexts feed the lookup
        out = []
        while len(out) < N_TOK:
            new = _round(ctx + out, logp, logq, warp, g, nodes, width, lookup)
            accepted += len(new) - 1
            out += new
        a, b, c = out[:3]
        counts[(a * V + b) * V + c] += 1
    pw = warp(logp)
    exact = torch.einsum("a,ab,bc->abc", pw[0], pw, pw).reshape(-1)
    return counts, exact, accepted


@pytest.mark.parametrize("warp,draws", [(make_warp(1.0), 4000), (make_warp(0.7, top_p=0.9), 4000)])
def test_sampled_trees_with_lookup_emit_the_target_chain(warp, draws):
    logp, logq = _chains()
    counts, exact, accepted = _joint(logp, logq, warp, draws, seed=1)
    stat, df, pval = chi_square_gof(counts, exact)
    tv = total_variation(counts, exact)
    print(f"T={warp.temperature} top_p={warp.top_p}: chi2={stat:.1f} df={df} p={pval:.3f} TV={tv:.3f} "
          f"accepted/draw={accepted / draws:.2f}")
    assert pval > P_MIN, (stat, df, pval)
    assert accepted > draws          # rounds accept drafted / looked-up tokens, not only residual samples


def _planted(monkeypatch, bug):
    if bug == "q_not_renormalised":
        monkeypatch.setattr(tree_accept, "proposal_law", lambda q, drawn: q)
    else:
        monkeypatch.setattr(tree_accept, "residual_distribution", lambda r, q: r)


@pytest.mark.parametrize("bug", ["q_not_renormalised", "no_residual_update"])
def test_planted_bugs_are_caught(monkeypatch, bug):
    """The same χ² test at T = 1 fails for each planted bug (wide trees: most rounds test several draws)."""
    _planted(monkeypatch, bug)
    logp, logq = _chains()
    counts, exact, _ = _joint(logp, logq, make_warp(1.0), 3000, seed=2, nodes=8, width=4, lookup=False)
    stat, df, pval = chi_square_gof(counts, exact)
    print(f"{bug}: chi2={stat:.1f} df={df} p={pval:.2e}")
    assert pval < 1e-6, (bug, stat, pval)


def test_draws_are_without_replacement_in_q_order():
    """The depth-1 draws of a sampled tree: distinct tokens, the first distributed as q, every draw a
    candidate of the anchor (also the ones the tree leaves out), each tested against q_i."""
    g = torch.Generator().manual_seed(0)
    logq = torch.log_softmax(torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]), -1)
    q = logq.exp()
    firsts = torch.zeros(V)
    for _ in range(4000):
        t = grow_tree(lambda k, toks, s: (logq.expand(toks.shape[0], -1), s), 0, None, 1, 2, 4,
                      warp=make_warp(1.0), generator=g)
        c = t.candidates
        assert c.tokens.numel() == 4 and len(set(c.tokens.tolist())) == 4
        assert c.parents.tolist() == [-1] * 4 and len(t) == 2
        assert sorted(c.nodes.tolist()) == [-1, -1, 0, 1]          # two draws kept, two pruned
        firsts[int(c.tokens[0])] += 1
    assert chi_square_gof(firsts, q)[2] > P_MIN
    torch.testing.assert_close(proposal_law(q, [0]), torch.cat([torch.zeros(1), q[1:] / q[1:].sum()]))


def test_greedy_growth_is_unchanged_by_the_sampling_code():
    logq = torch.log_softmax(torch.randn(3, V, V, generator=torch.Generator().manual_seed(3)), -1)
    a = grow_tree(lambda k, toks, s: (logq[k, toks], s), 1, None, 3, 6, 2)
    b = grow_tree(lambda k, toks, s: (logq[k, toks], s), 1, None, 3, 6, 2, warp=make_warp(0.0))
    assert a.candidates is None and b.candidates is None
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


def test_draw_without_replacement_and_sample_token_laws():
    """The first two draws follow q(a)·q(b)/(1 − q(a)); a zero-mass token is never drawn; `sample_token`
    follows its distribution (χ² over seeded draws)."""
    from deepspec.decoding.tree import draw_without_replacement
    from deepspec.decoding.warp import sample_token
    g = torch.Generator().manual_seed(4)
    q = torch.tensor([0.4, 0.25, 0.0, 0.2, 0.1, 0.05])
    pairs = torch.zeros(6, 6)
    for row in draw_without_replacement(q.expand(6000, -1), 3, g):
        assert len(row) == 3 and 2 not in row and len(set(row)) == 3
        pairs[row[0], row[1]] += 1
    exact = q[:, None] * q[None, :] / (1 - q[:, None])
    exact.fill_diagonal_(0)
    assert chi_square_gof(pairs.reshape(-1), exact.reshape(-1))[2] > P_MIN
    assert draw_without_replacement(torch.tensor([[0.0, 1.0, 0.0]]), 3, g) == [[1]]     # fewer draws than asked
    counts = torch.zeros(6)
    for _ in range(4000):
        counts[sample_token(q * 3.0, g)] += 1                                            # unnormalised is fine
    assert counts[2] == 0 and chi_square_gof(counts, q)[2] > P_MIN
