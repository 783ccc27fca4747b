"""Per-row deterministic sampling: exact distribution, warps, batch independence."""
from __future__ import annotations

import pytest
import torch

from deepspec.engines.base import Completion, GenerationError, SamplingParams, sample_seed
from deepspec.decoding.warp import warp_logits
from deepspec.engines.sampling import sample_tokens, splitmix64, uniform_noise


def test_splitmix64_reference_value():
    # first output of the reference splitmix64 generator seeded with 0
    assert splitmix64(torch.tensor([0]))[0].item() & ((1 << 64) - 1) == 0xE220A8397B1DCDAF


def test_uniform_noise_range_and_determinism():
    s = torch.tensor([0, 1, 2, (1 << 62) + 5], dtype=torch.int64)
    u = uniform_noise(s, 3, 4096)
    assert u.dtype == torch.float64 and 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert torch.equal(u, uniform_noise(s, 3, 4096))
    assert not torch.equal(u, uniform_noise(s, 4, 4096))
    # a row's noise does not depend on the other rows
    assert torch.equal(u[2], uniform_noise(s[2:3], 3, 4096)[0])


def test_sampling_matches_distribution():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = p.log()[None].repeat(20000, 1)
    toks = sample_tokens(logits, torch.arange(20000), 0, temperature=1.0)
    freq = torch.bincount(toks, minlength=4).float() / 20000
    assert torch.allclose(freq, p, atol=0.015)
    hot = sample_tokens(logits, torch.arange(20000), 0, temperature=0.5)
    q = torch.softmax(p.log() / 0.5, -1)
    assert torch.allclose(torch.bincount(hot, minlength=4).float() / 20000, q, atol=0.015)


def test_warps_restrict_support():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    seeds = torch.arange(4000)
    many = logits.repeat(4000, 1)
    assert set(sample_tokens(many, seeds, 0, 1.0, top_k=2).tolist()) == {0, 1}
    p = torch.softmax(logits[0], -1)
    # top_p: smallest prefix reaching the mass
    k = int((torch.cumsum(p, 0) < 0.8).sum()) + 1
    assert set(sample_tokens(many, seeds, 0, 1.0, top_p=0.8).tolist()) == set(range(k))
    lp = warp_logits(logits, 1.0, min_p=0.3)
    assert torch.isinf(lp[0, p < 0.3 * p.max()]).all() and torch.isfinite(lp[0, p >= 0.3 * p.max()]).all()
    assert torch.allclose(lp.exp().sum(), torch.tensor(1.0))
    assert sample_tokens(logits, seeds[:1], 0, 0.0).item() == 0  # greedy


def test_sample_seed_properties():
    assert sample_seed(1, "a") == sample_seed(1, "a") != sample_seed(2, "a")
    assert sample_seed(1, "a") != sample_seed(1, "b")
    assert sample_seed(1, 12345) == 12345 and sample_seed(7, None) == 7
    assert 0 <= sample_seed(0, "x") < (1 << 63)


@pytest.mark.parametrize("kw", [dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0),
                                dict(top_p=1.5), dict(top_k=-1), dict(min_p=2.0), dict(temperature=float("nan"))])
def test_sampling_params_validation(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_completion_is_a_string():
    c = Completion("hello", num_tokens=3, finish_reason="length", prompt_tokens=9)
    assert c == "hello" and isinstance(c, str) and c.text == "hello" and c.num_tokens == 3
    assert c.finish_reason == "length" and c.prompt_tokens == 9
    import pickle
    d = pickle.loads(pickle.dumps(c))
    assert d == c and d.num_tokens == 3
    e = GenerationError("boom", code="timeout", retryable=True)
    assert e.to_dict() == {"error": "boom", "code": "timeout", "attempts": 1}
