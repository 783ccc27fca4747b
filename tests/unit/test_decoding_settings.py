"""`eval.decoding`: auto takes the loaded drafter's documented default, chain and tree what they say; bad
combinations are refused with one line naming the key."""
import pytest

from conftest import make_tiny_target
from deepspec.config import ConfigError, load_config
from deepspec.config.draft import DraftConfig
from deepspec.decoding.policy import FixedLengthPolicy
from deepspec.decoding.settings import TreeSetting, drafter_default, tree_setting
from deepspec.decoding.warp import make_warp
from deepspec.drafts import build_drafter
from deepspec.drafts.model_free import NoDraft, TargetAsDraft

GREEDY, SAMPLED = make_warp(0.0), make_warp(1.0)


class _Named:
    name = "threshold0.5"


@pytest.fixture(scope="module")
def llama():
    return make_tiny_target("llama", num_layers=2)


def _setting(tmp_path, target, drafter, *ov, warp=GREEDY, policy=None):
    cfg = load_config([f"run_dir={tmp_path}", *ov])
    return tree_setting(cfg, target, drafter, policy or FixedLengthPolicy(), warp)


@pytest.mark.parametrize("algo", ["dspark", "dflash", "eagle3"])
def test_auto_takes_the_drafters_documented_default(tmp_path, llama, algo):
    d = build_drafter(llama, DraftConfig(algorithm=algo, gamma=3, num_layers=1)).eval()
    for warp in (GREEDY, SAMPLED):
        want = drafter_default(d, warp.greedy)
        got = _setting(tmp_path, llama, d, warp=warp)
        assert got == TreeSetting(want["tree_nodes"], want["tree_width"], (want["lookup_ngram"], 1), "drafter default",
                                  want.get("tree_depth"))
    # the parallel drafters' greedy default is the measured best: 6 nodes × width 3 + lookup n ≤ 3
    if algo != "eagle3":
        assert _setting(tmp_path, llama, d) == TreeSetting(6, 3, (3, 1), "drafter default")


def test_auto_keeps_what_the_user_set_and_fills_the_rest(tmp_path, llama):
    d = build_drafter(llama, DraftConfig(algorithm="dflash", gamma=3, num_layers=1)).eval()
    assert _setting(tmp_path, llama, d, "eval.tree_nodes=8") == TreeSetting(8, 3, (3, 1), "eval config")
    assert _setting(tmp_path, llama, d, "eval.lookup_ngram=0").lookup is None
    assert _setting(tmp_path, llama, d, "eval.lookup_ngram=2", "eval.lookup_min_ngram=2").lookup == (2, 2)
    assert _setting(tmp_path, llama, d, "eval.decoding=chain") is None
    assert _setting(tmp_path, llama, d, "eval.decoding=tree", "eval.tree_width=2") == TreeSetting(6, 2, (3, 1))
    # a depth caps the tree (0 = γ: no cap)
    assert _setting(tmp_path, llama, d, "eval.tree_depth=2") == TreeSetting(6, 3, (3, 1), "eval config", 2)
    assert _setting(tmp_path, llama, d, "eval.tree_depth=0").depth is None
    # a verification-length policy alone means chains; with a tree key it is refused by name
    assert _setting(tmp_path, llama, d, policy=_Named()) is None
    with pytest.raises(ConfigError, match="replaces the verification-length policy"):
        _setting(tmp_path, llama, d, "eval.tree_nodes=8", policy=_Named())


def test_drafters_without_trees_decode_chains_and_refuse_tree_keys(tmp_path, llama):
    oracle = TargetAsDraft(llama, gamma=3)
    assert drafter_default(oracle, True) == {} and _setting(tmp_path, llama, oracle) is None
    with pytest.raises(ConfigError, match="set eval.tree_nodes too"):
        _setting(tmp_path, llama, oracle, "eval.lookup_ngram=3")
    with pytest.raises(ConfigError, match="eval.decoding=tree: set eval.tree_nodes"):
        _setting(tmp_path, llama, oracle, "eval.decoding=tree")
    with pytest.raises(ConfigError, match="drafts chains only"):
        _setting(tmp_path, llama, oracle, "eval.tree_nodes=4")
    # no_draft: prompt-lookup decoding by default
    assert _setting(tmp_path, llama, NoDraft(llama, gamma=3)).lookup == (3, 1)


def test_targets_that_cannot_verify_trees_fall_back_to_chains(tmp_path):
    nx = make_tiny_target("qwen3_next", num_layers=2)          # linear-attention layers: a recurrent state
    d = build_drafter(nx, DraftConfig(algorithm="dflash", gamma=3, num_layers=1)).eval()
    assert _setting(tmp_path, nx, d) is None
    with pytest.raises(ConfigError, match="recurrent"):
        _setting(tmp_path, nx, d, "eval.tree_nodes=4")


@pytest.mark.parametrize("ov,msg", [
    (("eval.decoding=beam",), "eval.decoding='beam': choose from auto, chain, tree"),
    (("eval.decoding=chain", "eval.tree_nodes=8"), "eval.tree_nodes=8: eval.decoding=chain verifies chains"),
    (("eval.tree_nodes=8", "eval.lookup_ngram=3", "eval.lookup_min_ngram=4"), "eval.lookup_min_ngram=4"),
    (("eval.tree_nodes=1", "eval.lookup_ngram=3"), "at least 2 nodes"),
    (("eval.tree_nodes=0",), "eval.tree_nodes=0, eval.tree_width=3: both must be ≥ 1"),
    (("eval.lookup_ngram=-1",), "eval.lookup_ngram=-1: 0 \\(off\\)"),
    (("eval.tree_depth=-1",), "eval.tree_depth=-1: the deepest draft node"),
])
def test_bad_settings_name_the_key(tmp_path, llama, ov, msg):
    d = build_drafter(llama, DraftConfig(algorithm="dflash", gamma=3, num_layers=1)).eval()
    with pytest.raises(ConfigError, match=msg):
        _setting(tmp_path, llama, d, *ov)


def test_unknown_keys_in_a_drafters_defaults_are_refused(llama):
    d = build_drafter(llama, DraftConfig(algorithm="dflash", gamma=3, num_layers=1)).eval()
    d.decoding_defaults = {"greedy": {"tree_beam": 4}}
    with pytest.raises(ValueError, match="unknown eval key"):
        drafter_default(d, True)


def test_keys_that_ask_for_no_tree_only_adjust_the_default(tmp_path, llama):
    """A width or lookup_ngram=0 (an older run's resolved config states them) adjusts the drafter's default;
    with a verification-length policy, or a drafter without trees, they leave chains alone."""
    d = build_drafter(llama, DraftConfig(algorithm="dflash", gamma=3, num_layers=1)).eval()
    old = ("eval.tree_width=4", "eval.lookup_ngram=0")
    assert _setting(tmp_path, llama, d, *old) == TreeSetting(6, 4, None, "eval config")
    assert _setting(tmp_path, llama, d, *old, policy=_Named()) is None
    assert _setting(tmp_path, llama, TargetAsDraft(llama, gamma=3), *old) is None
    assert _setting(tmp_path, llama, d, "eval.decoding=chain", *old) is None
