"""Draft trees: several candidate continuations of one anchor, verified by the target in one forward.

A chain drafts one token per block position; at position 1 a converged draft on a small target
proposes the target's token about 40% of the time, but the target's token is among the draft's top
four about 57% of the time.  Where a verification forward of 16 tokens costs little more than one of 8
(a memory-bound target: bf16 on a CPU, most GPUs at batch 1), verifying a tree of the likeliest
continuations raises the tokens per round for a smaller rise in the cost of a round (measured in
docs/benchmarks/verification.md).

`grow_tree` builds the tree level by level, as EAGLE-2 does: at each depth the ``width`` nodes with
the highest cumulative draft log-probability are expanded, each into its ``width`` likeliest
children; at the end the ``nodes`` best nodes of everything seen form the tree.  Growth stops early
once no frontier node scores above the ``nodes``-th best node seen: nothing below it could be chosen,
so the tree is the same and the draft pays only for the depths it can use.  A child's score never
exceeds its parent's (log-probabilities are ≤ 0; ties are broken towards the shallower node), so the
selection is always a connected tree rooted at the anchor.

The drafter supplies one function, ``expand(k, tokens, state) -> (logits [R, M], state)``: the
draft's logits (unnormalised) at block position ``k + 1`` for R parent nodes whose own tokens are
``tokens`` [R] (target ids; at k = 0 the anchor), and the per-row state their children continue from
(None for drafters whose positions do not depend on the drafted prefix).  Column ``j`` of the
logits is target token ``vocab[j]`` (``vocab`` None: ``j`` itself).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch

__all__ = ["DraftTree", "grow_tree", "select_rows"]

Expand = Callable[[int, torch.Tensor, Any], Tuple[torch.Tensor, Any]]


@dataclass
class DraftTree:
    """Nodes with a parent always before its children (`grow_tree` gives depth order; a grafted prompt-lookup
    chain comes after it, `deepspec.drafts.lookup`); the anchor is not a node."""
    tokens: torch.Tensor     # [n] long: target token ids
    parents: torch.Tensor    # [n] long: index of the parent node, −1 = the anchor
    depths: torch.Tensor     # [n] long: block position 1..γ
    scores: torch.Tensor     # [n] float32: the path's cumulative draft log-probability

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def select_rows(state: Any, rows: torch.Tensor) -> Any:
    """Rows ``rows`` of a per-row state (a tensor, a tuple/list of them, or None)."""
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        return state.index_select(0, rows.to(state.device))
    if isinstance(state, (tuple, list)):
        return type(state)(select_rows(s, rows) for s in state)
    raise TypeError(f"select_rows: cannot index a {type(state).__name__} state")


@torch.no_grad()
def grow_tree(expand: Expand, anchor: int, root_state: Any, gamma: int, nodes: int, width: int,
              vocab: Optional[torch.Tensor] = None) -> DraftTree:
    """The ``nodes`` likeliest draft nodes of depth ≤ ``gamma`` below ``anchor`` (see the module)."""
    if gamma < 1 or nodes < 1 or width < 1:
        raise ValueError(f"grow_tree: gamma, nodes and width must be ≥ 1 (got {gamma}, {nodes}, {width})")
    toks, pars, deps, scores = [], [], [], []
    f_tok = torch.tensor([int(anchor)], dtype=torch.long)
    f_score = torch.zeros(1)
    f_idx = torch.tensor([-1], dtype=torch.long)
    f_state = root_state
    count = 0
    vocab = None if vocab is None else vocab.cpu()
    for k in range(gamma):
        logits, new_state = expand(k, f_tok, f_state)
        logits = logits.float()
        w = min(width, logits.shape[-1])
        top, top_j = logits.topk(w, dim=-1)                          # [R, w], on the drafter's device
        top_lp = (top - logits.logsumexp(dim=-1, keepdim=True)).cpu()   # their log-probabilities
        top_j = top_j.cpu()
        child_score = (f_score[:, None] + top_lp).reshape(-1)
        child_tok = top_j.reshape(-1) if vocab is None else vocab[top_j.reshape(-1)]
        rows = torch.arange(top_j.shape[0]).repeat_interleave(w)    # the parent row of each child
        toks.append(child_tok)
        pars.append(f_idx[rows])
        deps.append(torch.full_like(child_tok, k + 1))
        scores.append(child_score)
        keep = child_score.topk(min(width, child_score.numel())).indices
        f_tok, f_score, f_idx = child_tok[keep], child_score[keep], count + keep
        count += child_tok.numel()
        if count >= nodes and k + 1 < gamma:
            # every deeper node scores at most its frontier ancestor and is deeper than every node seen, so
            # once no frontier node beats the nodes-th best score seen, no deeper node can be chosen: stop
            kth = torch.cat(scores).topk(nodes).values[-1]
            if bool(f_score.max() <= kth):
                break
        f_state = select_rows(new_state, rows[keep])
    tok, par, dep, sc = torch.cat(toks), torch.cat(pars), torch.cat(deps), torch.cat(scores)
    # best `nodes` by score, ties to the shallower node: a parent (score ≥ its child's, smaller depth) always
    # ranks before its child, so the chosen nodes form a tree rooted at the anchor
    by_depth = torch.argsort(dep, stable=True)
    order = by_depth[torch.argsort(-sc[by_depth], stable=True)]
    keep_t = order[:nodes]
    keep_t = keep_t[torch.argsort(dep[keep_t] * (tok.numel() + 1) + keep_t)]   # depth order, pool order within
    new_index = torch.full((tok.numel(),), -1, dtype=torch.long)
    new_index[keep_t] = torch.arange(keep_t.numel())
    par_k = par[keep_t]
    parents = torch.where(par_k >= 0, new_index[par_k.clamp(min=0)], par_k)
    if bool((parents[par_k >= 0] < 0).any()):
        raise RuntimeError("grow_tree: a chosen node's parent was not chosen (non-finite draft scores?)")
    return DraftTree(tokens=tok[keep_t], parents=parents, depths=dep[keep_t], scores=sc[keep_t])
