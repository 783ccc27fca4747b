"""`draft.init_from_target_layer`: draft layers start from one decoder layer of the target."""
import pytest
import torch

from deepspec.config.draft import DraftConfig
from deepspec.drafts import build_drafter, load_drafter
from deepspec.drafts.target_init import ATTN, MLP

pytestmark = pytest.mark.usefixtures("one_thread")


def _target_weight(target, index, name):
    hits = [m.weight for path, m in target.layers[index].named_modules() if path.rsplit(".", 1)[-1] == name]
    assert len(hits) == 1
    return hits[0]


@pytest.mark.parametrize("algo", [dict(algorithm="dspark", sequential_head="rnn"), dict(algorithm="dflash"),
                                  dict(algorithm="eagle3")])
def test_every_projection_is_the_target_layers(tiny_target, algo):
    t = tiny_target
    d = build_drafter(t, DraftConfig(gamma=3, num_layers=2, head_rank=8, init_from_target_layer=-1, **algo))
    last = len(t.layers) - 1
    for layer in d.layers:
        for group, names in (("attn", ATTN), ("mlp", MLP)):
            for name in names:
                got = getattr(getattr(layer, group), name).weight
                assert torch.equal(got, _target_weight(t, last, name).to(got.dtype))
    # the copies are the draft's own parameters: training them leaves the frozen target as it was
    before = _target_weight(t, last, "q_proj").clone()
    d.layers[0].attn.q_proj.weight.data.add_(1.0)
    assert torch.equal(_target_weight(t, last, "q_proj"), before)
    # norms keep their init; the layer index only chooses the source
    assert torch.equal(d.layers[0].input_norm.weight, torch.ones_like(d.layers[0].input_norm.weight))
    d0 = build_drafter(t, DraftConfig(gamma=3, num_layers=1, head_rank=8, init_from_target_layer=0, **algo))
    assert torch.equal(d0.layers[0].mlp.up_proj.weight, _target_weight(t, 0, "up_proj"))


def test_default_init_is_untouched(tiny_llama):
    torch.manual_seed(0)
    a = build_drafter(tiny_llama, DraftConfig(algorithm="dflash", gamma=3, num_layers=1))
    torch.manual_seed(0)
    b = build_drafter(tiny_llama, DraftConfig(algorithm="dflash", gamma=3, num_layers=1, init_from_target_layer=0))
    assert not torch.equal(a.layers[0].attn.q_proj.weight, b.layers[0].attn.q_proj.weight)
    assert float(a.layers[0].attn.q_proj.weight.detach().std()) == pytest.approx(0.02, rel=0.3)


def test_bad_settings_are_named(tiny_llama):
    n = len(tiny_llama.layers)
    with pytest.raises(ValueError, match=rf"init_from_target_layer={n}: the target has {n} decoder layers"):
        build_drafter(tiny_llama, DraftConfig(algorithm="dflash", gamma=3, num_layers=1, init_from_target_layer=n))
    with pytest.raises(ValueError, match="leave draft.hidden_size/heads unset"):
        build_drafter(tiny_llama, DraftConfig(algorithm="dflash", gamma=3, num_layers=1, init_from_target_layer=0,
                                              intermediate_size=24))
    # EAGLE-3's engine layer reads the 2·hidden concat: q/k/v cannot come from a target layer
    with pytest.raises(ValueError, match="attn.q_proj is"):
        build_drafter(tiny_llama, DraftConfig(algorithm="eagle3", gamma=3, num_layers=1, eagle3_layout="engine",
                                              init_from_target_layer=0))


def test_a_saved_draft_loads_its_own_weights(tiny_llama, tmp_path):
    d = build_drafter(tiny_llama, DraftConfig(algorithm="dspark", sequential_head="rnn", gamma=3, num_layers=1,
                                              head_rank=8, init_from_target_layer=-1))
    with torch.no_grad():
        d.layers[0].mlp.down_proj.weight.mul_(0.5)      # "trained" away from the target's layer
    d.save_pretrained(tmp_path / "d")
    back = load_drafter(tmp_path / "d", tiny_llama)
    assert torch.equal(back.layers[0].mlp.down_proj.weight, d.layers[0].mlp.down_proj.weight)
