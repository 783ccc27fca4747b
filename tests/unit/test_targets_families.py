"""The generic adapter on every tiny family, the hard ones included: mixtures of experts (qwen3_moe,
mixtral, gpt_oss), sliding windows (gemma3, mixtral: every layer; gpt_oss, gemma3_mm: mixed with full
layers), attention sinks (gpt_oss), a linear-attention hybrid (qwen3_next) and a multimodal checkpoint
(gemma3_mm).  Greedy speculative output equals plain greedy decoding under chain verification (drafts
rejected at every depth), tree verification and trees with prompt lookup; what cannot be exact is refused."""
import dataclasses

import pytest
import torch

from conftest import make_tiny_target
from deepspec.decoding.chain import speculative_generate
from deepspec.decoding.loop import target_generate
from deepspec.decoding.tree_loop import tree_generate
from deepspec.decoding.tree_mask import check_tree_target, tree_inputs
from deepspec.decoding.warp import make_warp
from deepspec.drafts.base import DraftState, Proposal
from deepspec.targets.architecture import TargetUnsupported
from deepspec.targets.chat import encode_prompt
from tests.support.oracle_tree import OracleTreeExpansion

GREEDY = make_warp(0.0)
HARD = ["qwen3_moe", "mixtral", "gpt_oss", "qwen3_next", "gemma3_mm"]
FAMILIES = ["llama", "gemma3", *HARD]
TREES = [f for f in FAMILIES if f != "qwen3_next"]
# layer kinds, sliding window, attention sinks, routed experts
EXPECTED = {
    "llama": ({"full_attention": 4}, None, False, 0),
    "gemma3": ({"sliding_attention": 4}, 16, False, 0),
    "qwen3_moe": ({"full_attention": 4}, None, False, 4),
    "mixtral": ({"sliding_attention": 4}, 24, False, 4),
    "gpt_oss": ({"full_attention": 2, "sliding_attention": 2}, 16, True, 4),
    "qwen3_next": ({"full_attention": 2, "linear_attention": 2}, None, False, 4),
    "gemma3_mm": ({"full_attention": 2, "sliding_attention": 2}, 16, False, 0),
}
# longer than every tiny window: the windows cut into what the rows see
TEXT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. " * 2
pytestmark = pytest.mark.usefixtures("one_thread")


class OracleChain:
    """Knows the target's greedy output; round r drafts it right up to depth r mod (γ+1), then wrong."""

    def __init__(self, prompt_len, truth, vocab):
        self.prompt_len, self.truth, self.vocab, self.round = prompt_len, truth, vocab, 0

    def init_state(self, ids, features):
        return DraftState(tokens=ids.clone())

    def advance(self, state, tokens, features):
        assert tokens.shape[0] == features.shape[0]
        state.tokens = torch.cat([state.tokens, tokens])

    def propose(self, state, anchor, gamma, warp, generator=None):
        m = state.length - self.prompt_len
        assert anchor == self.truth[m]
        self.round += 1
        right = self.round % (gamma + 1)
        toks = [t if k < right else (t + 1) % self.vocab for k, t in enumerate(self.truth[m + 1:m + 1 + gamma])]
        probs = torch.nn.functional.one_hot(torch.tensor(toks), self.vocab).float()
        return Proposal(tokens=torch.tensor(toks), probs=probs, confidence=torch.ones(len(toks)))


class OracleTree(OracleTreeExpansion, OracleChain):
    """A wrong sibling before each right token (accepted rows are never contiguous); right to depth ``cut``."""

    def __init__(self, prompt_len, truth, vocab, cut):
        super().__init__(prompt_len, truth, vocab)
        self.cut = cut


def _setup(family, new_tokens=40):
    t = make_tiny_target(family)
    prompt = encode_prompt(t.tokenizer, [{"role": "user", "content": TEXT}])
    base = target_generate(t, prompt, max_new_tokens=new_tokens, warp=GREEDY, eos_token_ids=[]).tokens
    return t, prompt, base


