"""Draft trees: several candidate continuations of one anchor, verified by the target in one forward.

A chain drafts one token per block position; at position 1 a converged draft on a small target
proposes the target's token about 40% of the time, but the target's token is among the draft's top
four about 57% of the time.  Where a verification forward of 16 tokens costs little more than one of 8
(a memory-bound target: bf16 on a CPU, most GPUs at batch 1), verifying a tree of the likeliest
continuations raises the tokens per round for a smaller rise in the cost of a round (measured in
docs/benchmarks/verification.md).

`grow_tree` builds the tree level by level, as EAGLE-2 does: at each depth the ``width`` nodes with
the highest cumulative draft log-probability are expanded, each into ``width`` children; at the end
the ``nodes`` best nodes of everything seen form the tree.  Greedy trees take each expanded node's
``width`` likeliest children.  Sampled trees (T > 0) *draw* them: ``width`` successive draws without
replacement from the warped draft distribution q of the node (`draw_without_replacement`: one uniform and
an inverse-CDF lookup per draw), scored by the warped log q.  Every draw
stays a candidate of its parent in draw order (`Candidates`), also the ones the final selection leaves
out of the tree: the multi-candidate acceptance rule (`deepspec.decoding.tree_accept`) tests them all.

Growth stops early once no frontier node scores above the ``nodes``-th best node seen: nothing below it
could be chosen, so the tree is the same and the draft pays only for the depths it can use.  A child's
score never exceeds its parent's (log-probabilities are ≤ 0; ties are broken towards the shallower
node), so the selection is always a connected tree rooted at the anchor.

The drafter supplies a `TreeExpansion` (`Drafter.tree_expansion`): ``expand(k, tokens, state) ->
(logits [R, M], state)`` gives the draft's logits (unnormalised) at block position ``k + 1`` for R
parent nodes whose own tokens are ``tokens`` [R] (target ids; at k = 0 the anchor), and the per-row
state their children continue from (None for drafters whose positions do not depend on the drafted
prefix).  Column ``j`` of the logits is target token ``vocab[j]`` (``vocab`` None: ``j`` itself).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import torch

__all__ = ["Candidates", "DraftTree", "draft_tree", "draw_without_replacement", "empty_tree", "grow_tree",
           "select_rows"]

Expand = Callable[[int, torch.Tensor, Any], Tuple[torch.Tensor, Any]]


@dataclass
class Candidates:
    """What a sampled tree's acceptance rule tests, per parent in this order: a prompt-lookup token first
    (``dist_rows`` −1: a deterministic proposal, point mass), then the drafter's draws in draw order.
    ``parents`` / ``nodes`` are tree node indices (−1 = the anchor / not in the tree); ``draft_ids`` the
    column of the drafter's distribution ``dists[dist_rows]`` each draw came from (vocabulary ``vocab``)."""
    tokens: torch.Tensor      # [C] long: target ids
    parents: torch.Tensor     # [C] long
    nodes: torch.Tensor       # [C] long
    dist_rows: torch.Tensor   # [C] long: the row of `dists` (−1 = prompt lookup)
    draft_ids: torch.Tensor   # [C] long: the column of that row
    dists: List[torch.Tensor]  # per depth [R_k, M]: the warped q every expanded node drew from
    vocab: Optional[torch.Tensor] = None

    def dist(self, row: int) -> torch.Tensor:
        """Row ``row`` of the drafter's distributions, over its M columns."""
        for d in self.dists:
            if row < d.shape[0]:
                return d[row]
            row -= d.shape[0]
        raise IndexError("Candidates.dist: row out of range")


@dataclass
class DraftTree:
    """Nodes with a parent always before its children (`grow_tree` gives depth order; a grafted prompt-lookup
    chain comes after it, `deepspec.decoding.lookup`); the anchor is not a node."""
    tokens: torch.Tensor     # [n] long: target token ids
    parents: torch.Tensor    # [n] long: index of the parent node, −1 = the anchor
    depths: torch.Tensor     # [n] long: block position 1..γ
    scores: torch.Tensor     # [n] float32: the path's cumulative draft log-probability
    candidates: Optional[Candidates] = None   # sampled trees: every draw, in the tree or not

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def empty_tree(sampled: bool = False) -> DraftTree:
    e = torch.zeros(0, dtype=torch.long)
    cands = Candidates(e, e, e, e, e, []) if sampled else None
    return DraftTree(tokens=e, parents=e, depths=e, scores=torch.zeros(0), candidates=cands)


