"""bench/learning_curve.py: ablation variant specs parse to the overrides the trainer gets."""
import pytest


def test_variants_default_to_only_and_get_the_shared_depth_except_eagle3(bench_module):
    mod = bench_module("learning_curve")
    assert mod.parse_variants([], ["dspark_markov", "eagle3"], 2) == [
        ("dspark_markov", "dspark_markov", ["draft.num_layers=2"]), ("eagle3", "eagle3", [])]


def test_variant_overrides_are_kept_and_an_explicit_depth_wins(bench_module):
    mod = bench_module("learning_curve")
    got = mod.parse_variants(["L3=dspark_markov,draft.num_layers=3",
                              "anchor=dflash,draft.anchor_feature=true"], ["eagle3"], 1)
    assert got == [("L3", "dspark_markov", ["draft.num_layers=3"]),
                   ("anchor", "dflash", ["draft.anchor_feature=true", "draft.num_layers=1"])]


@pytest.mark.parametrize("spec, words", [("x=nope", "DRAFTER one of"), ("x", "DRAFTER one of"),
                                         ("x=dflash,layers", "key=value")])
def test_bad_variant_specs_name_the_spec(spec, words, bench_module):
    mod = bench_module("learning_curve")
    with pytest.raises(SystemExit, match=words) as e:
        mod.parse_variants([spec], [], 1)
    assert repr(spec) in str(e.value)


def test_duplicate_variant_labels_are_an_error(bench_module):
    mod = bench_module("learning_curve")
    with pytest.raises(SystemExit, match="used twice"):
        mod.parse_variants(["a=dflash", "a=eagle3"], [], 1)
