"""Each drafter overfits one sample: the loss falls by a large factor and acceptance rises.

The tiny random target is nearly uniform (TV to any draft is tiny from the start), so
its LM head is sharpened and the sample is drawn from the sharpened target itself:
then matching the target really is learnable and 1 - TV really starts near 0.
"""
import pytest
import torch

from deepspec.config.draft import DraftConfig, LossConfig
from deepspec.drafts import build_drafter

G = 4
CASES = {
    "dflash": dict(algorithm="dflash", loss=LossConfig(ce_weight=1.0, l1_weight=0.0, conf_weight=0.0)),
    "dspark_markov": dict(algorithm="dspark", sequential_head="markov"),
    "dspark_rnn": dict(algorithm="dspark", sequential_head="rnn"),
    "eagle3": dict(algorithm="eagle3", ttt_steps=3),
    "eagle3_engine": dict(algorithm="eagle3", ttt_steps=3, eagle3_layout="engine"),
}


@pytest.fixture(scope="module")
def sharp_sample():
    from conftest import make_tiny_target
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    t = make_tiny_target("llama", num_feature_layers=3)      # eagle3's engine layout reads exactly 3
    with torch.no_grad():
        t.lm_head.weight.mul_(30.0)
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[494, 414, 353, 465]])        # a fixed prompt: its sharpened continuation is learnable
    out = t.decode(ids)
    for _ in range(16):
        nxt = torch.multinomial(torch.softmax(out.logits[0, -1], -1), 1, generator=g).view(1, 1)
        ids = torch.cat([ids, nxt], 1)
        out = t.decode(nxt, out.past_key_values)
    cap = t.capture(ids)
    T = ids.shape[1]
    ones = torch.ones(1, T, dtype=torch.bool)
    batch = {"input_ids": ids, "loss_mask": ones, "attention_mask": ones, "features": cap.features.clone(),
             "last_hidden": cap.last_hidden.clone(), "anchors": torch.arange(1, T - G - 1, 2)[None]}
    torch.set_num_threads(n)
    return t, batch


@pytest.mark.parametrize("name", list(CASES))
def test_overfits_one_sample(sharp_sample, name):
    t, batch = sharp_sample
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        d = build_drafter(t, DraftConfig(gamma=G, num_layers=1, head_rank=32, **CASES[name]))
        opt = torch.optim.Adam(d.parameters(), lr=2e-2)
        first = None
        for _ in range(50):
            out = d(batch)
            opt.zero_grad()
            out["loss"].backward()
            opt.step()
            first = first or out["metrics"]
        with torch.no_grad():
            last = d(batch)["metrics"]
    finally:
        torch.set_num_threads(n)
    assert last["loss"] < first["loss"] / 4, (first["loss"], last["loss"])
    assert last["tv"] < first["tv"] / 3, (first["tv"], last["tv"])
    assert last["accept_rate/1"] > first["accept_rate/1"] + 0.4
    assert last["expected_tau"] > first["expected_tau"] + 1.5
