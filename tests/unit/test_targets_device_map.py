"""`target.device_map`: the target is loaded through transformers' placement (accelerate's device map; here
everything lands on the CPU, the one device a test has) and the adapter's forwards give what the target on
one device gives; the recorder gathers features from wherever each layer ran."""
import pytest
import torch

from deepspec.config import load_config
from deepspec.targets import load_target
from deepspec.targets.tiny import save_tiny


def test_a_target_placed_by_accelerate_computes_the_same(tmp_path, one_thread):
    pytest.importorskip("accelerate")
    d = save_tiny("llama", tmp_path / "tiny")
    base = ["target.dtype=float32", f"target.path={d}", "target.num_feature_layers=2", "target.device=cpu"]
    plain = load_target(load_config(base).target)
    placed = load_target(load_config(base + ["target.device_map=auto"]).target)
    ids = torch.randint(0, plain.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    a, b = plain.capture(ids), placed.capture(ids)
    torch.testing.assert_close(a.features, b.features)
    torch.testing.assert_close(a.last_hidden, b.last_hidden)
    x, y = plain.decode(ids[:1]), placed.decode(ids[:1])
    torch.testing.assert_close(x.logits, y.logits)


def test_a_tiny_target_refuses_a_device_map():
    with pytest.raises(ValueError, match="target.device_map='auto': a tiny target"):
        load_target(load_config(["target.path=tiny:llama", "target.device_map=auto"]).target)


def test_features_are_gathered_on_the_first_layers_device():
    from deepspec.targets.adapter import _LayerRecorder
    rec = _LayerRecorder([2, 0])
    rec.hook(0)(None, None, (torch.ones(1, 3, 2),))
    rec.hook(2)(None, None, torch.zeros(1, 3, 2))
    f = rec.features()
    assert f.shape == (1, 3, 4) and f.device == torch.device("cpu") and f[..., :2].sum() == 0
