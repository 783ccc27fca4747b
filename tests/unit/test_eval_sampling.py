"""The warp shared by target and draft: greedy one-hot, temperature, top-k, top-p."""
import pytest
import torch

from deepspec.decoding.warp import make_warp, sample_token


def test_greedy_is_one_hot_argmax_first_on_ties():
    logits = torch.tensor([[0.1, 3.0, 3.0, -1.0], [5.0, 0.0, 0.0, 0.0]])
    p = make_warp(0.0)(logits)
    assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    assert make_warp(0.0).greedy and not make_warp(1.0).greedy
    g = torch.Generator().manual_seed(0)
    assert all(sample_token(p[0], g) == 1 for _ in range(20))


def test_temperature_matches_softmax():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(1))
    for t in (0.5, 1.0, 2.0):
        p = make_warp(t)(logits)
        assert p.dtype == torch.float32
        torch.testing.assert_close(p, torch.softmax(logits / t, -1))


def test_top_k_keeps_k_most_likely():
    logits = torch.tensor([1.0, 4.0, 2.0, 3.0, 0.0])
    p = make_warp(1.0, top_k=2)(logits)
    assert (p > 0).tolist() == [False, True, False, True, False]
    torch.testing.assert_close(p.sum(), torch.tensor(1.0))
    torch.testing.assert_close(p[1] / p[3], torch.exp(torch.tensor(1.0)))
    assert torch.equal(make_warp(1.0, top_k=0)(logits) > 0, torch.ones(5, dtype=torch.bool))


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert (make_warp(1.0, top_p=0.5)(logits) > 0).tolist() == [True, False, False, False]
    assert (make_warp(1.0, top_p=0.6)(logits) > 0).tolist() == [True, True, False, False]
    assert (make_warp(1.0, top_p=0.8)(logits) > 0).tolist() == [True, True, False, False]
    assert (make_warp(1.0, top_p=0.81)(logits) > 0).tolist() == [True, True, True, False]
    p = make_warp(1.0, top_p=0.6)(logits)
    torch.testing.assert_close(p[:2], torch.tensor([0.625, 0.375]))
    # order-independent (scatter back to vocabulary order), batched
    perm = torch.tensor([2, 0, 3, 1])
    pb = make_warp(1.0, top_p=0.6)(torch.stack([logits, logits[perm]]))
    torch.testing.assert_close(pb[1], pb[0][perm])


def test_identical_warp_for_target_and_draft_rows():
    w = make_warp(0.7, top_k=5, top_p=0.9)
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(w(x)[2], w(x[2]))
    torch.testing.assert_close(w(x).sum(-1), torch.ones(4))


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)])
def test_invalid_settings(kw):
    with pytest.raises(ValueError):
        make_warp(**{"temperature": 1.0, **kw})
