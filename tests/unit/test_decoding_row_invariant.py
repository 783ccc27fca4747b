"""Row-invariant verification on tiny bf16 targets (whose GEMMs are row-invariant on this CPU; the reference
target's MLP down-projection is not): verification rows (chains and trees) give the bits of the one-token
decoding steps of their paths, and speculative outputs equal plain bf16 decoding."""
import copy

import pytest
import torch

from conftest import make_tiny_target
from deepspec.config.draft import DraftConfig
from deepspec.decoding.chain import speculative_generate
from deepspec.decoding.loop import target_generate
from deepspec.decoding.row_invariant import row_invariant
from deepspec.decoding.tree_loop import tree_generate
from deepspec.decoding.tree_mask import tree_inputs
from deepspec.decoding.warp import make_warp
from deepspec.drafts import build_drafter
from deepspec.targets.chat import encode_prompt

GREEDY = make_warp(0.0)
pytestmark = pytest.mark.usefixtures("one_thread")


def _steps(t, cache, tokens):
    """Logits of one-token decoding steps over ``tokens`` after ``cache`` (a copy)."""
    c = copy.deepcopy(cache)
    return [t.decode(torch.tensor([[x]]), c).logits[0, -1] for x in tokens]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rows_are_bit_identical_to_one_token_steps(family):
    """A context long enough that, on this CPU, the batched rows round differently from the steps (most rows
    differ without the option); with it every row has the steps' bits."""
    t = make_tiny_target(family, num_layers=2, hidden_size=256, dtype=torch.bfloat16)
    prompt = torch.arange(5, 400)[None]
    base = t.decode(prompt).past_key_values
    chain = [50, 51, 52, 53, 54, 55]
    with row_invariant(t):
        out = t.decode(torch.tensor([chain]), copy.deepcopy(base))
    for row, ref in enumerate(_steps(t, base, chain)):
        assert torch.equal(out.logits[0, row], ref), row
    # a tree: row i sees the cache and its own ancestors; compare each path with its own steps
    parents, depths = torch.tensor([-1, -1, 0, 1, 3]), torch.tensor([1, 1, 2, 2, 3])
    toks = [60, 61, 62, 63, 64]
    mask, pos = tree_inputs(t, parents, depths, prompt.shape[1])
    with row_invariant(t):
        tout = t.decode(torch.tensor([[70] + toks]), copy.deepcopy(base), attention_mask=mask, position_ids=pos)
    for row, path in [(0, [70]), (3, [70, 60, 62]), (5, [70, 61, 63, 64])]:
        assert torch.equal(tout.logits[0, row], _steps(t, base, path)[-1]), row
    assert t.fast_attention is None          # the adapter's own setting is back


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_bf16_speculative_outputs_equal_plain_decoding(kind):
    t = make_tiny_target("qwen3", num_layers=2, dtype=torch.bfloat16)
    torch.manual_seed(0)
    d = build_drafter(t, DraftConfig(algorithm="dspark", gamma=4, num_layers=1, head_rank=16)).eval()
    for text in ("What is 12 times 7?", "Write a poem about the sea."):
        prompt = encode_prompt(t.tokenizer, [{"role": "user", "content": text}])
        base = target_generate(t, prompt, max_new_tokens=24, warp=GREEDY, eos_token_ids=[]).tokens
        if kind == "chain":
            out = speculative_generate(t, d, prompt, gamma=4, max_new_tokens=24, warp=GREEDY, eos_token_ids=[],
                                       row_invariant=True)
        else:
            out = tree_generate(t, d, prompt, gamma=4, nodes=10, width=3, max_new_tokens=24, warp=GREEDY,
                                eos_token_ids=[], lookup=(3, 1), row_invariant=True)
        assert out.tokens == base


def test_targets_without_full_attention_everywhere_are_refused_by_name():
    g3 = make_tiny_target("gemma3", num_layers=2, dtype=torch.bfloat16)        # sliding-window layers
    with pytest.raises(ValueError, match="eval.row_invariant: .*sliding_attention"):
        with row_invariant(g3):
            pass
    assert g3.fast_attention is None
