"""save_pretrained / from_pretrained: exact round trip, trainable weights only, target checks."""
import json

import pytest
import torch
from safetensors.torch import load_file

from deepspec.config.draft import DraftConfig, LossConfig
from deepspec.drafts import DraftTargetMismatchError, Drafter, build_drafter, load_drafter

CFGS = {
    "dspark_rnn": DraftConfig(algorithm="dspark", gamma=3, num_layers=2, sequential_head="rnn", head_rank=8,
                              mask_token_id=7, loss=LossConfig(position_decay=2.5, chunk_size=5)),
    "dspark_markov_target_embed": DraftConfig(algorithm="dspark", gamma=3, num_layers=1, head_rank=8,
                                              head_embedding="target"),
    "dflash": DraftConfig(algorithm="dflash", gamma=3, num_layers=1, hidden_size=32, num_attention_heads=2,
                          num_key_value_heads=1, intermediate_size=40),
    "eagle3": DraftConfig(algorithm="eagle3", gamma=3, num_layers=1, ttt_steps=2),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def batch_for(target):
    ids = torch.randint(0, target.vocab_size, (1, 14), generator=torch.Generator().manual_seed(0))
    cap = target.capture(ids)
    ones = torch.ones(1, 14, dtype=torch.bool)
    return {"input_ids": ids, "loss_mask": ones, "attention_mask": ones, "features": cap.features.clone(),
            "last_hidden": cap.last_hidden.clone(), "anchors": torch.tensor([[1, 5, 9]])}


def logits_of(d, batch):
    return d.step_logits(batch) if d.algorithm == "eagle3" else d.block_logits(batch)["logits"]


@pytest.mark.parametrize("name", list(CFGS))
def test_round_trip_reproduces_logits_exactly(tiny_llama, tmp_path, name):
    t = tiny_llama
    torch.manual_seed(0)
    d = build_drafter(t, CFGS[name])
    for p in d.parameters():                      # move away from the init
        p.data.add_(0.05 * torch.randn_like(p))
    d.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    assert meta["architecture"] == name.split("_")[0]
    assert meta["draft"]["num_layers"] == CFGS[name].num_layers
    assert meta["draft"]["loss"] == vars(d.cfg.loss)
    assert meta["target"]["fingerprint"] == t.fingerprint()
    assert meta["target"]["layer_ids"] == t.layer_ids and meta["target"]["feature_dim"] == t.feature_dim
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert set(weights) == {n for n, _ in d.named_parameters()}
    assert sum(v.numel() for v in weights.values()) == sum(p.numel() for p in d.parameters())
    assert not any("embed" in k or "lm_head" in k for k in weights)
    d2 = load_drafter(tmp_path, t)
    assert type(d2) is type(d) and d2.cfg == d.cfg and d2.mask_token_id == d.mask_token_id
    batch = batch_for(t)
    assert torch.equal(logits_of(d, batch), logits_of(d2, batch))
    assert isinstance(Drafter.from_pretrained(tmp_path, t), type(d))


def test_different_target_is_refused(tiny_llama, tmp_path):
    from conftest import make_tiny_target
    d = build_drafter(tiny_llama, CFGS["dspark_rnn"])
    d.save_pretrained(tmp_path)
    other = make_tiny_target("llama", seed=1)          # same shapes, other weights
    with pytest.raises(DraftTargetMismatchError, match="weights_sha256"):
        load_drafter(tmp_path, other)
    d2 = load_drafter(tmp_path, other, allow_target_mismatch=True)
    assert torch.equal(d2.context.fc.weight, d.context.fc.weight)
    other_layers = make_tiny_target("llama", num_feature_layers=3)
    with pytest.raises(DraftTargetMismatchError, match="layer_ids"):
        load_drafter(tmp_path, other_layers, allow_target_mismatch=True)
    with pytest.raises(FileNotFoundError):
        load_drafter(tmp_path / "nope", tiny_llama)


def test_init_from_copies_matching_weights(tiny_llama, tmp_path):
    t = tiny_llama
    torch.manual_seed(0)
    base = build_drafter(t, DraftConfig(algorithm="dflash", gamma=3, num_layers=1))
    base.save_pretrained(tmp_path)
    torch.manual_seed(1)
    cfg = DraftConfig(algorithm="dspark", gamma=3, num_layers=1, sequential_head="markov", head_rank=8,
                      init_from=str(tmp_path))
    spark = build_drafter(t, cfg)
    # backbone copied: with the Markov head's bias switched off the logits are DFlash's exactly
    batch = batch_for(t)
    assert not torch.equal(spark.block_logits(batch)["logits"], base.block_logits(batch)["logits"])
    w2 = spark.head.w2.detach().clone()
    with torch.no_grad():
        spark.head.w2.zero_()
    assert torch.equal(spark.block_logits(batch)["logits"], base.block_logits(batch)["logits"])
    with torch.no_grad():
        spark.head.w2.copy_(w2)
    assert spark.conf_head is not None
    with pytest.raises(ValueError, match="shapes differ"):
        build_drafter(t, DraftConfig(algorithm="dflash", gamma=3, num_layers=1, intermediate_size=32,
                                     init_from=str(tmp_path)))
    # a saved init_from is not re-applied when loading that checkpoint elsewhere
    spark.save_pretrained(tmp_path / "spark")
    (tmp_path / "model.safetensors").unlink()
    assert torch.equal(load_drafter(tmp_path / "spark", t).block_logits(batch)["logits"],
                       spark.block_logits(batch)["logits"])


def test_removed_options_load_at_their_no_op_value_and_are_refused_otherwise():
    from deepspec.drafts.checkpoint import DraftCheckpointError, coerce_draft_config
    old = {"algorithm": "dspark", "feature_norm": "none", "context_mlp": False, "init_from_target_layer": None,
           "loss": {"ce_weight": 0.2, "soft_ce_weight": 0.0}}
    cfg = coerce_draft_config(old)
    assert cfg.loss.ce_weight == 0.2 and not hasattr(cfg, "context_mlp")
    with pytest.raises(DraftCheckpointError, match=r"draft\.context_mlp=True: this option was removed"):
        coerce_draft_config({**old, "context_mlp": True})
    with pytest.raises(DraftCheckpointError, match=r"draft\.loss\.soft_ce_weight=0\.5"):
        coerce_draft_config({**old, "loss": {"soft_ce_weight": 0.5}})
