"""Engine config schemas, the hand-written validator, and the parameter-name table."""
import copy

import pytest
import torch

from deepspec.export import mapping
from deepspec.export.errors import SchemaError
from deepspec.export.parallel_schemas import SGLANG_DSPARK, SPECULATORS_DSPARK, sglang_problems
from deepspec.export.schemas import check, validate


def _layer(n=1):
    return {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": n,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "rope_scaling": None, "vocab_size": 495, "hidden_act": "silu",
            "attention_bias": False, "max_position_embeddings": 1024, "layer_types": ["full_attention"] * n}


def speculators_cfg():
    return {"architectures": ["DSparkDraftModel"], "speculators_model_type": "dspark",
            "speculators_config": {"algorithm": "dspark",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}],
                                   "default_proposal_method": "greedy",
                                   "verifier": {"name_or_path": "Qwen/Qwen3-8B", "architectures": ["Qwen3ForCausalLM"]}},
            "transformer_layer_config": _layer(), "draft_vocab_size": 495, "block_size": 4,
            "aux_hidden_state_layer_ids": [2, 3], "mask_token_id": 4, "markov_rank": 8,
            "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True,
            "sample_from_anchor": True}


def sglang_cfg():
    heads = {"markov_rank": 8, "markov_head_type": "rnn", "enable_confidence_head": True,
             "confidence_head_with_markov": True}
    return {**_layer(), "architectures": ["DSparkDraftModel"], "block_size": 4,
            "dflash_config": {"block_size": 4, "mask_token_id": 4, "target_layer_ids": [1, 2], "attention_mode": "gqa",
                              **heads},
            "num_target_layers": 4, **heads}


def test_valid_configs_pass():
    assert validate(speculators_cfg(), SPECULATORS_DSPARK) == []
    check(speculators_cfg(), "speculators_dspark")
    check(sglang_cfg(), "sglang_dspark")
    assert sglang_problems(sglang_cfg()) == []


def test_sglang_schema_wants_the_heads_in_both_places():
    cfg = sglang_cfg()
    cfg["architectures"] = ["Qwen3DSparkModel"]             # SpecForge's registry does not hold this name
    del cfg["dflash_config"]["markov_head_type"]
    problems = validate(cfg, SGLANG_DSPARK)
    assert any("'DSparkDraftModel'" in p for p in problems)
    assert any("dflash_config: missing required key 'markov_head_type'" in p for p in problems)
    cfg = sglang_cfg()
    cfg["dflash_config"]["markov_rank"] = 4
    assert sglang_problems(cfg) == ["dflash_config.markov_rank=4 but markov_rank=8"]


@pytest.mark.parametrize("mutate, needle", [
    (lambda c: c["speculators_config"]["verifier"].pop("name_or_path"), "verifier: missing required key 'name_or_path'"),
    (lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens="4"),
     "speculative_tokens: expected integer"),
    (lambda c: c.update(sample_from_anchor=False), "sample_from_anchor: must be True"),
    (lambda c: c.update(mask_token_id=True), "mask_token_id: expected integer"),        # bool is not an int
    (lambda c: c.update(aux_hidden_state_layer_ids=[]), "needs at least 1 item"),
    (lambda c: c.update(markov_head_type="gru"), "must be one of"),
    (lambda c: c["transformer_layer_config"].update(hidden_act="gelu"), "hidden_act: must be 'silu'"),
    (lambda c: c.pop("transformer_layer_config"), "missing required key 'transformer_layer_config'"),
])
def test_speculators_schema_rejects(mutate, needle):
    cfg = speculators_cfg()
    mutate(cfg)
    with pytest.raises(SchemaError) as e:
        check(cfg, "speculators_dspark")
    assert needle in str(e.value)


