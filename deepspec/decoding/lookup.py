"""Prompt lookup: draft tokens copied from the context, grafted onto a draft tree (no draft model).

Generated text often repeats its context: code restates the signature it was given, a math answer
restates the problem, a chat answer quotes the question.  `NgramIndex` finds the most recent earlier
occurrence of the context's last n tokens (the longest n from ``max_ngram`` down to ``min_ngram``) and
proposes the tokens that followed it, as prompt-lookup decoding does, with no model at all.

`graft` adds such a chain to a draft tree, sharing the nodes the tree already has (a chain whose first
tokens the drafter also proposed only adds its tail).  The target verifies the grafted nodes like any
other node, so the output stays the target's: the lookup only changes which candidates are verified.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Sequence, Tuple

import torch

from .tree import DraftTree

__all__ = ["NgramIndex", "graft"]


class NgramIndex:
    """The latest end position of every n-gram (``min_ngram ≤ n ≤ max_ngram``) of a growing token list,
    excluding the list's own suffix, so that `continuation` always points at an earlier occurrence."""

    def __init__(self, tokens: Sequence[int], max_ngram: int, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 ≤ min_ngram ≤ max_ngram (got {min_ngram}, {max_ngram})")
        self.max_ngram, self.min_ngram = int(max_ngram), int(min_ngram)
        self.tokens: List[int] = []
        self._last: Dict[Tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            # the n-grams ending at the current last token become "earlier" once a token follows them
            end = len(self.tokens) - 1
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self._last[tuple(self.tokens[end - n + 1:end + 1])] = end
            self.tokens.append(int(t))

    def continuation(self, length: int) -> List[int]:
        """Up to ``length`` tokens that followed the latest earlier occurrence of the longest matching
        suffix ([] when no suffix of ``min_ngram`` tokens or more occurred before)."""
        toks, L = self.tokens, len(self.tokens)
        if length < 1:
            return []
        for n in range(min(self.max_ngram, L), self.min_ngram - 1, -1):
            end = self._last.get(tuple(toks[L - n:]))
            if end is not None:
                return toks[end + 1:end + 1 + length]
        return []


def graft(tree: DraftTree, chain: Sequence[int]) -> Tuple[DraftTree, int]:
    """(the tree with ``chain`` as a path below the anchor, how many nodes were added).  The chain
    follows existing nodes while their tokens match and continues as new nodes appended after all
    others (a parent still comes before its children).  New nodes score −inf: they are not the draft's.
    A sampled tree also gets each chain token as a deterministic candidate of its parent, tested before
    the drafter's draws there (`deepspec.decoding.tree_accept`)."""
    toks, pars, deps = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    cur, added, path = -1, 0, []
    for t in chain:
        nxt = next((i for i, (tk, p) in enumerate(zip(toks, pars)) if p == cur and tk == int(t)), None)
        if nxt is None:
            toks.append(int(t))
            pars.append(cur)
            deps.append(1 if cur < 0 else deps[cur] + 1)
            nxt = len(toks) - 1
            added += 1
        path.append((int(t), cur, nxt))
        cur = nxt
    cands = tree.candidates
    if cands is not None and path:
        t, p, n = (torch.tensor(x, dtype=torch.long) for x in zip(*path))
        none = torch.full_like(t, -1)
        cands = replace(cands, tokens=torch.cat([t, cands.tokens]), parents=torch.cat([p, cands.parents]),
                        nodes=torch.cat([n, cands.nodes]), dist_rows=torch.cat([none, cands.dist_rows]),
                        draft_ids=torch.cat([none, cands.draft_ids]))
    if not added:
        return replace(tree, candidates=cands), 0
    scores = torch.cat([tree.scores, torch.full((added,), float("-inf"), dtype=tree.scores.dtype)])
    return DraftTree(tokens=torch.tensor(toks, dtype=torch.long), parents=torch.tensor(pars, dtype=torch.long),
                     depths=torch.tensor(deps, dtype=torch.long), scores=scores, candidates=cands), added