@pytest.mark.parametrize("family", FAMILIES)
def test_architecture_is_read_from_the_config(family):
    t = make_tiny_target(family)
    kinds, window, sinks, experts = EXPECTED[family]
    assert t.arch.describe() == {"layer_kinds": kinds, "sliding_window": window, "attention_sinks": sinks,
                                 "experts": experts}
    assert t.describe()["architecture"] == t.arch.describe()


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_rollback_and_decode_again_match_the_full_forward(family):
    t = make_tiny_target(family)
    ids = torch.randint(10, t.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = t.model(ids).logits.float()
    a = t.decode(ids[:, :30])
    cache = a.past_key_values
    b = t.decode(ids[:, 30:38], cache)                  # a verification forward of 8 tokens
    torch.testing.assert_close(b.logits, full[:, 30:38], rtol=1e-4, atol=1e-4)
    for keep, steps in [(33, [33, 38]), (38, [38, 40])]:     # reject 5, then accept all (rollback by 0)
        t.rollback(cache, keep)
        assert t.cache_length(cache) == keep
        c = t.decode(ids[:, steps[0]:steps[1]], cache)
        torch.testing.assert_close(c.logits, full[:, steps[0]:steps[1]], rtol=1e-4, atol=1e-4)
    # one token at a time (a drafter's own decodes), then all of them rolled back at once
    t.rollback(cache, 38)
    for i in range(38, 40):
        t.decode(ids[:, i:i + 1], cache)
    t.rollback(cache, 38)
    d = t.decode(ids[:, 38:40], cache)
    torch.testing.assert_close(d.logits, full[:, 38:40], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_chain_verification_is_lossless_with_rejections_at_every_depth(family):
    t, prompt, base = _setup(family)
    d = OracleChain(len(prompt), base + [0] * 16, t.vocab_size)
    out = speculative_generate(t, d, prompt, gamma=4, max_new_tokens=40, warp=GREEDY, eos_token_ids=[])
    assert out.tokens == base
    assert {r.accepted for r in out.rounds} == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("family", TREES)
def test_tree_verification_with_and_without_lookup_is_lossless(family):
    t, prompt, base = _setup(family)
    d = OracleTree(len(prompt), base + [0] * 16, t.vocab_size, cut=3)
    out = tree_generate(t, d, prompt, gamma=4, nodes=8, width=2, max_new_tokens=40, warp=GREEDY, eos_token_ids=[])
    assert out.tokens == base and max(r.accepted for r in out.rounds) == 3
    d = OracleTree(len(prompt), base + [0] * 16, t.vocab_size, cut=1)
    out = tree_generate(t, d, prompt, gamma=4, nodes=8, width=2, max_new_tokens=40, warp=GREEDY,
                        eos_token_ids=[], lookup=(3, 1))
    assert out.tokens == base and all(r.proposed <= 8 for r in out.rounds)


@pytest.mark.parametrize("family", ["gemma3", "mixtral", "gpt_oss", "gemma3_mm"])
def test_tree_rows_see_the_window_their_chain_sees(family):
    """Beyond the window, each tree row's logits are those of a chain forward over its path; the same tree
    without the window in the mask (every layer taken as full attention) gets them wrong."""
    t = make_tiny_target(family)
    ids = torch.randint(10, t.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    past = 36                                          # > every tiny window
    tokens, parents, depths = torch.tensor([20, 21, 22, 23]), torch.tensor([-1, -1, 1, 2]), torch.tensor([1, 1, 2, 3])
    tree_ids = torch.cat([torch.tensor([30]), tokens])[None]
    rows = [(1, [30, 20]), (4, [30, 21, 22, 23])]
    refs = [t.decode(torch.cat([ids[0, :past], torch.tensor(p)])[None]).logits[0, -1] for _, p in rows]

    def tree_logits():
        cache = t.decode(ids[:, :past]).past_key_values
        mask, pos = tree_inputs(t, parents, depths, past)
        return t.decode(tree_ids, cache, attention_mask=mask, position_ids=pos).logits[0]
    got = tree_logits()
    for (row, _), ref in zip(rows, refs):
        torch.testing.assert_close(got[row], ref, rtol=1e-4, atol=1e-4)
    t.arch = dataclasses.replace(t.arch, layer_types=("full_attention",) * len(t.arch.layer_types))
    wrong = tree_logits()
    assert max(float((wrong[row] - ref).abs().max()) for (row, _), ref in zip(rows, refs)) > 1e-3


def test_recurrent_layers_refuse_trees_and_rollbacks_past_their_record():
    t = make_tiny_target("qwen3_next")
    with pytest.raises(TargetUnsupported, match="linear_attention layers carry a recurrent state .*use chain"):
        check_tree_target(t)
    ids = torch.randint(10, t.vocab_size, (1, 30), generator=torch.Generator().manual_seed(1))
    cache = t.decode(ids[:, :20]).past_key_values
    t.decode(ids[:, 20:25], cache)
    with pytest.raises(TargetUnsupported, match="cannot roll back 15 tokens .* last 5 tokens only"):
        t.rollback(cache, 10)                          # the prompt's own tokens are committed
    with pytest.raises(TargetUnsupported, match="one sequence, not a tree"):
        t.keep_positions(cache, 20, torch.tensor([0, 2]))
    from transformers import DynamicCache
    with pytest.raises(TargetUnsupported, match="need a cache from TargetAdapter.new_cache"):
        t.decode(ids[:, :4], DynamicCache())


def test_a_rolling_sliding_window_cache_is_refused_not_cropped_wrong():
    from transformers import DynamicCache
    t = make_tiny_target("gemma3")
    ids = torch.randint(10, t.vocab_size, (1, 30), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=t.model.config)        # transformers' rolling cache: drops what left the window
    t.decode(ids, cache)
    with pytest.raises(TargetUnsupported, match="sliding window of 16 already dropped"):
        t.rollback(cache, 25)


def test_mixed_layer_kinds_need_a_decoder_that_takes_one_mask_per_kind():
    """gemma3_mm's decoder takes a mask per layer kind; mixtral's takes one mask, so a mixtral whose layers
    were mixed could not be given the window where it belongs: refused."""
    from deepspec.targets.tree_masks import accepts_mask_mapping
    assert accepts_mask_mapping(make_tiny_target("gemma3_mm")) is True
    mx = make_tiny_target("mixtral")
    mx.arch = dataclasses.replace(mx.arch, layer_types=("sliding_attention", "full_attention") * 2)
    assert accepts_mask_mapping(mx) is False
    with pytest.raises(TargetUnsupported, match="one attention mask for layers that mix full and sliding"):
        check_tree_target(mx)


@pytest.mark.parametrize("family", HARD)
def test_the_embedded_engine_decodes_as_generate_does(family):
    """Batched, left-padded regeneration (rows finishing at different steps) on the model's own cache kinds."""
    from deepspec.engines.base import SamplingParams
    from deepspec.engines.hf import HFEngine
    t = make_tiny_target(family)
    prompts = [[{"role": "user", "content": "hello number %d" % i + " tell me more" * (i % 3)}] for i in range(5)]
    sp = SamplingParams(max_new_tokens=10, temperature=0.0)
    a = HFEngine.from_target(t, batch_size=5, loop="generate").generate(prompts, sp)
    b = HFEngine.from_target(t, batch_size=5, loop="deepspec").generate(prompts, sp)
    assert [(x.text, x.num_tokens) for x in a] == [(x.text, x.num_tokens) for x in b]


def _moe_with_router_outputs_on(family, num_layers):
    """A tiny MoE target whose config asks for router logits (as some released MoE configs do)."""
    from deepspec.targets import TargetAdapter
    from deepspec.targets.tiny import build_tiny
    model, tok = build_tiny(family, num_layers=num_layers)
    model.config.output_router_logits = True
    return TargetAdapter(model.float(), tok, num_feature_layers=5, name=f"tiny-{family}")


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "qwen3_next"])
def test_moe_capture_is_the_residual_stream_at_the_recipe_layer_ids(family):
    """Five evenly spaced layer ids (the recipes' default) on an 8-layer MoE: the features are the decoder
    layers' outputs (`hidden_states[i + 1]`), no router output is computed or kept."""
    t = _moe_with_router_outputs_on(family, num_layers=8)
    assert t.layer_ids == [1, 2, 3, 4, 5] and t.model.config.output_router_logits is False
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": TEXT}]
    ids = torch.tensor([t.encode_chat(conv).input_ids])
    cap = t.capture(ids)
    assert cap.features.shape == (1, ids.shape[1], 5 * t.hidden_size)
    with torch.no_grad():
        out = t.model(ids, output_hidden_states=True)
    assert getattr(out, "router_logits", None) is None
    for k, i in enumerate(t.layer_ids):
        torch.testing.assert_close(cap.features[..., k * t.hidden_size:(k + 1) * t.hidden_size],
                                   out.hidden_states[i + 1], rtol=1e-5, atol=1e-5)


def test_moe_cache_is_the_size_of_the_dense_cache(tmp_path):
    """qwen3_moe and dense qwen3 share the tokenizer and H: their caches of the same conversations hold
    tensors of the same shapes, token for token."""
    from deepspec.cache import CacheReader
    from deepspec.config import load_config
    from deepspec.cache.writer import build_cache
    from tests.support.synthetic import write_regen_jsonl
    write_regen_jsonl(tmp_path / "regen.jsonl", 6, seed=1, max_words=30)
    readers = {}
    targets = {"moe": _moe_with_router_outputs_on("qwen3_moe", 8),
               "dense": make_tiny_target("qwen3", num_layers=8, num_feature_layers=5)}
    for name, target in targets.items():
        cfg = load_config([f"run_dir={tmp_path / name}", f"data.regen_path={tmp_path / 'regen.jsonl'}",
                           f"cache.dir={tmp_path / name / 'cache'}", "cache.shard_samples=3", "data.max_length=128"])
        readers[name] = CacheReader(build_cache(cfg, target=target, progress=False))
    moe, dense = readers["moe"], readers["dense"]
    for key in ("layer_ids", "hidden_size", "feature_dim"):
        assert moe.manifest[key] == dense.manifest[key]
    assert len(moe) == len(dense) == 6
    for i in range(6):
        a, b = moe[i], dense[i]
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert {k: tuple(v.shape) for k, v in a.items()} == {k: tuple(v.shape) for k, v in b.items()}
        assert a["features"].dtype == b["features"].dtype


@pytest.mark.parametrize("family,cls,attn", [("gpt_oss", "GptOssForCausalLM", "eager"),
                                             ("gemma3_mm", "Gemma3ForConditionalGeneration", "sdpa")])
def test_saved_checkpoints_load_through_the_generic_loader(tmp_path, family, cls, attn):
    """From an HF directory: gpt-oss has no sdpa attention (the default target.attn_implementation), so the
    loader takes the model's own; the multimodal checkpoint loads whole and the adapter drives its text model."""
    from deepspec.config import TargetConfig
    from deepspec.targets import load_target
    from deepspec.targets.tiny import save_tiny
    save_tiny(family, tmp_path / family)
    t = load_target(TargetConfig(name=family, path=str(tmp_path / family), dtype="float32", device="cpu"))
    assert type(t.model).__name__ == cls and t.model.config._attn_implementation == attn
    assert t.arch.describe() == dict(zip(("layer_kinds", "sliding_window", "attention_sinks", "experts"),
                                         EXPECTED[family]))
    ref = make_tiny_target(family)
    ids = torch.randint(10, t.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(t.decode(ids).logits, ref.decode(ids).logits, rtol=1e-5, atol=1e-5)
