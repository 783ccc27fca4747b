"""End-to-end losslessness under sampling: the real loops (chains, and sampled draft trees with prompt
lookup) on a real (tiny, 6-token vocabulary) transformers target with deliberately poor drafts; the joint
law of the first three generated tokens must match the target's exact distribution (χ² over seeded
draws)."""
import itertools

import pytest
import torch

from tests.support.drafters import FixedDistributionDraft
from deepspec.decoding.warp import make_warp
from deepspec.decoding.chain import speculative_generate
from deepspec.decoding.tree_loop import tree_generate
from tests.support.stats import chi_square_gof, total_variation

V, N_TOK, GAMMA = 6, 3, 2
MAX_NEW = N_TOK + 1   # lets round 1 verify both drafts (the budget caps ℓ at max_new − len − 1)
PROMPT = [1, 4, 2]


@pytest.fixture(scope="module")
def small_vocab_target():
    """A real 1-layer Llama with a 6-token vocabulary, LM head scaled so p is peaked and context-dependent."""
    from transformers import AutoModelForCausalLM

    from deepspec.targets import TargetAdapter
    from deepspec.targets.tiny import tiny_config, tiny_tokenizer
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", V, num_layers=1, hidden_size=32)).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return TargetAdapter(model, tiny_tokenizer("llama"), num_feature_layers=1, name="tiny-v6")


def _exact_joint(target, warp):
    seqs = torch.tensor([PROMPT + list(c) for c in itertools.product(range(V), repeat=N_TOK - 1)])
    logits = target.decode(seqs).logits                      # [V^2, T+2, V]
    T = len(PROMPT)
    p1 = warp(logits[0, T - 1])
    joint = torch.zeros([V] * N_TOK, dtype=torch.float64)
    for row, (a, b) in enumerate(itertools.product(range(V), repeat=N_TOK - 1)):
        p2 = warp(logits[row, T])[b]
        p3 = warp(logits[row, T + 1]).double()
        joint[a, b] = p1[a].double() * p2.double() * p3
    return joint.reshape(-1)


def _draw(target, drafter, warp, n, seed, tree=None):
    counts = torch.zeros(V ** N_TOK)
    acc = ver = 0
    for i in range(n):
        g = torch.Generator().manual_seed(seed * 100_003 + i)
        if tree is None:
            out = speculative_generate(target, drafter, PROMPT, gamma=GAMMA, max_new_tokens=MAX_NEW, warp=warp,
                                       generator=g, eos_token_ids=[])
        else:
            out = tree_generate(target, drafter, PROMPT, gamma=GAMMA, max_new_tokens=MAX_NEW, warp=warp, generator=g,
                                eos_token_ids=[], **tree)
        a, b, c = out.tokens[:N_TOK]
        counts[(a * V + b) * V + c] += 1
        acc += sum(r.accepted for r in out.rounds)
        ver += sum(r.proposed for r in out.rounds)
    return counts, acc / max(ver, 1)


def _dspark(target, vocab=None, algorithm="dspark"):
    from deepspec.config.draft import DraftConfig
    from deepspec.drafts.registry import build_drafter
    torch.manual_seed(0)
    cfg = DraftConfig(algorithm=algorithm, gamma=GAMMA, num_layers=1, head_rank=8, mask_token_id=0,
                      vocab_size=None if vocab is None else len(vocab))
    d = build_drafter(target, cfg)
    if vocab is not None:     # a pruned draft vocabulary: q = 0 on the other tokens
        d.set_draft_vocab(vocab)
    return d.eval()


@pytest.mark.parametrize("kind,warp,n", [
    ("uniform", make_warp(0.8, top_k=5, top_p=0.95), 700),   # poor draft, warped target and draft alike
    ("dspark_random", make_warp(1.0), 300),                     # a real drafter's q (sequential head)
    ("dspark_pruned", make_warp(1.0), 300),                     # ... proposing 4 of the 6 tokens only
])
def test_first_tokens_match_target_distribution(small_vocab_target, kind, warp, n):
    t = small_vocab_target
    d = (FixedDistributionDraft(t, gamma=GAMMA) if kind == "uniform"
         else _dspark(t, [0, 2, 3, 5] if kind == "dspark_pruned" else None))
    exact = _exact_joint(t, warp)
    counts, rate = _draw(t, d, warp, n, seed=len(kind))
    stat, df, pval = chi_square_gof(counts, exact)
    tv = total_variation(counts, exact)
    print(f"{kind}: n={n} chi2={stat:.2f} df={df} p={pval:.3f} TV={tv:.3f} acceptance={rate:.2f}")
    assert pval > 1e-3, (kind, stat, df, pval)
    assert rate < (0.6 if kind == "uniform" else 1.0)   # rejections (and the residual path) really happen


TREE = dict(nodes=5, width=2, lookup=(2, 1))


@pytest.mark.parametrize("kind,warp,n", [
    ("dspark", make_warp(1.0), 500),
    ("dspark", make_warp(0.7, top_p=0.9), 500),
    ("eagle3", make_warp(1.0), 500),
    ("eagle3_pruned", make_warp(0.7, top_p=0.9), 500),
])
def test_sampled_trees_match_target_distribution(small_vocab_target, kind, warp, n):
    """Sampled draft trees (draws without replacement, pruned draws, a prompt-lookup branch) through the
    real tree loop: the first three tokens are distributed as plain sampling's, at T = 1 and T = 0.7 with
    top-p 0.9, for a DSpark (sequential head) and an Eagle3 tree (tree attention in its draft layer)."""
    t = small_vocab_target
    d = _dspark(t, [0, 2, 3, 5] if kind.endswith("pruned") else None, algorithm=kind.split("_")[0])
    exact = _exact_joint(t, warp)
    counts, rate = _draw(t, d, warp, n, seed=7 + len(kind), tree=TREE)
    stat, df, pval = chi_square_gof(counts, exact)
    tv = total_variation(counts, exact)
    print(f"tree {kind} T={warp.temperature} top_p={warp.top_p}: n={n} chi2={stat:.2f} df={df} p={pval:.3f} "
          f"TV={tv:.3f} accepted/verified={rate:.2f}")
    assert pval > 1e-3, (kind, stat, df, pval)
    assert 0 < rate < 1.0
