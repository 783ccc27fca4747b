"""Tree verification: the tree grower's invariants, the target's tree mask and cache compaction, the
greedy tree walk, and the tree loop's losslessness (its output is the target's greedy output)."""
import pytest
import torch

from conftest import make_tiny_target
from tests.support.oracle_tree import OracleTreeExpansion
from deepspec.config.draft import DraftConfig
from deepspec.drafts import build_drafter
from deepspec.drafts.base import DraftState
from deepspec.decoding.tree import DraftTree, grow_tree
from deepspec.decoding.warp import make_warp
from deepspec.decoding.chain import speculative_generate
from deepspec.decoding.loop import target_generate
from deepspec.decoding.tree_accept import accept_tree_greedy
from deepspec.decoding.tree_loop import tree_generate
from deepspec.targets.chat import encode_prompt
from deepspec.decoding.tree_mask import ancestor_mask, tree_inputs

GREEDY = make_warp(0.0)
pytestmark = pytest.mark.usefixtures("one_thread")


def _check_tree(tree: DraftTree, nodes: int, gamma: int):
    n = len(tree)
    assert 1 <= n <= nodes
    for i in range(n):
        p = int(tree.parents[i])
        assert -1 <= p < i
        assert int(tree.depths[i]) == (1 if p < 0 else int(tree.depths[p]) + 1) <= gamma
        if p >= 0:
            assert float(tree.scores[i]) <= float(tree.scores[p]) + 1e-6
    paths = {tuple(_path(tree, i)) for i in range(n)}
    assert len(paths) == n            # no two nodes spell the same continuation


def _path(tree, i):
    out = []
    while i >= 0:
        out.append(int(tree.tokens[i]))
        i = int(tree.parents[i])
    return out[::-1]


