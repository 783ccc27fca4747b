"""Reduced draft vocabularies (``draft.vocab_size = N``) in the engine formats: vLLM's ``d2t`` / ``t2d`` and
``lm_head`` rows, SGLang's DSpark one more Markov rank dimension; round trips, the self-check and the import
refusals."""
import json

import pytest
import torch
from safetensors.torch import load_file

from deepspec.export import ExportError, ImportUnsupported, export_draft, import_draft
from deepspec.export.api import verify_export
from deepspec.export.engine_parallel import EngineDraft
from deepspec.export.schemas import SCHEMAS, validate
from deepspec.export.vocab_rank import VOCAB_BIAS
from tests.support.export_drafts import N_DRAFT, TINY, pruned, same_blocks, same_proposals, save, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.mark.parametrize("algorithm, kw", [("dspark", {"sequential_head": "markov"}), ("dflash", {})])
def test_vllm_reduced_vocabulary_round_trip(target, tmp_path, algorithm, kw):
    """speculators/vLLM: draft_vocab_size = N, d2t [N] (target id = draft id + d2t), t2d [V], lm_head = the
    target's rows of the draft vocabulary, Markov W2 over N rows; re-import gives the same logits and proposals."""
    V = target.vocab_size
    d, ids = pruned(target, algorithm, **kw)
    ckpt = save(d, tmp_path / "ckpt")
    out = tmp_path / "vllm"
    res = export_draft(ckpt, out, "vllm", target=target, target_path=TINY)
    cfg = json.loads((out / "config.json").read_text())
    assert validate(cfg, SCHEMAS["speculators_dspark"]) == []
    assert cfg["draft_vocab_size"] == N_DRAFT and cfg["transformer_layer_config"]["vocab_size"] == V
    w = load_file(str(out / "model.safetensors"))
    assert w["d2t"].dtype == torch.int64 and w["d2t"].shape == (N_DRAFT,)
    assert torch.equal(torch.arange(N_DRAFT) + w["d2t"], ids)
    assert w["t2d"].dtype == torch.bool and w["t2d"].shape == (V,) and int(w["t2d"].sum()) == N_DRAFT
    assert bool(w["t2d"][ids].all())
    assert torch.equal(w["lm_head.weight"], target.lm_head.weight.detach()[ids])
    assert torch.equal(w["lm_head.weight"], target.lm_head.weight.detach()[w["t2d"]])   # speculators' construction
    assert "draft_vocab" not in w and not any(k.startswith("embed_tokens") for k in w)
    if algorithm == "dspark":
        assert w["markov_head.markov_w2.weight"].shape == (N_DRAFT, 8)
        assert w["markov_head.markov_w1.weight"].shape == (V, 8)         # embeds the previous *target* token
    assert res.verified["reimport_max_abs_diff"] == 0.0 and res.verified["engine_max_abs_diff"] < 1e-4
    back = import_draft(out, target)
    assert back.algorithm == algorithm and back.cfg.vocab_size == N_DRAFT and torch.equal(back.draft_vocab, ids)
    batch = same_blocks(d, back, target)
    # the independent engine forward (reads lm_head / d2t by the engine names) places logits at target ids
    eng = EngineDraft.from_dir(out)
    anchors = [int(a) for a in batch["anchors"][0]]
    logits, _ = eng.block_logits(batch["features"][0], batch["input_ids"][0], anchors, target.embed,
                                 target.logits_from_hidden)
    assert logits.shape[-1] == V and torch.isinf(logits[..., ~w["t2d"]]).all()
    torch.testing.assert_close(logits[..., ids], d.block_logits(batch)["logits"][0], atol=1e-4, rtol=1e-4)
    for temperature in (0.0, 1.0):
        prop = same_proposals(d, back, target, temperature)
        assert set(prop.tokens.tolist()) <= set(ids.tolist()) and (prop.probs[:, ~w["t2d"]] == 0).all()
    # hf round trip: the vocabulary travels in model.safetensors
    res = export_draft(ckpt, tmp_path / "hf", "hf", target=target)
    assert res.verified["reimport_max_abs_diff"] == 0.0
    assert torch.equal(import_draft(tmp_path / "hf", target).draft_vocab, ids)


@pytest.mark.parametrize("algorithm, kw", [("dspark", {"sequential_head": "markov"}),
                                           ("dspark", {"sequential_head": "rnn"}), ("dflash", {})])