def select_rows(state: Any, rows: torch.Tensor) -> Any:
    """Rows ``rows`` of a per-row state (a tensor, a tuple/list of them, or None)."""
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        return state.index_select(0, rows.to(state.device))
    if isinstance(state, (tuple, list)):
        return type(state)(select_rows(s, rows) for s in state)
    raise TypeError(f"select_rows: cannot index a {type(state).__name__} state")


def _top_children(logits: torch.Tensor, width: int):
    """Greedy: each row's ``width`` likeliest columns (rows [C], columns [C], log-probs [C], None)."""
    w = min(width, logits.shape[-1])
    top, top_j = logits.topk(w, dim=-1)                          # [R, w], on the drafter's device
    top_lp = (top - logits.logsumexp(dim=-1, keepdim=True)).cpu()   # their log-probabilities
    rows = torch.arange(top_j.shape[0]).repeat_interleave(w)
    return rows, top_j.cpu().reshape(-1), top_lp.reshape(-1), None


def draw_without_replacement(q: torch.Tensor, w: int, generator=None) -> List[List[int]]:
    """Per row of ``q`` [R, M]: up to ``w`` successive draws without replacement, in draw order (fewer where
    the row has fewer tokens of positive mass).  Each draw is the inverse CDF of a uniform over the mass the
    earlier draws left: u · (1 − Σ q(earlier)), mapped through the row's cumulative sum with the earlier
    draws' intervals skipped — exactly q renormalised without them, at one uniform and O(log M) per draw."""
    qd = q.detach().double().cpu()
    cdf, qn = qd.cumsum(-1).numpy(), qd.numpy()
    u = torch.rand(q.shape[0], w, generator=generator, dtype=torch.float64,
                   device=generator.device if generator is not None else "cpu").cpu().numpy()
    out = []
    for r in range(q.shape[0]):
        drawn: List[int] = []
        for j in range(w):
            rest = cdf[r, -1] - sum(qn[r, d] for d in drawn)
            if rest <= 1e-12:
                break
            x = u[r, j] * rest
            for d in sorted(drawn):                    # skip the earlier draws' intervals, left to right
                if x >= cdf[r, d] - qn[r, d]:
                    x += qn[r, d]
            t = int(np.searchsorted(cdf[r], x, side="right"))
            if t >= q.shape[1] or qn[r, t] <= 0 or t in drawn:     # rounding at the very top of the CDF
                t = next(i for i in np.flatnonzero(qn[r] > 0)[::-1] if i not in drawn)
            drawn.append(t)
        out.append(drawn)
    return out


def _drawn_children(logits: torch.Tensor, width: int, warp, generator):
    """Sampled: ``width`` draws without replacement per row from q = warp(logits), in draw order (rows,
    columns, log q, q [R, M]).  Rows whose q has fewer than ``width`` tokens give fewer draws."""
    q = warp(logits).float()
    draws = draw_without_replacement(q, min(width, q.shape[-1]), generator)
    rows = torch.tensor([r for r, ds in enumerate(draws) for _ in ds], dtype=torch.long)
    cols = torch.tensor([c for ds in draws for c in ds], dtype=torch.long)
    lq = q.cpu()[rows, cols].log()
    return rows, cols, lq, q


class _Pool:
    """Every child seen while growing: target ids, parent pool index, depth, score, and for sampled trees
    the distribution row and column each was drawn from."""

    def __init__(self):
        self.toks, self.pars, self.deps, self.scores, self.rows, self.cols = [], [], [], [], [], []
        self.dists: List[torch.Tensor] = []
        self.count = self.dist_rows = 0

    def add(self, tok, par, depth, score, rows, cols, dist) -> None:
        self.toks.append(tok)
        self.pars.append(par)
        self.deps.append(torch.full_like(tok, depth))
        self.scores.append(score)
        if dist is not None:
            self.rows.append(self.dist_rows + rows)
            self.cols.append(cols)
            self.dists.append(dist)
            self.dist_rows += dist.shape[0]
        self.count += tok.numel()


