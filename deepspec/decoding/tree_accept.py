"""The acceptance rules of draft trees: greedy (walk down while a child is the argmax) and lossless
multi-candidate speculative sampling at any temperature.

**Sampled trees** (SpecInfer's recursive rejection sampling, with draws without replacement).  At a
node whose target distribution is p (warped exactly as plain sampling warps it), the candidates
c_1..c_m of that node are tested in order (`deepspec.decoding.tree.Candidates`: a prompt-lookup token
first, then the drafter's draws in draw order).  Each c_i comes with the proposal law q_i it was drawn
from *given everything drawn before it*:

* a prompt-lookup token t is a deterministic proposal: q_i = δ_t (point mass);
* the j-th draft draw at the node was drawn from the node's warped draft distribution q *without
  replacement*: given the earlier draws d_1..d_{j−1} it is distributed as
  q_i(x) = q(x) / (1 − Σ_{l<j} q(d_l)) for x ∉ {d_1..d_{j−1}}, and q_i(d_l) = 0.

The rule: r_1 = p; for i = 1..m accept c_i with probability min(1, r_i(c_i) / q_i(c_i)), else
r_{i+1} = norm(max(r_i − q_i, 0)) and go on; when every candidate is rejected, sample from r_{m+1}.

Why the emitted token is distributed as p.  Let Out_i be the token the rule emits started at step i
with residual r.  Given the history (every earlier candidate, the earlier decisions) c_i ~ q_i, so

    P(Out_i = y) = P(c_i = y, accepted) + P(rejected) · P(Out_{i+1} = y | rejected)
                 = min(q_i(y), r(y)) + β · r'(y),      β = 1 − Σ_x min(q_i(x), r(x)) = Σ_x max(r(x) − q_i(x), 0),

where r' = max(r − q_i, 0) / β.  By induction (the base: Out_{m+1} samples r_{m+1} itself)
Out_{i+1} ~ r' whatever the history, because the statement holds for any later q_{i+1} as long as
c_{i+1} ~ q_{i+1} given that history — the rejected c_i included.  Hence
P(Out_i = y) = min(q_i(y), r(y)) + max(r(y) − q_i(y), 0) = r(y), and Out_1 ~ p.  The renormalised
q_i is what makes "c_i ~ q_i" true: the j-th draw without replacement never repeats an earlier draw, so
testing it against q itself would accept it with the wrong probability (the tests plant exactly that
bug, and the skipped residual update, and see the χ² test fail).  A lookup token tested first leaves
r(t) = 0, so a draft draw of the same token is then always rejected, which the rule allows.

Once c_i is accepted the walk moves to c_i's node, whose target row gives the next p, and tests c_i's
candidates.  A candidate the tree growth left out of the verified tree (`grow_tree` keeps the ``nodes``
best draws) has no target row: accepting it ends the round with it as the next token, which is exactly
a token sampled from p.  Which candidates exist and which of them the tree keeps are functions of the
draft side only (scores, depths, draws), fixed before the target's rows are read, and the candidates of
a node are tested whether or not the tree kept them, so the order and laws above hold.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch

from .acceptance import residual_distribution
from .tree import Candidates
from .warp import sample_token

__all__ = ["accept_tree_greedy", "accept_tree_sampling", "proposal_law"]


def accept_tree_greedy(tokens: Sequence[int], parents: Sequence[int], best: Sequence[int]) -> Tuple[List[int], int]:
    """(accepted node indices root-down, next token): ``best[0]`` is the target's argmax after the
    anchor, ``best[i + 1]`` after node ``i``; a node is accepted when its parent was (or it hangs from
    the anchor) and its token is the target's argmax there."""
    if len(best) < len(tokens) + 1:
        raise ValueError(f"need {len(tokens) + 1} target argmax tokens for a tree of {len(tokens)} nodes, got {len(best)}")
    children: Dict[int, List[int]] = {}
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


def _full(cands: Candidates, row: int, vocab_size: int, like: torch.Tensor) -> torch.Tensor:
    """The drafter's distribution ``row`` over the target's vocabulary (0 outside a draft vocabulary)."""
    q = cands.dist(row).to(device=like.device, dtype=torch.float32)
    if cands.vocab is None:
        return q
    full = like.new_zeros(vocab_size)
    full[cands.vocab.to(like.device)] = q
    return full


def proposal_law(q: torch.Tensor, drawn: Sequence[int]) -> torch.Tensor:
    """q_i of the next draw without replacement: ``q`` with the earlier draws ``drawn`` removed, renormalised."""
    if not drawn:
        return q
    rest = q.clone()
    rest[torch.tensor(list(drawn), dtype=torch.long, device=q.device)] = 0.0
    return rest / rest.sum().clamp_min(1e-30)


def accept_tree_sampling(cands: Candidates, target_probs: Callable[[int], torch.Tensor],
                         generator=None) -> Tuple[List[int], int]:
    """(accepted node indices root-down, next token) by the multi-candidate rule of the module docstring.
    ``target_probs(row)``: the warped target distribution [V] of forward row ``row`` (0 = the anchor,
    i + 1 = node i); rows are asked for only along the accepted path."""
    by_parent: Dict[int, List[int]] = {}
    for ci, par in enumerate(cands.parents.tolist()):
        by_parent.setdefault(par, []).append(ci)
    toks, nodes, rows = cands.tokens.tolist(), cands.nodes.tolist(), cands.dist_rows.tolist()
    path: List[int] = []
    node = -1
    while True:
        r = target_probs(node + 1).float()
        q, q_row, drawn = None, None, []
        accepted = None
        for ci in by_parent.get(node, ()):
            tok = toks[ci]
            if rows[ci] < 0:                       # prompt lookup: q_i = δ_tok
                qi = torch.zeros_like(r)
                qi[tok] = 1.0
            else:
                if q is None:
                    q, q_row = _full(cands, rows[ci], r.shape[-1], r), rows[ci]
                elif rows[ci] != q_row:
                    raise ValueError("accept_tree_sampling: a node's draws come from one distribution")
                qi = proposal_law(q, drawn)
                drawn.append(tok)
            u = float(torch.rand((), generator=generator, device=r.device))
            if u * float(qi[tok]) < float(r[tok]):   # accept with probability min(1, r/q_i)
                accepted = ci
                break
            r = residual_distribution(r, qi)
        if accepted is None:
            return path, sample_token(r, generator)
        if nodes[accepted] < 0:                    # a draw the tree left out: it is the next token
            return path, toks[accepted]
        node = nodes[accepted]
        path.append(node)
