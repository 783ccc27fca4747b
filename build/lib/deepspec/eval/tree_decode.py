"""Batch-size-1 lossless greedy decoding with draft trees (one target forward per round)::

    round     tree  = drafter.propose_tree(state, anchor, γ, nodes, width)      the likeliest continuations
              (prompt lookup: a chain copied from the context grafted on, within the same node budget)
              target.decode([anchor, tree nodes], cache, tree mask, depths)    ONE forward
              walk down the tree while a child carries the target's argmax     -> the accepted path
              keep the cache rows of anchor + path, drop the other nodes
              drafter.advance(state, [anchor, path], their features)
              anchor = the target's argmax after the path (correction or bonus)

Each row of the forward sees the cache plus its own ancestors at position ``cache length + depth``,
so the argmax along the accepted path is the argmax of the plain decode: the output is the target's
greedy output (lossless).  Sampling (T > 0) would need a multi-candidate acceptance rule; greedy only.
The rounds are `RoundStats` as in the chain loop: ``proposed`` = nodes verified, ``accepted`` = the
accepted path's length, ``draft_tokens`` = that path's tokens.
"""
from __future__ import annotations

from typing import Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..config import ConfigError
from ..drafts.lookup import NgramIndex, graft
from ..targets.tree import check_tree_target, tree_inputs
from .sampling import Warp, greedy_ids
from .speculative import DecodeLoop, GenerationResult, RoundStats

__all__ = ["TreeSetting", "accept_tree_greedy", "tree_generate", "tree_setting"]


