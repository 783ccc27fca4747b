"""`draft.feature_norm=channel`: target features divided by their per-channel RMS before the projection."""
import pytest
import torch

from deepspec.config.draft import DraftConfig
from deepspec.drafts import build_drafter, load_drafter
from deepspec.drafts.feature_scale import probe_feature_rms

pytestmark = pytest.mark.usefixtures("one_thread")

ALGOS = [dict(algorithm="dspark", sequential_head="rnn", anchor_feature=True), dict(algorithm="dflash"),
         dict(algorithm="eagle3")]


def _batch(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, t.vocab_size, (1, 16), generator=g)
    cap = t.capture(ids)
    return {"input_ids": ids, "loss_mask": torch.ones(1, 16, dtype=torch.bool),
            "attention_mask": torch.ones(1, 16, dtype=torch.bool), "features": cap.features.clone(),
            "last_hidden": cap.last_hidden.clone(), "anchors": torch.tensor([[2, 7, 11]])}


def _fcs(d):
    return [m.fc for m in (getattr(d, "context", None), getattr(d, "anchor_proj", None)) if m is not None] or [d.fc]


@pytest.mark.parametrize("algo", ALGOS)
def test_channel_scaling_is_a_rescaled_projection(tiny_target, algo):
    """Dividing the features by the probe RMS equals the unscaled drafter with every fc column multiplied
    by 1 / RMS: same loss on the same batch."""
    t = tiny_target
    kw = dict(gamma=3, num_layers=1, head_rank=8, **algo)
    torch.manual_seed(0)
    scaled = build_drafter(t, DraftConfig(feature_norm="channel", **kw))
    torch.manual_seed(0)
    plain = build_drafter(t, DraftConfig(**kw))
    inv = probe_feature_rms(t).reciprocal()
    with torch.no_grad():
        for fc in _fcs(plain):
            fc.weight.mul_(inv)
    for name, buf in scaled.named_buffers():
        if name.endswith("inv_rms"):
            assert torch.allclose(buf, inv)
    assert sum(n.endswith("inv_rms") for n, _ in scaled.named_buffers()) == len(_fcs(scaled))
    batch = _batch(t)
    a, b = scaled(batch)["loss"], plain(batch)["loss"]
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    # not a no-op: the channels enter at different scales
    assert float(inv.max() / inv.min()) > 1.5


def test_probe_and_checkpoint(tiny_llama, tmp_path):
    rms = probe_feature_rms(tiny_llama)
    assert rms.shape == (tiny_llama.feature_dim,) and bool((rms > 0).all())
    d = build_drafter(tiny_llama, DraftConfig(algorithm="dflash", gamma=3, num_layers=1, feature_norm="channel"))
    with torch.no_grad():
        d.context.inv_rms.mul_(2.0)          # a saved draft keeps its own divisor, not a fresh probe
    d.save_pretrained(tmp_path / "d")
    back = load_drafter(tmp_path / "d", tiny_llama)
    assert torch.equal(back.context.inv_rms, d.context.inv_rms)
    with pytest.raises(ValueError, match="draft.feature_norm='layer': choose from none, channel"):
        build_drafter(tiny_llama, DraftConfig(algorithm="dflash", gamma=3, num_layers=1, feature_norm="layer"))