def test_sglang_schema_rejects_speculators_marker_and_rank_zero():
    cfg = sglang_cfg()
    cfg["speculators_model_type"] = "dspark"
    cfg["markov_rank"] = 0
    problems = validate(cfg, SGLANG_DSPARK)
    assert any("speculators_model_type' must not be present" in p for p in problems)
    assert any("markov_rank: must be >= 1" in p for p in problems)
    bad = copy.deepcopy(sglang_cfg())
    bad["dflash_config"].pop("target_layer_ids")
    with pytest.raises(SchemaError, match="dflash_config: missing required key 'target_layer_ids'"):
        check(bad, "sglang_dspark")


def test_parameter_table_round_trip_and_transpose():
    V, r, H = 11, 3, 8
    state = {"context.fc.weight": torch.randn(H, 2 * H), "context.norm.weight": torch.randn(H),
             "layers.0.attn.q_proj.weight": torch.randn(H, H), "layers.1.mlp.down_proj.weight": torch.randn(H, 2 * H),
             "layers.1.post_attn_norm.weight": torch.randn(H), "norm.weight": torch.randn(H),
             "head.w1.weight": torch.randn(V, r), "head.w2": torch.randn(r, V),
             "head.cell.weight": torch.randn(3 * r, 2 * r + H), "head.cell.bias": torch.randn(3 * r),
             "conf_head.proj.weight": torch.randn(1, H + r), "conf_head.proj.bias": torch.randn(1)}
    eng = mapping.to_engine(state)
    assert set(eng) == {"fc.weight", "hidden_norm.weight", "layers.0.self_attn.q_proj.weight",
                        "layers.1.mlp.down_proj.weight", "layers.1.post_attention_layernorm.weight", "norm.weight",
                        "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                        "markov_head.joint_proj.weight", "markov_head.joint_proj.bias",
                        "confidence_head.proj.weight", "confidence_head.proj.bias"}
    assert eng["markov_head.markov_w2.weight"].shape == (V, r)          # nn.Linear(rank, V).weight
    assert torch.equal(eng["markov_head.markov_w2.weight"], state["head.w2"].t())
    back = mapping.from_engine({**eng, "embed_tokens.weight": torch.zeros(V, H)})   # shared weights are skipped
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    dropped = mapping.to_engine(state, drop_parts=("markov", "rnn", "confidence"))
    assert not any(k.startswith(("markov_head", "confidence_head")) for k in dropped)


def test_parameter_table_refuses_unknown_and_names_the_unservable_settings():
    with pytest.raises(KeyError, match="layers.0.attn.new_thing"):
        mapping.to_engine({"layers.0.attn.new_thing": torch.zeros(1)})
    with pytest.raises(KeyError, match="mystery"):
        mapping.from_engine({"mystery.weight": torch.zeros(1)})
    keys = ["in_proj.weight", "out_proj.weight", "conf_head.w1.weight", "norm.weight", "anchor_proj.fc.weight",
            "anchor_proj.norm.weight", "head.w1_proj.weight"]     # a factored W1 is written as its table
    found = {cause: fix for cause, fix, _ in mapping.unservable(keys, {"hidden_size": 32})}
    assert found == {"draft.hidden_size=32": "draft.hidden_size=null",          # in_proj and out_proj: one setting
                     "draft.confidence_head=true with draft.sequential_head=none": "draft.confidence_head=false",
                     "draft.anchor_feature=true": "draft.anchor_feature=false"}
    # at the target's width an input projection comes from the embed_proj ablation
    assert [c for c, _, _ in mapping.unservable(["in_proj.weight"], {})] == ["draft.embed_proj=true"]
    # the published context map is exportable
    assert mapping.unservable(["context.fc.weight", "context.norm.weight", "norm.weight"], {}) == []


def test_target_flag_values_become_hydra_overrides():
    from deepspec.export.common import target_overrides
    assert target_overrides(["dtype=float32", "target.layer_ids=[1,2]", "qwen3_4b", "target=x"]) == [
        "target.dtype=float32", "target.layer_ids=[1,2]", "target=qwen3_4b", "target=x"]
