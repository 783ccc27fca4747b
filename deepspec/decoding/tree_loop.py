"""Batch-size-1 lossless decoding with draft trees (one target forward per round), greedy or sampled::

    round     tree  = grow_tree(drafter.tree_expansion(state, anchor, γ), nodes, width[, warp])
              (prompt lookup: a chain copied from the context grafted on, within the same node budget)
              target.decode([anchor, tree nodes], cache, tree mask, depths)    ONE forward
              accept a root path (`deepspec.decoding.tree_accept`)             -> path, next token
              keep the cache rows of anchor + path, drop the other nodes
              drafter.advance(state, [anchor, path], their features)
              anchor = the next token (correction or bonus)

Each row of the forward sees the cache plus its own ancestors at position ``cache length + depth``, so
its logits are those of a plain decode of its path: greedy, the walk accepts while a child is the
target's argmax (the target's greedy output); sampled, the multi-candidate rule accepts with the
probabilities that make the output exactly the target's warped sampling distribution.
The rounds are `RoundStats` as in the chain loop: ``proposed`` = nodes verified, ``accepted`` = the
accepted path's length, ``draft_tokens`` = that path's tokens.
"""
from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch

from .lookup import NgramIndex, graft
from .loop import DecodeLoop, GenerationResult, RoundStats
from .tree import draft_tree
from .tree_accept import accept_tree_greedy, accept_tree_sampling
from .tree_mask import check_tree_target, tree_inputs
from .warp import Warp, greedy_ids

__all__ = ["tree_generate"]


def _accept(vout, tree, warp: Warp, generator):
    """(accepted path, next token) of a verified tree."""
    if warp.greedy:
        return accept_tree_greedy(tree.tokens.tolist(), tree.parents.tolist(), greedy_ids(vout.logits[0]).tolist())
    return accept_tree_sampling(tree.candidates, lambda row: warp(vout.logits[0, row]), generator)


@torch.inference_mode()
def tree_generate(target, drafter, prompt_ids, *, gamma: int, nodes: int, width: int, max_new_tokens: int,
                  warp: Warp, generator: Optional[torch.Generator] = None,
                  eos_token_ids: Optional[Iterable[int]] = None, on_round=None,
                  lookup: Optional[Tuple[int, int]] = None, row_invariant: bool = False,
                  draft_depth: Optional[int] = None) -> GenerationResult:
    """Speculative decoding of one prompt with draft trees of at most ``nodes`` nodes, depth ≤ ``gamma``,
    ``width`` children per expanded node (`deepspec.decoding.tree.grow_tree`), greedy or sampled as
    ``warp`` says.  ``lookup`` = (max_ngram, min_ngram): each round also grafts the prompt-lookup
    continuation of the context (`deepspec.decoding.lookup`); the drafter's tree then gets the budget the
    chain leaves, so a round still verifies at most ``nodes`` nodes.  ``row_invariant``: verification rows
    round like one-token steps (`deepspec.decoding.row_invariant`).  ``draft_depth``: the drafter's tree stops
    at this depth (each depth costs a sequential drafter one forward); the lookup chain may still reach γ."""
    if gamma < 1 or nodes < 1 or width < 1 or (draft_depth is not None and draft_depth < 1):
        raise ValueError(f"tree decoding needs gamma, nodes, width and draft_depth ≥ 1 "
                         f"(got {gamma}, {nodes}, {width}, {draft_depth})")
    check_tree_target(target)
    loop = DecodeLoop(target, drafter, prompt_ids, warp, generator, eos_token_ids, max_new_tokens, on_round,
                      row_invariant)
    device, marks, state = loop.device, loop.marks, loop.state
    index = None
    if lookup is not None:
        index = NgramIndex(torch.as_tensor(prompt_ids).reshape(-1).tolist() + [loop.anchor], *lookup)
    while loop.stop is None:
        m0 = marks.mark()
        depth = min(gamma, loop.room)            # a round emits at most depth + 1 tokens
        chain = index.continuation(min(depth, nodes - 1)) if index is not None and depth >= 1 else []
        tree = draft_tree(drafter, state, loop.anchor, max(min(depth, draft_depth or depth), 1),
                          nodes - len(chain) if depth >= 1 else 0, width, warp, generator)
        grafted = 0
        if chain:
            tree, grafted = graft(tree, chain)
        toks = tree.tokens.cpu()
        m1 = marks.mark()
        verify_ids = torch.cat([torch.tensor([loop.anchor], dtype=torch.long), toks]).to(device)
        mask, pos = tree_inputs(target, tree.parents, tree.depths, loop.cache_len)
        m2 = marks.mark()
        vout = loop.verify(verify_ids[None], attention_mask=mask, position_ids=pos)
        loop.cache = vout.past_key_values
        m3 = marks.mark()
        path, next_token = _accept(vout, tree, warp, generator)
        rows = torch.tensor([0] + [i + 1 for i in path], dtype=torch.long)
        target.keep_positions(loop.cache, loop.cache_len, rows)
        loop.cache_len += rows.numel()
        node_tokens = toks.tolist()
        accepted = [node_tokens[i] for i in path]
        emitted = loop.emit(accepted + [next_token])
        if index is not None:
            index.extend(accepted + [next_token])
        m4 = marks.mark()
        if loop.stop is None:
            rd = rows.to(device)
            drafter.advance(state, verify_ids.index_select(0, rd), vout.features[0].index_select(0, rd))
        m5 = marks.mark()
        first_grafted = len(node_tokens) - grafted
        loop.record(RoundStats(drafted=len(node_tokens), proposed=len(node_tokens), accepted=len(path),
                               emitted=emitted, draft_tokens=accepted, confidence=None,
                               lookup_accepted=sum(i >= first_grafted for i in path)), (m0, m1, m2, m3, m4, m5))
        loop.anchor = next_token
    return loop.finish()
