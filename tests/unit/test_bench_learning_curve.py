"""bench/learning_curve.py: ablation variant specs parse to the overrides the trainer gets."""
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _module():
    sys.path.insert(0, str(REPO))
    spec = importlib.util.spec_from_file_location("learning_curve", REPO / "bench" / "learning_curve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_variants_default_to_only_and_get_the_shared_depth_except_eagle3():
    mod = _module()
    assert mod.parse_variants([], ["dspark_markov", "eagle3"], 2) == [
        ("dspark_markov", "dspark_markov", ["draft.num_layers=2"]), ("eagle3", "eagle3", [])]


def test_variant_overrides_are_kept_and_an_explicit_depth_wins():
    mod = _module()
    got = mod.parse_variants(["L3=dspark_markov,draft.num_layers=3",
                              "anchor=dflash,draft.anchor_feature=true"], ["eagle3"], 1)
    assert got == [("L3", "dspark_markov", ["draft.num_layers=3"]),
                   ("anchor", "dflash", ["draft.anchor_feature=true", "draft.num_layers=1"])]


@pytest.mark.parametrize("spec, words", [("x=nope", "DRAFTER one of"), ("x", "DRAFTER one of"),
                                         ("x=dflash,layers", "key=value")])
def test_bad_variant_specs_name_the_spec(spec, words):
    mod = _module()
    with pytest.raises(SystemExit, match=words) as e:
        mod.parse_variants([spec], [], 1)
    assert repr(spec) in str(e.value)


def test_duplicate_variant_labels_are_an_error():
    mod = _module()
    with pytest.raises(SystemExit, match="used twice"):
        mod.parse_variants(["a=dflash", "a=eagle3"], [], 1)
