"""The single-sequence decode attention (`targets/attention.py`): the same logits as transformers'
stock sdpa path for prefill, multi-token verification over a cache and one-token decoding; models
with sliding windows keep the stock path."""
import pytest
import torch

from conftest import make_tiny_target
from deepspec.drafts.model_free import TargetAsDraft
from deepspec.decoding.warp import make_warp
from deepspec.decoding.chain import speculative_generate
from deepspec.decoding.loop import target_generate


def _decode_chain(t, ids, fast):
    t.fast_attention, t._offset_ok = fast, None
    o1 = t.decode(ids[:, :12])
    o2 = t.decode(ids[:, 12:19], o1.past_key_values)      # 7 queries over 12 cached keys
    o3 = t.decode(ids[:, 19:20], o1.past_key_values)      # one query
    return [o1.logits, o2.logits, o3.logits, o2.features], t._offset_ok


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_offset_causal_matches_stock_sdpa(family, one_thread):
    t = make_tiny_target(family)
    ids = torch.randint(10, t.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    stock, _ = _decode_chain(t, ids, False)
    fast, used = _decode_chain(t, ids, True)
    assert used is True
    for a, b in zip(stock, fast):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert t.model.config._attn_implementation == "sdpa"   # switched back after each forward


def test_sliding_window_models_keep_the_stock_path(one_thread):
    t = make_tiny_target("gemma3")
    t.fast_attention = True
    assert t._use_offset_causal() is False


def test_auto_is_on_where_supported_and_greedy_loop_is_lossless(one_thread):
    t = make_tiny_target("llama", num_layers=2)
    assert t.fast_attention is None and t._use_offset_causal() is True    # auto: wherever supported (CPU too)
    t.fast_attention = False
    assert t._use_offset_causal() is False                                # off when asked
    t.fast_attention = None
    prompt = list(range(20, 41))
    g = make_warp(0.0)
    base = target_generate(t, prompt, max_new_tokens=16, warp=g, eos_token_ids=[])
    spec = speculative_generate(t, TargetAsDraft(t, gamma=3), prompt, gamma=3, max_new_tokens=16, warp=g,
                                eos_token_ids=[])
    assert spec.tokens == base.tokens


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tree_attention_matches_stock_sdpa(family, one_thread):
    """A draft tree's forward through `tree_attention` (GQA inside SDPA) against the stock sdpa path."""
    from deepspec.decoding.tree_mask import tree_inputs
    t = make_tiny_target(family)
    ids = torch.randint(10, t.vocab_size, (1, 18), generator=torch.Generator().manual_seed(1))
    parents, depths = torch.tensor([-1, -1, 0, 1, 3, 3]), torch.tensor([1, 1, 2, 2, 3, 3])
    outs = []
    for fast in (False, True):
        t.fast_attention, t._offset_ok = fast, None
        o = t.decode(ids[:, :11])
        mask, pos = tree_inputs(t, parents, depths, 11)
        outs.append(t.decode(ids[:, 11:], o.past_key_values, attention_mask=mask, position_ids=pos))
    torch.testing.assert_close(outs[0].logits, outs[1].logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0].features, outs[1].features, rtol=1e-5, atol=1e-5)
    assert t.model.config._attn_implementation == "sdpa"
