"""A test drafter's draft trees that know the target's greedy output, grown by the real `grow_tree`."""
from __future__ import annotations

import torch

from deepspec.drafts.base import TreeExpansion


class OracleTreeExpansion:
    """Mixin for test drafters with ``prompt_len``, ``truth`` (the target's greedy output), ``vocab`` and
    ``cut``: below every node on the true path the expansion puts a wrong token first and the right one
    second (so accepted nodes are never contiguous rows); other rows are flat; the true path ends at depth
    ``cut``."""

    def tree_expansion(self, state, anchor, gamma):
        m = state.length - self.prompt_len          # the anchor is output token m
        assert anchor == self.truth[m]

        def expand(k, tokens, on):
            on = on & (tokens == self.truth[m + k])             # this row is the true path's depth-k node
            logits = torch.full((tokens.shape[0], self.vocab), -20.0)
            if k < self.cut:
                right = self.truth[m + k + 1]
                logits[on, (right + 1) % self.vocab] = 0.0
                logits[on, right] = -0.1
            return logits, on
        return TreeExpansion(expand, torch.ones(1, dtype=torch.bool))
