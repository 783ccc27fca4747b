"""The acceptance rule on distributions: exact cases and ≥10k-draw distribution tests."""
import random

import torch

from deepspec.decoding.acceptance import residual_distribution, verify, verify_greedy, verify_sampling
from tests.support.stats import chi_square_gof, total_variation

P_MIN = 1e-3   # seeded: a fixed draw, but keep the bar meaningful


def _rand_dist(v, gen, peaked=1.0):
    return torch.softmax(torch.randn(v, generator=gen) * peaked, -1)


def test_greedy_rule():
    logits = torch.tensor([[0., 5., 0.], [0., 0., 5.], [5., 0., 0.], [0., 5., 0.]])  # argmax 1, 2, 0, 1
    r = verify_greedy([1, 2, 0], logits)
    assert (r.accepted, r.next_token, r.tokens) == (3, 1, [1, 2, 0, 1])       # all accepted + bonus
    r = verify_greedy([1, 0, 0], logits)
    assert (r.accepted, r.next_token, r.tokens) == (1, 2, [1, 2])             # correction = argmax
    r = verify_greedy([2, 2, 0], logits)
    assert (r.accepted, r.tokens) == (0, [1])
    r = verify_greedy([], logits[:1])
    assert (r.accepted, r.tokens) == (0, [1])


def test_sampling_exact_cases():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 7, generator=g), -1)
    draft = [int(torch.multinomial(p[k], 1, generator=g)) for k in range(3)]
    for _ in range(50):                       # q == p: always accept everything
        assert verify_sampling(draft, p[:3], p, g).accepted == 3
    q = torch.zeros(3, 7)
    q[:, 6] = 1.0
    p2 = p.clone()
    p2[:, 6] = 0.0
    p2 = p2 / p2.sum(-1, keepdim=True)
    for _ in range(50):                       # draft token impossible under p: rejected, correction from p
        r = verify_sampling([6, 6, 6], q, p2, g)
        assert r.accepted == 0 and r.next_token != 6


def test_residual_distribution():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.5, 0.3])
    torch.testing.assert_close(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(residual_distribution(p, p), p)   # no residual mass: falls back to p


def test_greedy_one_hot_equals_sampling_rule():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 9, generator=g)
    onehot = torch.nn.functional.one_hot(logits.argmax(-1), 9).float()
    for draft in ([int(x) for x in logits.argmax(-1)[:4]], [0, 1, 2, 3], [int(logits[0].argmax()), 1, 1, 1]):
        qd = torch.nn.functional.one_hot(torch.tensor(draft), 9).float()
        a = verify(draft, None, logits, greedy=True)
        b = verify(draft, qd, onehot, generator=g)
        assert (a.accepted, a.next_token) == (b.accepted, b.next_token)


def test_first_token_distribution_single_position():
    """10k draws: the emitted token at the first position is distributed as p, for a poor draft."""
    g = torch.Generator().manual_seed(11)
    rng = random.Random(11)
    v, draws = 6, 10_000
    p = _rand_dist(v, g, 1.5)
    q = torch.tensor([0.02, 0.02, 0.02, 0.02, 0.02, 0.02])
    q[int(p.argmin())] = 0.9                                  # mostly drafts p's least likely token
    q = q / q.sum()
    target = torch.stack([p, _rand_dist(v, g)])
    counts = torch.zeros(v)
    n_acc = 0
    for x in rng.choices(range(v), weights=q.tolist(), k=draws):
        r = verify_sampling([x], q[None], target, g)
        counts[r.tokens[0]] += 1
        n_acc += r.accepted
    stat, df, pval = chi_square_gof(counts, p)
    print(f"single position: chi2={stat:.2f} df={df} p={pval:.3f}")
    assert pval > P_MIN, (stat, df, pval)
    assert abs(n_acc / draws - float(torch.minimum(p, q).sum())) < 0.02      # P(accept) = Σ min(p, q)
    assert total_variation(counts, p) < 0.03


def test_markov_chain_three_tokens_joint_distribution():
    """A context-dependent 'target' (Markov chain P) and a poor context-dependent draft (Q), γ=3.

    Runs the round structure (propose γ from Q, verify against P, emit accepted + 1, next round
    anchored on the last emitted token) and checks the joint law of the first three emitted tokens
    against the exact chain probabilities with a χ² test over 10k draws."""
    g = torch.Generator().manual_seed(5)
    rng = random.Random(5)
    v, gamma, n_tok, draws = 4, 3, 3, 10_000
    P = torch.softmax(torch.randn(v, v, generator=g) * 1.5, -1)          # P[prev] = p(next | prev)
    Q = torch.softmax(torch.randn(v, v, generator=g) * 1.5, -1)          # a different, poor draft
    Ql = Q.tolist()
    start = 0
    counts = torch.zeros(v ** n_tok)
    rounds = accepted = 0
    for _ in range(draws):
        out, anchor = [], start
        while len(out) < n_tok:
            prev, toks = anchor, []
            for _k in range(gamma):
                prev = rng.choices(range(v), weights=Ql[prev])[0]
                toks.append(prev)
            ctx = [anchor] + toks                                        # target rows condition on the prefix
            r = verify_sampling(toks, Q[ctx[:-1]], P[ctx], g)
            out += r.tokens
            anchor = r.next_token
            rounds += 1
            accepted += r.accepted
        a, b, c = out[:3]
        counts[(a * v + b) * v + c] += 1
    exact = torch.einsum("a,ab,bc->abc", P[start], P, P).reshape(-1)
    stat, df, pval = chi_square_gof(counts, exact)
    print(f"markov joint of 3 tokens: chi2={stat:.2f} df={df} p={pval:.3f}")
    assert pval > P_MIN, (stat, df, pval)
    assert total_variation(counts, exact) < 0.04
    assert 0 < accepted < rounds * gamma                                 # both paths exercised