def test_sglang_reduced_vocabulary_is_one_more_markov_rank(target, tmp_path, algorithm, kw):
    """SGLang's DSpark scores every token: the draft vocabulary is a last Markov rank dimension (markov_w1 1,
    markov_w2 0 on the draft tokens and VOCAB_BIAS elsewhere); re-import gives the same logits and proposals."""
    V = target.vocab_size
    d, ids = pruned(target, algorithm, seed=1, **kw)
    out = tmp_path / "sg"
    res = export_draft(save(d, tmp_path / "ckpt"), out, "sglang", target=target, target_path=TINY)
    cfg, w = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    r, outside = (8 if d.head is not None else 0), torch.ones(V, dtype=torch.bool).index_fill(0, ids, False)
    assert cfg["markov_rank"] == cfg["dflash_config"]["markov_rank"] == r + 1 and "draft_vocab_size" not in cfg
    assert not {"d2t", "t2d", "lm_head.weight"} & set(w)
    w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    assert w1.shape == w2.shape == (V, r + 1) and bool((w1[:, -1] == 1).all()) and not w2[ids, -1].any()
    assert bool((w2[outside, -1] == VOCAB_BIAS).all()) and not w2[outside, :r].any()
    if kw.get("sequential_head") == "rnn":
        assert w["markov_head.joint_proj.weight"].shape == (3 * (r + 1), 2 * (r + 1) + 64)
    assert res.verified["reimport_max_abs_diff"] == 0.0 and res.verified["engine_max_abs_diff"] < 1e-4
    assert res.verified["engine_mass_outside_vocab"] == 0.0
    back = import_draft(out, target)
    assert (back.algorithm, back.cfg.sequential_head) == (algorithm, d.cfg.sequential_head)
    assert torch.equal(back.draft_vocab, ids) and (r == 0 or back.cfg.head_rank == r)
    same_blocks(d, back, target)
    for temperature in (0.0, 1.0):
        same_proposals(d, back, target, temperature)
    assert "one more Markov rank dimension" in (out / "README.md").read_text()


@pytest.mark.parametrize("w_edit, fails", [
    (lambda w: w["markov_head.markov_w2.weight"][:, -1].clamp_(min=-1.0), ExportError),      # another constant
    (lambda w: w["markov_head.markov_w2.weight"][:3, -1].fill_(0.0), ExportError),           # more tokens inside
    (lambda w: w["markov_head.markov_w2.weight"][0, -1].fill_(VOCAB_BIAS), "markov_w2"),     # a draft token out
    (lambda w: w["markov_head.joint_proj.weight"][0, 9 + 8].fill_(0.5), "joint_proj"),       # reads embedding r
    (lambda w: w["confidence_head.proj.weight"][0, -1].fill_(0.5), "confidence_head.proj"),
])
def test_a_damaged_vocabulary_rank_is_caught(target, tmp_path, edited_draft, w_edit, fails):
    """Another constant or token set reads back as another vocabulary (the self-check fails); a draft token with
    its trained W2 row outside it, or a trained weight reading the vocabulary coordinate, is refused by name."""
    d, _ = pruned(target, "dspark", seed=2, sequential_head="rnn")
    export_draft(save(d, tmp_path / "ckpt"), tmp_path / "sg", "sglang", target=target, verify=False)
    bad = edited_draft(tmp_path / "sg", tmp_path / "bad", None, w_edit)
    if fails is ExportError:
        with pytest.raises(ExportError, match="self-check failed"):
            verify_export(bad, "sglang", d, target, nothing_dropped=True)
    else:
        with pytest.raises(ImportUnsupported, match=fails):
            import_draft(bad, target)


@pytest.mark.parametrize("cfg_edit, w_edit, needle", [
    (None, lambda w: w["d2t"].__setitem__(5, w["d2t"][6] + 1), "strictly increasing"),
    (None, lambda w: w.update(d2t=w["d2t"][:-1]), r"d2t has shape \[99\], draft_vocab_size is 100"),
    (lambda c: c.update(draft_vocab_size=99), None, r"d2t has shape \[100\], draft_vocab_size is 99"),
    (None, lambda w: w.update(d2t=w["d2t"] + 10**6), "outside the target vocabulary"),
    (None, lambda w: w["t2d"].__setitem__(w["t2d"].nonzero()[3], False), "t2d marks 99 target tokens"),
    (None, lambda w: w.pop("d2t"), "there is no d2t"),
    (None, lambda w: w.pop("lm_head.weight"), "needs lm_head.weight"),
    (None, lambda w: w["lm_head.weight"].mul_(2), "lm_head.weight differs from the target's LM head rows"),
])
def test_import_refuses_bad_vocabulary_maps(target, tmp_path, edited_draft, cfg_edit, w_edit, needle):
    d, _ = pruned(target, "dflash", seed=3)
    ckpt = save(d, tmp_path / "ckpt")
    export_draft(ckpt, tmp_path / "v", "vllm", target=target, verify=False)
    bad = edited_draft(tmp_path / "v", tmp_path / "bad", cfg_edit, w_edit)
    with pytest.raises(ImportUnsupported, match=needle):
        import_draft(bad, target)
