"""Draft building blocks: RoPE config, generic layer, attention masking, losses, registry."""
import math
from types import SimpleNamespace

import pytest
import torch

from deepspec.config.draft import DraftConfig
from deepspec.drafts import available_drafters, build_drafter
from deepspec.drafts.layers import Attention, DraftDims, DraftLayer, Rotary, rope_theta_from_config
from deepspec.drafts.losses import (metrics_from_stats, position_weights, stat_sums,
                                    step_weights, token_terms)


pytestmark = pytest.mark.usefixtures("one_thread")


def test_rope_theta_from_configs(tiny_target):
    theta = rope_theta_from_config(tiny_target.config)
    # Gemma 3 keeps one theta per layer type: the draft uses the full-attention one
    assert theta == (1e6 if tiny_target.config.model_type == "gemma3_text" else 1e4)
    assert rope_theta_from_config(SimpleNamespace(rope_theta=5e5)) == 5e5
    assert rope_theta_from_config(SimpleNamespace(rope_parameters={"rope_theta": 3.0})) == 3.0


def test_dims_follow_target_with_overrides(tiny_target):
    c = tiny_target.config
    d = DraftDims.from_target(c, DraftConfig())
    assert (d.hidden_size, d.num_heads, d.num_kv_heads) == (c.hidden_size, c.num_attention_heads,
                                                           c.num_key_value_heads)
    assert d.head_dim == (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    d2 = DraftDims.from_target(c, DraftConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                              intermediate_size=48))
    assert (d2.hidden_size, d2.head_dim, d2.intermediate_size) == (32, 16, 48)
    layer = DraftLayer(d2)
    x = torch.randn(2, 5, 32)
    out, (k, v) = layer(x, torch.arange(5).expand(2, 5))
    assert out.shape == x.shape and k.shape == v.shape == (2, 1, 5, 16)


def test_rotary_scores_depend_on_relative_position():
    rot = Rotary(8, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(m, n):
        return (rot(q, torch.tensor([[m]])) * rot(k, torch.tensor([[n]]))).sum().item()
    assert score(3, 1) == pytest.approx(score(10, 8), abs=1e-5)
    assert score(3, 1) != pytest.approx(score(3, 2), abs=1e-3)


def test_masked_prefix_keys_have_no_effect():
    torch.manual_seed(0)
    dims = DraftDims(16, 32, 4, 2, 4, 10000.0, 1e-6)
    attn = Attention(dims)
    x = torch.randn(1, 3, 16)
    pos = torch.arange(5, 8)[None]
    pk, pv = torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4)
    mask = torch.ones(1, 1, 3, 7, dtype=torch.bool)
    mask[..., 2:4] = False                       # hide prefix keys 2 and 3
    out1, _ = attn(x, pos, (pk, pv), mask)
    pk2, pv2 = pk.clone(), pv.clone()
    pk2[:, :, 2:4] += 5.0
    pv2[:, :, 2:4] -= 5.0
    out2, _ = attn(x, pos, (pk2, pv2), mask)
    torch.testing.assert_close(out1, out2)
    pk2[:, :, 0] += 5.0                          # a visible key does matter
    out3, _ = attn(x, pos, (pk2, pv2), mask)
    assert not torch.allclose(out1, out3)


def test_position_and_step_weights():
    w = position_weights(4, 4.0)
    torch.testing.assert_close(w, torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5), math.exp(-0.75)]))
    assert torch.equal(position_weights(3, 0.0), torch.ones(3))
    torch.testing.assert_close(step_weights(3, 0.8), torch.tensor([1.0, 0.8, 0.64]))


def test_token_terms_and_metrics_by_hand():
    # two items, gamma = 2, vocabulary 2: q and p chosen so TV is easy to compute
    q = torch.tensor([[[0.5, 0.5], [0.9, 0.1]], [[1.0, 0.0], [0.2, 0.8]]]).clamp_min(1e-12)
    p = torch.tensor([[[0.5, 0.5], [0.6, 0.4]], [[0.0, 1.0], [0.2, 0.8]]]).clamp_min(1e-12)
    tokens = torch.tensor([[0, 1], [1, 1]])
    t = token_terms(q.log(), p.log(), tokens)
    torch.testing.assert_close(t["tv"], torch.tensor([[0.0, 0.3], [1.0, 0.0]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(t["ce"], -q.log().gather(-1, tokens[..., None])[..., 0])
    m = metrics_from_stats(stat_sums(t, torch.ones(2, 2, dtype=torch.bool)))
    assert m["accept_rate/1"] == pytest.approx(0.5, abs=1e-5)
    assert m["accept_rate/2"] == pytest.approx(0.85, abs=1e-5)
    # tau = 1 + mean_b [(1-tv1) + (1-tv1)(1-tv2)] = 1 + ((1 + 0.7) + (0 + 0)) / 2
    assert m["expected_tau"] == pytest.approx(1.85, abs=1e-5)
    # an invalid position stops the acceptance chain of its item
    m2 = metrics_from_stats(stat_sums(t, torch.tensor([[True, False], [True, True]])))
    assert m2["accept_rate/2"] == pytest.approx(1.0, abs=1e-5)
    assert m2["expected_tau"] == pytest.approx(1 + 0.5 + 0.0, abs=1e-5)


def test_registry(tiny_llama):
    assert {"dflash", "dspark", "eagle3"} <= set(available_drafters())
    d = build_drafter(tiny_llama, DraftConfig(algorithm="dflash", num_layers=1, sequential_head="rnn",
                                              confidence_head=True))
    assert d.head is None and d.conf_head is None and d.cfg.sequential_head == "none"
    assert type(d).__name__ == "ParallelDrafter" and d.algorithm == "dflash"
    s = build_drafter(tiny_llama, DraftConfig(algorithm="dspark", num_layers=1, sequential_head="rnn", head_rank=8))
    assert type(s) is type(d) and s.head.kind == "rnn" and s.conf_head is not None
    with pytest.raises(ValueError, match="unknown draft algorithm"):
        build_drafter(tiny_llama, DraftConfig(algorithm="nope"))
    with pytest.raises(ValueError, match="sequential_head"):
        build_drafter(tiny_llama, DraftConfig(algorithm="dspark", sequential_head="lstm"))
