"""What a run decodes with: chains, or draft trees (with prompt lookup), from the eval config.

``eval.decoding``:

* ``auto`` (default): what the user set, else the loaded drafter's documented best lossless setting for
  the sampling mode (`Drafter.decoding_defaults`: eval keys per ``greedy`` / ``sampled``, chosen from
  measurements on the tuning prompts; none = chains).  Any tree key the user sets (``eval.tree_nodes``,
  ``eval.tree_width``, ``eval.lookup_ngram``) is kept and the drafter's default fills the others (without
  a tree size from either, only a prompt lookup is refused: it needs a tree); a verification-length policy (``schedule.policy``) alone means chains; a
  target or drafter that cannot verify trees falls back to chains.
* ``chain``: verify γ drafts per round (``eval.tree_nodes`` and a prompt lookup are refused).
* ``tree``: draft trees with the tree keys, the drafter's default filling the unset ones.

`tree_setting` resolves this and refuses, naming the key, what the tree loop cannot run.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple

from ..config import ConfigError
from .tree_mask import check_tree_target

log = logging.getLogger(__name__)

__all__ = ["MODES", "TREE_KEYS", "TreeSetting", "drafter_default", "tree_setting"]

MODES = ("auto", "chain", "tree")
TREE_KEYS = ("tree_nodes", "tree_width", "tree_depth", "lookup_ngram", "lookup_min_ngram")
DEFAULT_WIDTH = 4


class TreeSetting(NamedTuple):
    nodes: int
    width: int
    lookup: Optional[Tuple[int, int]] = None     # (max_ngram, min_ngram) of prompt lookup, None = off
    source: str = "eval config"                  # or "drafter default"
    depth: Optional[int] = None                  # the deepest draft node, None = γ

    def describe(self) -> str:
        lk = f", lookup={self.lookup[0]}..{self.lookup[1]}" if self.lookup else ""
        dp = f", depth={self.depth}" if self.depth else ""
        return f"tree(nodes={self.nodes}, width={self.width}{dp}{lk})"


def drafter_default(drafter, greedy: bool) -> Dict[str, Any]:
    """The drafter's documented default eval keys for greedy / sampled decoding ({} = chains)."""
    table: Mapping[str, Mapping[str, Any]] = getattr(drafter, "decoding_defaults", None) or {}
    d = dict(table.get("greedy" if greedy else "sampled", {}) or {})
    bad = sorted(set(d) - set(TREE_KEYS))
    if bad:
        raise ValueError(f"{type(drafter).__name__}.decoding_defaults: unknown eval key(s) {bad}")
    return d


def _user_keys(ec) -> Dict[str, Any]:
    """The tree keys the user set (None = unset)."""
    return {k: getattr(ec, k) for k in TREE_KEYS if getattr(ec, k, None) is not None}


def _trees_possible(target, drafter) -> bool:
    try:
        check_tree_target(target)
    except ValueError:
        return False
    return bool(getattr(drafter, "drafts_trees", False))


def _resolve(cfg, target, drafter, policy, warp) -> Tuple[Optional[Dict[str, Any]], str]:
    """(the tree keys to run, or None for chains; where they came from)."""
    ec = cfg.eval
    mode = getattr(ec, "decoding", "auto")
    if mode not in MODES:
        raise ConfigError(f"eval.decoding={mode!r}: choose from {', '.join(MODES)}")
    user = _user_keys(ec)
    asks = {k: v for k, v in user.items() if k == "tree_nodes" or (k == "lookup_ngram" and int(v) > 0)}
    if mode == "chain":
        if asks:
            k = next(iter(asks))
            raise ConfigError(f"eval.{k}={user[k]}: eval.decoding=chain verifies chains; set eval.decoding=tree "
                              "(or auto) for draft trees")
        return None, "eval config"
    policy_set = getattr(policy, "name", "fixed") != "fixed"
    default = drafter_default(drafter, warp.greedy)
    if mode == "auto" and not asks:          # nothing asks for a tree: the drafter's default, if it has one
        if policy_set or not default:
            return None, "eval config" if policy_set else "drafter default"
        if not _trees_possible(target, drafter):
            log.info("eval: %s cannot verify draft trees here; decoding chains", type(drafter).__name__)
            return None, "drafter default"
        return {**default, **user}, "eval config" if user else "drafter default"
    merged = {**default, **user}
    if "tree_nodes" not in merged:
        if mode == "tree":
            raise ConfigError("eval.decoding=tree: set eval.tree_nodes (this drafter has no default tree)")
        raise ConfigError(f"eval.lookup_ngram={user['lookup_ngram']}: prompt lookup grafts its chain onto draft "
                          "trees; set eval.tree_nodes too")
    return merged, "eval config"


def tree_setting(cfg, target, drafter, policy, warp) -> Optional[TreeSetting]:
    """The tree setting the run uses (None = chains), after checking that it can run."""
    keys, source = _resolve(cfg, target, drafter, policy, warp)
    if keys is None:
        return None
    def key(name, unset):
        v = keys.get(name)
        return int(unset if v is None else v)
    nodes, width = key("tree_nodes", 0), key("tree_width", DEFAULT_WIDTH)
    ngram, min_ngram = key("lookup_ngram", 0), key("lookup_min_ngram", 1)
    if nodes < 1 or width < 1:
        raise ConfigError(f"eval.tree_nodes={nodes}, eval.tree_width={width}: both must be ≥ 1")
    depth = key("tree_depth", 0)
    if depth < 0:
        raise ConfigError(f"eval.tree_depth={depth}: the deepest draft node, ≥ 1 (0 = γ)")
    if ngram < 0:
        raise ConfigError(f"eval.lookup_ngram={ngram}: 0 (off) or the longest n-gram to match")
    lookup = None
    if ngram > 0:
        if not 1 <= min_ngram <= ngram:
            raise ConfigError(f"eval.lookup_min_ngram={min_ngram}: must be between 1 and eval.lookup_ngram={ngram}")
        if nodes < 2:
            raise ConfigError(f"eval.tree_nodes={nodes}: prompt lookup needs at least 2 nodes (one for the "
                              "drafter, the rest for the lookup chain)")
        lookup = (ngram, min_ngram)
    if getattr(policy, "name", None) != "fixed":
        raise ConfigError(f"eval.tree_nodes: the tree replaces the verification-length policy; "
                          f"schedule.policy={cfg.schedule.policy} cannot be combined with it")
    if not getattr(drafter, "drafts_trees", False):
        name = getattr(drafter, "algorithm", type(drafter).__name__)
        raise ConfigError(f"eval.tree_nodes: the {name} drafter drafts chains only; tree verification needs a "
                          "drafter that drafts trees")
    try:
        check_tree_target(target)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return TreeSetting(nodes, width, lookup, source, depth or None)
