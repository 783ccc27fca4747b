"""Prompt lookup: the n-gram index's matches and the grafting of its chain onto a draft tree."""
import pytest
import torch

from deepspec.decoding.lookup import NgramIndex, graft
from deepspec.decoding.tree import DraftTree


def _brute(tokens, length, max_n, min_n):
    """The continuation after the latest earlier occurrence of the longest matching suffix."""
    L = len(tokens)
    for n in range(min(max_n, L), min_n - 1, -1):
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + length]
    return []


def test_index_finds_the_longest_suffix_at_its_latest_earlier_occurrence():
    idx = NgramIndex([1, 2, 3, 9, 1, 2, 4, 7, 2, 3], max_ngram=3)
    # suffix (2, 3) occurred at 1..2 (followed by 9, 1, ...); (3,) alone would give the same place
    assert idx.continuation(3) == [9, 1, 2]
    idx.extend([5])                     # (3, 5) and (5,) never occurred: nothing
    assert idx.continuation(4) == []
    idx.extend([1, 2])                  # (5, 1, 2) no; (1, 2) latest earlier at 4..5 -> [4, 7, 2]
    assert idx.continuation(3) == [4, 7, 2]
    assert idx.continuation(0) == []
    # the suffix itself never counts as its own earlier occurrence
    assert NgramIndex([4, 5, 6], max_ngram=3).continuation(2) == []
    # min_ngram: single-token matches are ignored at 2
    assert NgramIndex([7, 8, 9, 7], max_ngram=3, min_ngram=2).continuation(2) == []
    assert NgramIndex([7, 8, 9, 7], max_ngram=3, min_ngram=1).continuation(2) == [8, 9]
    with pytest.raises(ValueError, match="min_ngram"):
        NgramIndex([1], max_ngram=2, min_ngram=3)


@pytest.mark.parametrize("seed", range(6))
def test_index_built_incrementally_matches_a_brute_force_search(seed):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 6, (120,), generator=g).tolist()
    max_n, min_n = [(3, 1), (2, 1), (4, 2)][seed % 3]
    idx = NgramIndex(toks[:5], max_ngram=max_n, min_ngram=min_n)
    for i in range(5, len(toks)):
        assert idx.continuation(5) == _brute(toks[:i], 5, max_n, min_n), i
        idx.extend(toks[i:i + 1])


def _tree():
    # anchor -> 10 -> 11 -> 12 ; anchor -> 20 ; 10 -> 13
    return DraftTree(tokens=torch.tensor([10, 20, 11, 13, 12]), parents=torch.tensor([-1, -1, 0, 0, 2]),
                     depths=torch.tensor([1, 1, 2, 2, 3]), scores=torch.tensor([-0.1, -1.0, -0.5, -2.0, -0.9]))


def test_graft_shares_existing_nodes_and_appends_the_rest():
    tree, added = graft(_tree(), [10, 11, 30, 31])
    assert added == 2
    assert tree.tokens.tolist() == [10, 20, 11, 13, 12, 30, 31]
    assert tree.parents.tolist() == [-1, -1, 0, 0, 2, 2, 5]
    assert tree.depths.tolist() == [1, 1, 2, 2, 3, 3, 4]
    assert torch.isinf(tree.scores[5:]).all() and tree.scores[:5].tolist() == _tree().scores.tolist()
    assert all(p < i for i, p in enumerate(tree.parents.tolist()))


def test_graft_of_a_path_the_tree_has_adds_nothing_and_a_new_root_branch_starts_at_the_anchor():
    same, added = graft(_tree(), [10, 11, 12])
    assert added == 0 and same.tokens.tolist() == [10, 20, 11, 13, 12]
    tree, added = graft(_tree(), [40, 10])
    assert added == 2 and tree.parents.tolist()[-2:] == [-1, 5] and tree.depths.tolist()[-2:] == [1, 2]
    empty = DraftTree(*(torch.zeros(0, dtype=torch.long) for _ in range(3)), scores=torch.zeros(0))
    tree, added = graft(empty, [3, 4])
    assert added == 2 and tree.tokens.tolist() == [3, 4] and tree.parents.tolist() == [-1, 0]