def _random_expand(vocab, seed):
    """Logits that depend on the parent token and depth (a Markov drafter), normalised (so the scores can
    be checked against them)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.log_softmax(torch.randn(8, vocab, vocab, generator=g) * 2, dim=-1)

    def expand(k, tokens, state):
        return table[k, tokens], state
    return expand, table


@pytest.mark.parametrize("nodes,width", [(1, 1), (5, 2), (16, 4), (40, 3), (100, 8)])
def test_grow_tree_invariants(nodes, width):
    expand, _ = _random_expand(11, seed=nodes)
    tree = grow_tree(expand, anchor=3, root_state=None, gamma=5, nodes=nodes, width=width)
    _check_tree(tree, nodes, 5)
    # the scores are the paths' summed log-probabilities
    _, table = _random_expand(11, seed=nodes)
    for i in range(len(tree)):
        toks, prev, s = _path(tree, i), 3, 0.0
        for k, t in enumerate(toks):
            s += float(table[k, prev, t])
            prev = t
        assert float(tree.scores[i]) == pytest.approx(s, abs=1e-5)


def test_grow_tree_width_one_is_the_greedy_chain():
    expand, table = _random_expand(9, seed=1)
    tree = grow_tree(expand, anchor=0, root_state=None, gamma=6, nodes=6, width=1)
    prev, chain = 0, []
    for k in range(6):
        prev = int(table[k, prev].argmax())
        chain.append(prev)
    assert tree.tokens.tolist() == chain and tree.parents.tolist() == [-1, 0, 1, 2, 3, 4]


def test_grow_tree_keeps_the_likeliest_nodes_and_maps_the_vocabulary():
    # position-independent distributions (a drafter without a sequential head): with width ≥ the
    # vocabulary every node below the budget is considered, so the tree is the exact top-N of all paths
    lp = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0], [0.5, 0.0, 3.0]]), dim=-1)
    vocab = torch.tensor([10, 20, 30])
    tree = grow_tree(lambda k, t, s: (lp[k].expand(t.shape[0], -1), s), 0, None, 2, 5, 3, vocab=vocab)
    all_paths = sorted(((float(lp[0, a]), (a,)) for a in range(3)), reverse=True)
    all_paths += [(float(lp[0, a] + lp[1, b]), (a, b)) for a in range(3) for b in range(3)]
    best = sorted(all_paths, key=lambda x: -x[0])[:5]
    got = {tuple(_path(tree, i)) for i in range(len(tree))}
    assert got == {tuple(int(vocab[j]) for j in p) for _, p in best}


def _full_growth(expand, anchor, gamma, nodes, width):
    """Reference: the same beam over every depth (no early stop), then the best ``nodes`` paths with ties to
    the shallower node, as (score, path) sorted."""
    seen, frontier = [], [(0.0, (anchor,))]
    for k in range(gamma):
        kids = []
        for score, path in frontier:
            lp = torch.log_softmax(expand(k, torch.tensor([path[-1]]), None)[0].float(), -1)[0]
            top = lp.topk(min(width, lp.numel()))
            kids += [(score + float(v), path + (int(j),)) for v, j in zip(top.values, top.indices)]
        seen += kids
        frontier = sorted(kids, key=lambda x: -x[0])[:width]
    best = sorted(seen, key=lambda x: (-x[0], len(x[1])))[:nodes]
    return sorted(p[1:] for _, p in best)


@pytest.mark.parametrize("seed", range(12))
def test_grow_tree_stops_early_without_changing_the_tree(seed):
    """Growth stops once no frontier node can enter the tree: the tree is the one a full growth gives,
    and confident-then-flat drafts stop after few depths."""
    vocab, gamma = 7, 6
    nodes, width = [(3, 2), (6, 3), (10, 4), (4, 7)][seed % 4]
    g = torch.Generator().manual_seed(seed)
    sharp = torch.log_softmax(torch.randn(gamma, vocab, vocab, generator=g) * (1 + seed % 3) * 2, dim=-1)
    calls = []

    def expand(k, tokens, state):
        calls.append(k)
        return sharp[k, tokens], state
    tree = grow_tree(expand, 0, None, gamma, nodes, width)
    _check_tree(tree, nodes, gamma)
    got = sorted(tuple(_path(tree, i)) for i in range(len(tree)))
    assert got == _full_growth(lambda k, t, s: (sharp[k, t], s), 0, gamma, nodes, width)
    # flat distributions: after depth 1 every deeper node scores below the nodes-th best of depth 1
    calls.clear()
    flat = torch.zeros(gamma, vocab, vocab)
    grow_tree(lambda k, t, s: (calls.append(k) or flat[k, t], s), 0, None, gamma, 4, 5)
    assert calls == [0]


def test_ancestor_mask_and_positions(tiny_llama):
    parents = torch.tensor([-1, -1, 0, 2, 1])
    m = ancestor_mask(parents)
    want = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 3, 4}, 5: {0, 2, 5}}
    for row, cols in want.items():
        assert set(torch.nonzero(m[row]).flatten().tolist()) == cols
    with pytest.raises(ValueError, match="parents must come before"):
        ancestor_mask(torch.tensor([-1, 2, 0]))
    mask, pos = tree_inputs(tiny_llama, parents, torch.tensor([1, 1, 2, 3, 2]), past=4)
    assert mask.shape == (1, 1, 6, 10) and bool((mask[0, 0, :, :4] == 0).all())
    assert torch.equal(mask[0, 0, :, 4:] == 0, m)                     # additive: 0 where allowed
    assert pos.tolist() == [[4, 5, 5, 6, 7, 6]]


def test_tree_forward_matches_chain_forwards_and_keep_positions(tiny_llama):
    """Each tree row's logits equal a plain forward over its own path; keep_positions leaves the cache a
    chain forward over the accepted path would have left."""
    t = tiny_llama
    prompt = torch.arange(5, 12)[None]
    out = t.decode(prompt)
    tokens, parents, depths = torch.tensor([20, 21, 22, 23]), torch.tensor([-1, -1, 1, 2]), torch.tensor([1, 1, 2, 3])
    ids = torch.cat([torch.tensor([30]), tokens])[None]
    mask, pos = tree_inputs(t, parents, depths, past=7)
    tout = t.decode(ids, out.past_key_values, attention_mask=mask, position_ids=pos)
    for row, path in [(0, [30]), (1, [30, 20]), (2, [30, 21]), (4, [30, 21, 22, 23])]:
        ref = t.decode(torch.cat([prompt[0], torch.tensor(path)])[None])
        torch.testing.assert_close(tout.logits[0, row], ref.logits[0, -1], rtol=1e-4, atol=1e-4)
    cache = tout.past_key_values
    t.keep_positions(cache, 7, torch.tensor([0, 2, 3, 4]))
    ref = t.decode(torch.tensor([[5, 6, 7, 8, 9, 10, 11, 30, 21, 22, 23]]))
    assert t.cache_length(cache) == 11
    for mine, theirs in zip(cache.layers, ref.past_key_values.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="strictly increasing"):
        t.keep_positions(cache, 7, torch.tensor([1, 0]))


def test_accept_tree_greedy():
    tokens, parents = [5, 6, 7, 8, 9], [-1, -1, 1, 1, 3]
    # best[0]: after the anchor; best[i+1]: after node i
    assert accept_tree_greedy(tokens, parents, [6, 0, 8, 0, 9, 4]) == ([1, 3, 4], 4)
    assert accept_tree_greedy(tokens, parents, [6, 0, 3, 0, 9, 4]) == ([1], 3)
    assert accept_tree_greedy(tokens, parents, [2, 0, 0, 0, 0, 0]) == ([], 2)
    assert accept_tree_greedy([], [], [7]) == ([], 7)
    with pytest.raises(ValueError, match="argmax"):
        accept_tree_greedy(tokens, parents, [1, 2])


class OracleTree(OracleTreeExpansion):
    """A test drafter that knows the target's greedy output; the real `grow_tree` grows its trees."""

    def __init__(self, prompt_len, truth, cut, vocab):
        self.prompt_len, self.truth, self.cut, self.vocab = prompt_len, truth, cut, vocab

    def init_state(self, ids, features):
        return DraftState(tokens=ids.clone())

    def advance(self, state, tokens, features):
        assert tokens.shape[0] == features.shape[0]
        state.tokens = torch.cat([state.tokens, tokens])
        return state


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("cut,nodes", [(3, 16), (7, 5), (1, 2)])
def test_tree_loop_is_lossless_with_accepted_paths(family, cut, nodes):
    t = make_tiny_target(family, num_layers=2)
    prompt = encode_prompt(t.tokenizer, [{"role": "user", "content": "What is 12 times 7?"}])
    base = target_generate(t, prompt, max_new_tokens=25, warp=GREEDY, eos_token_ids=[]).tokens
    d = OracleTree(len(prompt), base + [0] * 10, cut, t.vocab_size)
    out = tree_generate(t, d, prompt, gamma=4, nodes=nodes, width=2, max_new_tokens=25, warp=GREEDY, eos_token_ids=[])
    assert out.tokens == base
    assert 1 + sum(r.emitted for r in out.rounds) == 25
    full = min(cut, 4, nodes // 2)
    assert max(r.accepted for r in out.rounds) == full                # the oracle's path is accepted ...
    assert all(r.accepted <= full for r in out.rounds)
    # draft_depth stops the drafter's tree there: still lossless, no path longer than the cap
    capped = tree_generate(t, d, prompt, gamma=4, nodes=nodes, width=2, max_new_tokens=25, warp=GREEDY,
                           eos_token_ids=[], draft_depth=2)
    assert capped.tokens == base
    assert max(r.accepted for r in capped.rounds) == min(full, 2)


@pytest.mark.parametrize("algo", [dict(algorithm="dspark", sequential_head="rnn"), dict(algorithm="dflash"),
                                  dict(algorithm="eagle3"), dict(algorithm="eagle3", eagle3_layout="engine")])
def test_tree_loop_is_lossless_with_a_real_drafter(tiny_qwen3, algo):
    t = tiny_qwen3
    torch.manual_seed(0)
    d = build_drafter(t, DraftConfig(gamma=4, num_layers=1, head_rank=16, **algo)).eval()
    for text in ("What is 12 times 7?", "Write a poem about the sea."):
        prompt = encode_prompt(t.tokenizer, [{"role": "user", "content": text}])
        base = target_generate(t, prompt, max_new_tokens=16, warp=GREEDY, eos_token_ids=[]).tokens
        out = tree_generate(t, d, prompt, gamma=4, nodes=12, width=3, max_new_tokens=16, warp=GREEDY, eos_token_ids=[])
        assert out.tokens == base
        assert all(r.proposed <= 12 for r in out.rounds) and all(r.proposed >= 1 for r in out.rounds[:-1])
        looked = tree_generate(t, d, prompt, gamma=4, nodes=12, width=3, max_new_tokens=16, warp=GREEDY,
                               eos_token_ids=[], lookup=(3, 1))
        assert looked.tokens == base and all(r.proposed <= 12 for r in looked.rounds)
        # a tree of width 1 and γ nodes is the greedy chain: the same rounds as chain verification
        chain = speculative_generate(t, d, prompt, gamma=4, max_new_tokens=16, warp=GREEDY, eos_token_ids=[])
        one = tree_generate(t, d, prompt, gamma=4, nodes=4, width=1, max_new_tokens=16, warp=GREEDY, eos_token_ids=[])
        assert [r.accepted for r in one.rounds] == [r.accepted for r in chain.rounds]


def test_tree_refuses_recurrent_layers_and_chain_only_drafters(tiny_llama):
    t = tiny_llama
    nx = make_tiny_target("qwen3_next", num_layers=2)
    with pytest.raises(ValueError, match="linear_attention layers carry a recurrent state"):
        tree_generate(nx, build_drafter(nx, DraftConfig(algorithm="dflash", gamma=3, num_layers=1)).eval(),
                      [5, 6, 7], gamma=3, nodes=4, width=2, max_new_tokens=4, warp=GREEDY)
    from deepspec.drafts.model_free import TargetAsDraft
    with pytest.raises(NotImplementedError, match="drafts chains only"):
        tree_generate(t, TargetAsDraft(t, gamma=3), [5, 6, 7], gamma=3, nodes=4, width=2, max_new_tokens=4, warp=GREEDY)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tree_loop_with_prompt_lookup_is_lossless_and_accepts_copied_tokens(family):
    """A drafter whose trees never hold the target's token, plus prompt lookup: the output is still the
    target's, and every accepted token came from the lookup chain (tiny random targets fall into loops,
    which the lookup copies)."""
    t = make_tiny_target(family, num_layers=2)
    prompt = encode_prompt(t.tokenizer, [{"role": "user", "content": "What is 12 times 7?"}])
    base = target_generate(t, prompt, max_new_tokens=40, warp=GREEDY, eos_token_ids=[]).tokens
    d = OracleTree(len(prompt), base + [0] * 10, 0, t.vocab_size)          # proposes nothing the target wants
    out = tree_generate(t, d, prompt, gamma=4, nodes=6, width=2, max_new_tokens=40, warp=GREEDY,
                        eos_token_ids=[], lookup=(3, 1))
    assert out.tokens == base
    assert all(r.proposed <= 6 for r in out.rounds)
    assert sum(r.lookup_accepted for r in out.rounds) == sum(r.accepted for r in out.rounds) > 0
    # with the drafter's own right answers the lookup only adds candidates: still lossless
    d = OracleTree(len(prompt), base + [0] * 10, 2, t.vocab_size)
    out = tree_generate(t, d, prompt, gamma=4, nodes=8, width=2, max_new_tokens=40, warp=GREEDY,
                        eos_token_ids=[], lookup=(3, 1))
    assert out.tokens == base and all(r.proposed <= 8 for r in out.rounds)
    # a drafter's tree capped at depth 1 leaves the lookup chain its full γ
    out = tree_generate(t, d, prompt, gamma=4, nodes=8, width=2, max_new_tokens=40, warp=GREEDY,
                        eos_token_ids=[], lookup=(3, 1), draft_depth=1)
    assert out.tokens == base
    assert all(r.accepted - r.lookup_accepted <= 1 for r in out.rounds)
    assert max(r.lookup_accepted for r in out.rounds) > 1


def test_no_draft_alone_is_plain_decoding_and_with_lookup_is_prompt_lookup_decoding(tiny_llama):
    from deepspec.drafts.model_free import NoDraft
    t = tiny_llama
    prompt = encode_prompt(t.tokenizer, [{"role": "user", "content": "What is 12 times 7?"}])
    base = target_generate(t, prompt, max_new_tokens=30, warp=GREEDY, eos_token_ids=[]).tokens
    d = NoDraft(t, gamma=4)
    chain = speculative_generate(t, d, prompt, gamma=4, max_new_tokens=30, warp=GREEDY, eos_token_ids=[])
    assert chain.tokens == base and all(r.accepted == 0 and r.proposed == 0 for r in chain.rounds)
    out = tree_generate(t, d, prompt, gamma=4, nodes=4, width=1, max_new_tokens=30, warp=GREEDY,
                        eos_token_ids=[], lookup=(3, 1))
    assert out.tokens == base
    assert all(r.lookup_accepted == r.accepted for r in out.rounds)
    assert len(out.rounds) < len(chain.rounds)            # the tiny target loops, and the lookup copies it


class _ForcedWarp:
    """A greedy-looking warp that forces the drafter's chain along ``path`` and keeps the logits it saw."""
    greedy = True

    def __init__(self, path):
        self.path, self.seen = list(path), []

    def __call__(self, logits):
        self.seen.append(logits.float().reshape(-1))
        out = torch.zeros_like(self.seen[-1])
        out[self.path[len(self.seen) - 1]] = 1.0
        return out[None]


@pytest.mark.parametrize("layout", ["native", "engine"])
def test_eagle3_tree_rows_see_what_their_chain_would(tiny_qwen3, layout):
    """Every node of an Eagle3 tree (tree attention over the draft's own KV cache) scores exactly what the
    chain step along its path computes: the tree mask gives each row its ancestors and nothing else."""
    from deepspec.decoding.tree import draft_tree
    t = tiny_qwen3
    torch.manual_seed(0)
    d = build_drafter(t, DraftConfig(algorithm="eagle3", gamma=4, num_layers=1, eagle3_layout=layout)).eval()
    prompt = encode_prompt(t.tokenizer, [{"role": "user", "content": "What is 12 times 7?"}])
    out = t.decode(torch.tensor([prompt]))
    state = d.init_state(torch.tensor(prompt), out.features[0])
    tree = draft_tree(d, state, 7, 4, 14, 3)
    _check_tree(tree, 14, 4)
    assert int(tree.depths.max()) >= 3
    for i in range(len(tree)):
        path = _path(tree, i)
        w = _ForcedWarp(path)
        assert d.propose(state, 7, len(path), w).tokens.tolist() == path
        ref = sum(float(torch.log_softmax(lg, -1)[tok]) for lg, tok in zip(w.seen, path))
        assert float(tree.scores[i]) == pytest.approx(ref, abs=1e-4)
