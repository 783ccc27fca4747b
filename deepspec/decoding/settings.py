"""What a run decodes with: chains, or draft trees (with prompt lookup), from the eval config.

`tree_setting` reads ``eval.tree_nodes`` / ``eval.tree_width`` / ``eval.lookup_ngram`` /
``eval.lookup_min_ngram`` and refuses, naming the key, what the tree loop cannot run.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

from ..config import ConfigError
from .tree_mask import check_tree_target

__all__ = ["TreeSetting", "tree_setting"]


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
                          "drafter that drafts trees")
    try:
        check_tree_target(target)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return TreeSetting(int(ec.tree_nodes), int(ec.tree_width), lookup)
