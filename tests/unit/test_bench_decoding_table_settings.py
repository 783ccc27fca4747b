"""bench/decoding_table.py: the decoding settings it evaluates (``KIND@DTYPE``) and the eval keys each sets."""
import pytest


def test_parse_setting(bench_module):
    mod = bench_module("decoding_table")
    assert mod.parse_setting("chain@float32") == {"name": "chain@float32", "tree": None, "depth": None, "lookup": 0,
                                                  "lookup_min": 1, "dtype": "float32"}
    assert mod.parse_setting("tree16x8l3@bfloat16") == {"name": "tree16x8l3@bfloat16", "tree": (16, 8), "depth": None, "lookup": 3,
                                                         "lookup_min": 1, "dtype": "bfloat16"}
    assert mod.parse_setting("tree16x8l3m2@bfloat16")["lookup_min"] == 2
    assert mod.parse_setting("tree16x8d4l3@bfloat16")["depth"] == 4
    with pytest.raises(SystemExit, match="≥ 1"):
        mod.parse_setting("tree16x8d0@float32")
    with pytest.raises(SystemExit, match="treeNxW"):
        mod.parse_setting("tree6@float32")
    with pytest.raises(SystemExit, match="treeNxW"):
        mod.parse_setting("chain@int8")
    with pytest.raises(SystemExit, match="≥ 1"):
        mod.parse_setting("tree0x8@float32")
    with pytest.raises(SystemExit, match="1 ≤ M"):
        mod.parse_setting("tree16x8l2m3@bfloat16")


def test_setting_overrides_state_every_eval_key(bench_module):
    mod = bench_module("decoding_table")
    assert mod.setting_overrides(mod.parse_setting("chain@bfloat16")) == ["eval.decoding=chain"]
    assert mod.setting_overrides(mod.parse_setting("tree16x8@bfloat16")) == [
        "eval.decoding=tree", "eval.tree_nodes=16", "eval.tree_width=8", "eval.tree_depth=0", "eval.lookup_ngram=0",
        "eval.lookup_min_ngram=1"]
    assert "eval.tree_depth=3" in mod.setting_overrides(mod.parse_setting("tree16x8d3l3@bfloat16"))
    assert mod.setting_overrides(mod.parse_setting("tree6x2l3m2@float32"))[-2:] == [
        "eval.lookup_ngram=3", "eval.lookup_min_ngram=2"]
