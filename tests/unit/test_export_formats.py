"""`deepspec export`: hf / vllm (speculators) / sglang layouts, import readers, refusals, self-check."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepspec.config.draft import DraftConfig
from deepspec.drafts import build_drafter
from deepspec.export import ExportError, ExportUnsupported, ImportUnsupported, export_draft, import_draft
from deepspec.export.api import probe_batch, verify_export
from deepspec.export.cli import main as export_main
from deepspec.export.engine_parallel import EngineDraft
from deepspec.export.schemas import validate, SCHEMAS
from tests.support.export_drafts import LAYER_IDS, TINY, same_blocks, save, tiny_target, trained


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def test_vllm_dspark_markov_round_trip(target, tmp_path):
    d = trained(target, "dspark", sequential_head="markov")
    ckpt = save(d, tmp_path / "ckpt")
    res = export_draft(ckpt, tmp_path / "vllm", "vllm", target=target, target_path=TINY)
    out = tmp_path / "vllm"
    cfg = json.loads((out / "config.json").read_text())
    assert validate(cfg, SCHEMAS["speculators_dspark"]) == []
    assert cfg["aux_hidden_state_layer_ids"] == [2, 3]             # vLLM captures the input of layer k = ours + 1
    assert (cfg["block_size"], cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]) == (4, 4)
    assert (cfg["markov_rank"], cfg["markov_head_type"], cfg["confidence_head_with_markov"]) == (8, "vanilla", True)
    assert cfg["mask_token_id"] == d.mask_token_id and cfg["draft_vocab_size"] == target.vocab_size
    assert cfg["speculators_config"]["verifier"] == {"name_or_path": TINY, "architectures": ["LlamaForCausalLM"]}
    w = load_file(str(out / "model.safetensors"))
    assert "fc.weight" in w and "layers.0.self_attn.q_norm.weight" in w and "hidden_norm.weight" in w
    assert w["markov_head.markov_w2.weight"].shape == (target.vocab_size, 8)
    assert not any(k.startswith(("embed_tokens", "lm_head", "head.", "context.")) for k in w)
    assert res.verified["reimport_max_abs_diff"] == 0.0 and res.verified["engine_max_abs_diff"] < 1e-4
    back = import_draft(out, target)
    assert back.algorithm == "dspark" and back.cfg.sequential_head == "markov" and back.cfg.confidence_head
    same_blocks(d, back, target)
    # the decoding path agrees too: same greedy proposals from the same prefix
    batch = probe_batch(target, 4, seed=5)
    ids, feats = batch["input_ids"][0], batch["features"][0]
    greedy = lambda logits: torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    p1 = d.propose(d.init_state(ids[:6], feats[:6]), int(ids[6]), 4, greedy)
    p2 = back.propose(back.init_state(ids[:6], feats[:6]), int(ids[6]), 4, greedy)
    assert torch.equal(p1.tokens, p2.tokens) and torch.allclose(p1.confidence, p2.confidence)
    prov = json.loads((out / "deepspec_export.json").read_text())
    assert prov["layer_ids"] == LAYER_IDS and prov["target"]["fingerprint"] == target.fingerprint()


def test_sglang_dspark_rnn_round_trip(target, tmp_path):
    d = trained(target, "dspark", sequential_head="rnn", seed=1)
    ckpt = save(d, tmp_path / "ckpt")
    export_draft(ckpt, tmp_path / "sg", "sglang", target=target, target_path=TINY)
    cfg = json.loads((tmp_path / "sg" / "config.json").read_text())
    assert validate(cfg, SCHEMAS["sglang_dspark"]) == [] and "speculators_model_type" not in cfg
    assert cfg["architectures"] == ["DSparkDraftModel"]         # SGLang's registry and SpecForge's both hold it
    heads = {"markov_rank": 8, "markov_head_type": "rnn", "enable_confidence_head": True,
             "confidence_head_with_markov": True}
    assert cfg["dflash_config"] == {"block_size": 4, "mask_token_id": d.mask_token_id, "target_layer_ids": LAYER_IDS,
                                    "attention_mode": "gqa", **heads}     # read by SGLang first, by SpecForge only
    assert {k: cfg[k] for k in heads} == heads and cfg["block_size"] == 4     # SGLang builds its heads from these
    assert (cfg["num_target_layers"], cfg["hidden_size"]) == (4, 64)
    w = load_file(str(tmp_path / "sg" / "model.safetensors"))
    assert w["markov_head.joint_proj.weight"].shape == (24, 2 * 8 + 64)
    back = import_draft(tmp_path / "sg", target)
    assert back.cfg.sequential_head == "rnn"
    batch = same_blocks(d, back, target)
    # an independent implementation of the engine's forward, fed the written files, agrees
    eng = EngineDraft.from_dir(tmp_path / "sg")
    anchors = [int(a) for a in batch["anchors"][0]]
    logits, conf = eng.block_logits(batch["features"][0], batch["input_ids"][0], anchors, target.embed,
                                    target.logits_from_hidden)
    ours = d.block_logits(batch)
    torch.testing.assert_close(logits, ours["logits"][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(conf, ours["confidence"][0], atol=1e-4, rtol=1e-4)


def test_headless_dflash_in_both_formats(target, tmp_path):
    from deepspec.drafts import load_drafter
    ckpt = save(trained(target, "dflash", seed=2).to(torch.bfloat16), tmp_path / "ckpt")    # bf16 checkpoint
    export_draft(ckpt, tmp_path / "v", "vllm", target=target, target_path=TINY)
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    # DSpark layout with the Markov head off: the speculators `dflash` runtime reads slots one position later
    assert (cfg["speculators_model_type"], cfg["markov_rank"], cfg["enable_confidence_head"]) == ("dspark", 0, False)
    assert cfg["sample_from_anchor"] is True and cfg["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(str(tmp_path / "v" / "model.safetensors")).values()} == {torch.bfloat16}
    loaded = load_drafter(ckpt, target).eval()
    back = import_draft(tmp_path / "v", target)
    assert back.algorithm == "dflash"
    same_blocks(loaded, back, target)
    # SGLang's DSpark needs markov_rank > 0: a rank-1 head of zeros adds exactly nothing
    res = export_draft(ckpt, tmp_path / "sg", "sglang", target=target, target_path=TINY)
    cfg = json.loads((tmp_path / "sg" / "config.json").read_text())
    assert (cfg["markov_rank"], cfg["dflash_config"]["markov_rank"], cfg["enable_confidence_head"]) == (1, 1, False)
    w = load_file(str(tmp_path / "sg" / "model.safetensors"))
    assert not w["markov_head.markov_w1.weight"].any() and not w["markov_head.markov_w2.weight"].any()
    assert any("rank-1 Markov head of zeros" in x for x in res.warnings)
    back = import_draft(tmp_path / "sg", target)
    assert back.algorithm == "dflash" and back.cfg.sequential_head == "none"
    same_blocks(loaded, back, target)


def test_rnn_head_to_vllm_is_written_with_a_serving_note(target, tmp_path):
    d = trained(target, "dspark", sequential_head="rnn", seed=3)
    ckpt = save(d, tmp_path / "ckpt")
    res = export_draft(ckpt, tmp_path / "v", "vllm", target=target, target_path=TINY)
    assert not res.dropped and res.verified["engine_max_abs_diff"] < 1e-4
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    assert (cfg["markov_rank"], cfg["markov_head_type"], cfg["enable_confidence_head"]) == (8, "rnn", True)
    card = (tmp_path / "v" / "README.md").read_text()
    assert "vLLM 0.34 serves the vanilla Markov head only" in card and "SGLang" in card
    back = import_draft(tmp_path / "v", target)
    assert back.cfg.sequential_head == "rnn"
    same_blocks(d, back, target)


def test_confidence_head_without_sequential_head_refused_unless_dropped(target, tmp_path):
    d = trained(target, "dspark", sequential_head="none", seed=3)
    ckpt = save(d, tmp_path / "ckpt")
    for fmt in ("vllm", "sglang"):
        with pytest.raises(ExportUnsupported, match="draft.confidence_head=false") as e:
            export_draft(ckpt, tmp_path / fmt, fmt, target=target)
        assert "allow-drop-heads" in str(e.value) and not (tmp_path / fmt).exists()
    res = export_draft(ckpt, tmp_path / "v", "vllm", target=target, allow_drop_heads=True)
    assert res.dropped and "reimport_max_abs_diff" not in res.verified
    assert "[!WARNING]" in (tmp_path / "v" / "README.md").read_text()
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    assert (cfg["markov_rank"], cfg["enable_confidence_head"]) == (0, False)
    assert not any(k.startswith(("markov_head", "confidence_head"))
                   for k in load_file(str(tmp_path / "v" / "model.safetensors")))
    # what is left is exactly the trained backbone
    backbone = build_drafter(target, DraftConfig(algorithm="dflash", num_layers=1, gamma=4,
                                                 mask_token_id=d.mask_token_id))
    missing, _ = backbone.load_state_dict(d.state_dict(), strict=False)
    assert not missing
    same_blocks(backbone.eval(), import_draft(tmp_path / "v", target), target)


def test_native_eagle3_only_hf(target, tmp_path):
    """The native Eagle3 layout exports only to hf (engine layout: tests/unit/test_export_eagle3.py)."""
    d = trained(target, "eagle3", seed=4, ttt_steps=2)
    ckpt = save(d, tmp_path / "ckpt")
    for fmt in ("vllm", "sglang"):
        with pytest.raises(ExportUnsupported, match="in_proj") as e:
            export_draft(ckpt, tmp_path / fmt, fmt, target=target)
        assert "q/k RMSNorm" in str(e.value) and "draft.eagle3_layout=engine" in str(e.value)
        assert not (tmp_path / fmt).exists()
    res = export_draft(ckpt, tmp_path / "hf", "hf", target=target)
    assert res.verified["reimport_max_abs_diff"] == 0.0
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()


def test_hf_model_card_lists_run_and_tau(target, tmp_path):
    from deepspec.config import load_config, to_yaml
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_5"
    cfg = load_config(["target.path=tiny:llama", "target.dtype=float32", "target.layer_ids=[1,2]",
                       "data.source=jsonl", "data.path=/data/prompts.jsonl"])
    save(trained(target, "dspark"), ckpt, to_yaml(cfg))
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "results.json").write_text(json.dumps(
        {"gamma": 4, "overall": {"tau": 3.217, "acceptance_rate": 0.61}, "speed": {"speedup": 1.9},
         "benchmarks": {"gsm8k": {"all_turns": {"tau": 3.5}}}, "setup": {"warp": "greedy"}}))
    export_draft(ckpt, tmp_path / "hf", "hf")                 # target from run.yaml
    card = (tmp_path / "hf" / "README.md").read_text()
    for needle in ("dspark draft for tiny:llama", "| γ (block size / draft tokens per round) | 4 |",
                   "[1, 2]", "/data/prompts.jsonl", "| source | `jsonl` |", "τ = 3.217", "| gsm8k | 3.500 |",
                   target.fingerprint()["weights_sha256"]):
        assert needle in card, needle
    assert (tmp_path / "hf" / "config.json").read_bytes() == (ckpt / "config.json").read_bytes()


def test_export_refuses_other_target_and_bad_embeddings(target, tmp_path):
    ckpt = save(trained(target, "dspark"), tmp_path / "ckpt")
    with pytest.raises(ExportError, match="different target"):
        export_draft(ckpt, tmp_path / "v", "vllm", target=tiny_target("tiny:llama:seed=1"))
    gemma = tiny_target("tiny:gemma3")               # scales its input embeddings by sqrt(hidden)
    g_ckpt = save(trained(gemma, "dspark"), tmp_path / "g")
    with pytest.raises(ExportUnsupported, match="scales its input embeddings"):
        export_draft(g_ckpt, tmp_path / "gv", "vllm", target=gemma)
    assert not (tmp_path / "v").exists() and not (tmp_path / "gv").exists()


def test_self_check_and_import_catch_broken_exports(target, tmp_path):
    d = trained(target, "dspark", sequential_head="markov", seed=6)
    ckpt = save(d, tmp_path / "ckpt")
    out = tmp_path / "v"
    export_draft(ckpt, out, "vllm", target=target)
    w = load_file(str(out / "model.safetensors"))
    w["layers.0.self_attn.k_norm.weight"] = w["layers.0.self_attn.k_norm.weight"].flip(0)   # a mis-mapped tensor
    save_file(w, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match="self-check failed"):
        verify_export(out, "vllm", d, target, nothing_dropped=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["aux_hidden_state_layer_ids"] = [1, 2]        # off by one: ours would be [0, 1]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ImportUnsupported, match=r"target.layer_ids=\[0, 1\]"):
        import_draft(out, target)


def test_cli_export_exit_codes(target, tmp_path, capsys):
    ckpt = save(trained(target, "dspark", sequential_head="rnn"), tmp_path / "ckpt")
    tgt = ["--target-path", TINY, "target.dtype=float32", "--target", "layer_ids=[1,2]"]
    assert export_main(["--to", "sglang", str(ckpt), str(tmp_path / "sg"), *tgt]) == 0
    assert "self-check" in capsys.readouterr().out
    ablation = save(trained(target, "dspark", anchor_feature=True), tmp_path / "ablation")
    assert export_main(["--to", "vllm", str(ablation), str(tmp_path / "v"), *tgt]) == 3
    assert "retrain with draft.anchor_feature=false" in capsys.readouterr().err.lower()
    assert export_main(["--to", "sglang", str(ckpt), str(tmp_path / "sg"), *tgt]) == 2     # exists, no --force
    assert "exists" in capsys.readouterr().err


def test_engine_exports_refuse_a_mask_token_that_is_a_real_token(target, tmp_path):
    """A mask token that is the end-of-turn token (engines stop a block at it) or an ordinary token is refused,
    naming the id to retrain with; every setting at fault is named in one refusal."""
    from deepspec.targets.mask_token import choose_mask_token, target_tokens
    best = choose_mask_token(*target_tokens(target))[0]
    eos = target.tokenizer.eos_token_id
    for mask, needle in ((eos, "stop token"), (100, "ordinary vocabulary token")):
        ckpt = save(trained(target, "dspark", mask_token_id=mask), tmp_path / f"m{mask}")
        for fmt in ("vllm", "sglang"):
            with pytest.raises(ExportUnsupported, match=needle) as e:
                export_draft(ckpt, tmp_path / f"{fmt}{mask}", fmt, target=target)
            assert f"Retrain with draft.mask_token_id={best} to export it" in str(e.value)
            assert not (tmp_path / f"{fmt}{mask}").exists()
        export_draft(ckpt, tmp_path / f"hf{mask}", "hf", target=target)        # our own engine takes any mask
    both = save(trained(target, "dspark", mask_token_id=eos, anchor_feature=True), tmp_path / "both")
    with pytest.raises(ExportUnsupported) as e:
        export_draft(both, tmp_path / "v", "vllm", target=target)
    assert f"Retrain with draft.anchor_feature=false draft.mask_token_id={best} to export it" in str(e.value)
    assert {p[0] for p in e.value.problems} == {"draft.anchor_feature=true", f"draft.mask_token_id={eos}"}