@torch.no_grad()
def grow_tree(expand: Expand, anchor: int, root_state: Any, gamma: int, nodes: int, width: int,
              vocab: Optional[torch.Tensor] = None, warp=None, generator: Optional[torch.Generator] = None
              ) -> DraftTree:
    """The ``nodes`` best draft nodes of depth ≤ ``gamma`` below ``anchor`` (see the module); ``warp``
    (not greedy) and ``generator``: a sampled tree."""
    if gamma < 1 or nodes < 1 or width < 1:
        raise ValueError(f"grow_tree: gamma, nodes and width must be ≥ 1 (got {gamma}, {nodes}, {width})")
    sampled = warp is not None and not getattr(warp, "greedy", False)
    pool = _Pool()
    f_tok, f_score, f_idx = torch.tensor([int(anchor)], dtype=torch.long), torch.zeros(1), torch.tensor([-1])
    f_state = root_state
    vocab = None if vocab is None else vocab.cpu()
    for k in range(gamma):
        logits, new_state = expand(k, f_tok, f_state)
        rows, cols, lp, dist = (_drawn_children(logits, width, warp, generator) if sampled
                                else _top_children(logits.float(), width))
        child_score = f_score[rows] + lp
        child_tok = cols if vocab is None else vocab[cols]
        start = pool.count
        pool.add(child_tok, f_idx[rows], k + 1, child_score, rows, cols, dist)
        if child_tok.numel() == 0:
            break
        keep = child_score.topk(min(width, child_score.numel())).indices
        f_tok, f_score, f_idx = child_tok[keep], child_score[keep], start + keep
        if pool.count >= nodes and k + 1 < gamma:
            # every deeper node scores at most its frontier ancestor and is deeper than every node seen, so
            # once no frontier node beats the nodes-th best score seen, no deeper node can be chosen: stop
            kth = torch.cat(pool.scores).topk(nodes).values[-1]
            if bool(f_score.max() <= kth):
                break
        f_state = select_rows(new_state, rows[keep])
    return _select(pool, nodes, vocab if sampled else None, sampled)


def _select(pool: _Pool, nodes: int, vocab, sampled: bool) -> DraftTree:
    """The best ``nodes`` of the pool by score, ties to the shallower node: a parent (score ≥ its child's,
    smaller depth) always ranks before its child, so the chosen nodes form a tree rooted at the anchor."""
    if not pool.toks or pool.count == 0:
        return empty_tree(sampled)
    tok, par, dep, sc = (torch.cat(x) for x in (pool.toks, pool.pars, pool.deps, pool.scores))
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
    cands = None
    if sampled:
        # every draw whose parent is the anchor or a chosen node stays a candidate there, in pool (= draw) order
        c_par = torch.where(par >= 0, new_index[par.clamp(min=0)], par)
        live = (par < 0) | (c_par >= 0)
        cands = Candidates(tokens=tok[live], parents=c_par[live], nodes=new_index[live],
                           dist_rows=torch.cat(pool.rows)[live], draft_ids=torch.cat(pool.cols)[live],
                           dists=pool.dists, vocab=vocab)
    return DraftTree(tokens=tok[keep_t], parents=parents, depths=dep[keep_t], scores=sc[keep_t], candidates=cands)


def draft_tree(drafter, state, anchor: int, gamma: int, nodes: int, width: int, warp=None,
               generator: Optional[torch.Generator] = None) -> DraftTree:
    """The drafter's tree below ``anchor``: `grow_tree` over its `TreeExpansion` (None: an empty tree)."""
    sampled = warp is not None and not getattr(warp, "greedy", False)
    if nodes < 1:
        return empty_tree(sampled)
    ex = drafter.tree_expansion(state, anchor, gamma)
    if ex is None:
        return empty_tree(sampled)
    return grow_tree(ex.expand, anchor, ex.root_state, gamma, nodes, width, vocab=ex.vocab, warp=warp,
                     generator=generator)
