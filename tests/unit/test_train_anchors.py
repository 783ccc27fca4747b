"""Anchor validity (CONTRACTS.md block semantics, as in the reference) and seeded, world-size
independent sampling."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspec.train.anchors import anchor_seed, sample_anchors, valid_anchor_mask


def brute_valid(mask, length):
    return [p for p in range(len(mask)) if p + 1 < length and mask[p] and mask[p + 1]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=0, max_size=40))
def test_valid_anchor_mask_matches_definition(mask):
    t = torch.tensor(mask, dtype=torch.bool)
    got = valid_anchor_mask(t).nonzero().reshape(-1).tolist()
    assert got == brute_valid(mask, len(mask))


def test_valid_respects_length_and_padding():
    lm = torch.tensor([0, 1, 1, 1, 1, 1, 1, 0, 0], dtype=torch.bool)
    # the anchor and its first target are answer tokens; later block positions may run past the answer
    assert valid_anchor_mask(lm).nonzero().reshape(-1).tolist() == [1, 2, 3, 4, 5]
    # a shorter length (right padding) removes anchors whose first target lies past it
    assert valid_anchor_mask(lm, length=5).nonzero().reshape(-1).tolist() == [1, 2, 3]
    # never on the prompt: the last prompt token (mask 0) is not an anchor
    assert not valid_anchor_mask(lm)[0]


def test_sample_anchors_valid_sorted_unique_and_deterministic():
    g = torch.Generator().manual_seed(0)
    lm = torch.rand(300, generator=g) > 0.1
    valid = set(valid_anchor_mask(lm).nonzero().reshape(-1).tolist())
    a = sample_anchors(lm, 16, seed=anchor_seed(0, 0, 7))
    assert a.numel() == 16 and set(a.tolist()) <= valid
    assert a.tolist() == sorted(set(a.tolist()))
    assert torch.equal(a, sample_anchors(lm, 16, seed=anchor_seed(0, 0, 7)))
    assert not torch.equal(a, sample_anchors(lm, 16, seed=anchor_seed(0, 1, 7)))   # next epoch
    assert not torch.equal(a, sample_anchors(lm, 16, seed=anchor_seed(1, 0, 7)))   # other run seed
    # fewer valid positions than requested: all of them; None / 0 = all
    assert sample_anchors(lm, 10_000, seed=1).tolist() == sorted(valid)
    assert sample_anchors(lm, None, seed=1).tolist() == sorted(valid)


def test_sample_anchors_is_uniform():
    lm = torch.ones(40, dtype=torch.bool)     # valid anchors 0..38
    counts = torch.zeros(40)
    for s in range(2000):
        counts[sample_anchors(lm, 6, seed=anchor_seed(3, s, 0))] += 1
    hit = counts[:39]
    assert counts[39:].sum() == 0
    expected = 2000 * 6 / 39                   # ~308 per position, σ ≈ 16: 0.25 is > 4σ
    assert ((hit - expected).abs() / expected).max() < 0.25


def test_anchor_seed_spread():
    seeds = {anchor_seed(0, e, i) for e in range(3) for i in range(200)}
    assert len(seeds) == 600 and all(0 <= s < 2 ** 63 for s in seeds)