def accept_tree_greedy(tokens: Sequence[int], parents: Sequence[int], best: Sequence[int]) -> Tuple[List[int], int]:
    """(accepted node indices root-down, next token): ``best[0]`` is the target's argmax after the
    anchor, ``best[i + 1]`` after node ``i``; a node is accepted when its parent was (or it hangs from
    the anchor) and its token is the target's argmax there."""
    if len(best) < len(tokens) + 1:
        raise ValueError(f"need {len(tokens) + 1} target argmax tokens for a tree of {len(tokens)} nodes, got {len(best)}")
    children = {}
    for i, p in enumerate(parents):
        children.setdefault(int(p), []).append(i)
    path, cur = [], -1
    while True:
        want = int(best[cur + 1])
        nxt = next((c for c in children.get(cur, ()) if int(tokens[c]) == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        cur = nxt


@torch.inference_mode()
def tree_generate(target, drafter, prompt_ids, *, gamma: int, nodes: int, width: int, max_new_tokens: int,
                  warp: Warp, generator: Optional[torch.Generator] = None,
                  eos_token_ids: Optional[Iterable[int]] = None, on_round=None,
                  lookup: Optional[Tuple[int, int]] = None) -> GenerationResult:
    """Greedy speculative decoding of one prompt with draft trees of at most ``nodes`` nodes, depth
    ≤ ``gamma``, ``width`` children per expanded node (`deepspec.drafts.tree.grow_tree`).  ``lookup`` =
    (max_ngram, min_ngram): each round also grafts the prompt-lookup continuation of the context
    (`deepspec.drafts.lookup`); the drafter's tree then gets the budget the chain leaves, so a round
    still verifies at most ``nodes`` nodes."""
    if not warp.greedy:
        raise ValueError("tree verification (eval.tree_nodes) is lossless for greedy decoding only: "
                         "set eval.temperature=0, or verify chains")
    if gamma < 1 or nodes < 1 or width < 1:
        raise ValueError(f"tree decoding needs gamma, nodes and width ≥ 1 (got {gamma}, {nodes}, {width})")
    check_tree_target(target)
    loop = DecodeLoop(target, drafter, prompt_ids, warp, generator, eos_token_ids, max_new_tokens, on_round)
    device, marks, state = loop.device, loop.marks, loop.state
    empty = torch.zeros(0, dtype=torch.long)
    index = None
    if lookup is not None:
        index = NgramIndex(torch.as_tensor(prompt_ids).reshape(-1).tolist() + [loop.anchor], *lookup)
    while loop.stop is None:
        m0 = marks.mark()
        depth = min(gamma, loop.room)            # a round emits at most depth + 1 tokens
        chain = index.continuation(min(depth, nodes - 1)) if index is not None else []
        tree = drafter.propose_tree(state, loop.anchor, depth, nodes - len(chain), width) if depth >= 1 else None
        grafted = 0
        if tree is not None and chain:
            tree, grafted = graft(tree, chain)
        toks, parents, depths = (tree.tokens.cpu(), tree.parents, tree.depths) if tree else (empty, empty, empty)
        m1 = marks.mark()
        verify_ids = torch.cat([torch.tensor([loop.anchor], dtype=torch.long), toks]).to(device)
        mask, pos = tree_inputs(target, parents, depths, loop.cache_len)
        m2 = marks.mark()
        vout = target.decode(verify_ids[None], loop.cache, attention_mask=mask, position_ids=pos)
        loop.cache = vout.past_key_values
        m3 = marks.mark()
        node_tokens = toks.tolist()
        path, next_token = accept_tree_greedy(node_tokens, parents.tolist(), greedy_ids(vout.logits[0]).tolist())
        rows = torch.tensor([0] + [i + 1 for i in path], dtype=torch.long)
        target.keep_positions(loop.cache, loop.cache_len, rows)
        loop.cache_len += rows.numel()
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


class TreeSetting(NamedTuple):
    nodes: int
    width: int
    lookup: Optional[Tuple[int, int]] = None     # (max_ngram, min_ngram) of prompt lookup, None = off

    def describe(self) -> str:
        lk = f", lookup={self.lookup[0]}..{self.lookup[1]}" if self.lookup else ""
        return f"tree(nodes={self.nodes}, width={self.width}{lk})"


def tree_setting(cfg, target, drafter, policy, warp) -> Optional[TreeSetting]:
    """The tree setting when ``eval.tree_nodes`` asks for tree verification, after checking it can run."""
    ec = cfg.eval
    lookup = None
    if int(ec.lookup_ngram) > 0:
        if ec.tree_nodes is None:
            raise ConfigError(f"eval.lookup_ngram={ec.lookup_ngram}: prompt lookup grafts its chain onto draft "
                              "trees; set eval.tree_nodes too")
        if not 1 <= int(ec.lookup_min_ngram) <= int(ec.lookup_ngram):
            raise ConfigError(f"eval.lookup_min_ngram={ec.lookup_min_ngram}: must be between 1 and "
                              f"eval.lookup_ngram={ec.lookup_ngram}")
        lookup = (int(ec.lookup_ngram), int(ec.lookup_min_ngram))
    elif int(ec.lookup_ngram) < 0:
        raise ConfigError(f"eval.lookup_ngram={ec.lookup_ngram}: 0 (off) or the longest n-gram to match")
    if ec.tree_nodes is None:
        return None
    if int(ec.tree_nodes) < 1 or int(ec.tree_width) < 1:
        raise ConfigError(f"eval.tree_nodes={ec.tree_nodes}, eval.tree_width={ec.tree_width}: both must be ≥ 1")
    if lookup and int(ec.tree_nodes) < 2:
        raise ConfigError(f"eval.tree_nodes={ec.tree_nodes}: prompt lookup needs at least 2 nodes (one for the "
                          "drafter, the rest for the lookup chain)")
    if not warp.greedy:
        raise ConfigError("eval.tree_nodes: tree verification is lossless for greedy decoding only "
                          f"(eval.temperature={ec.temperature}; set it to 0 or leave eval.tree_nodes unset)")
    if getattr(policy, "name", None) != "fixed":
        raise ConfigError(f"eval.tree_nodes: the tree replaces the verification-length policy; "
                          f"schedule.policy={cfg.schedule.policy} / eval.confidence_threshold cannot be combined with it")
    if not getattr(drafter, "drafts_trees", False):
        name = getattr(drafter, "algorithm", type(drafter).__name__)
        raise ConfigError(f"eval.tree_nodes: the {name} drafter drafts chains only; tree verification needs a "
                          "parallel drafter (dspark, dflash)")
    try:
        check_tree_target(target)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return TreeSetting(int(ec.tree_nodes), int(ec.tree_width), lookup)
