"""`deepspec check`: a draft against matching and deliberately mismatched targets."""
import json

import pytest
import torch

from deepspec.config import TargetConfig
from deepspec.config.draft import DraftConfig
from deepspec.drafts import build_drafter
from deepspec.export import export_draft
from deepspec.export.check import check_draft, diff_renderings, main as check_main
from deepspec.export.vocab_rank import W2
from deepspec.targets import load_target

CONV = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 12 times 7?"},
        {"role": "assistant", "content": "It is 84."},
        {"role": "user", "content": "Write a poem about the sea."},
        {"role": "assistant", "content": "The waves roll in."}]


def _target(path):
    return load_target(TargetConfig(path=path, dtype="float32", device="cpu", layer_ids=[1, 2]))


@pytest.fixture(scope="module")
def llama():
    return _target("tiny:llama")


@pytest.fixture(scope="module")
def ckpt(llama, tmp_path_factory):
    torch.manual_seed(0)
    d = build_drafter(llama, DraftConfig(algorithm="dspark", num_layers=1, gamma=4, head_rank=8))
    return d.save_pretrained(tmp_path_factory.mktemp("ck") / "step_1")


def _bad(report):
    return {f.name for f in report.mismatches}


def test_matching_target_passes(llama, ckpt, tmp_path):
    rep = check_draft(ckpt, llama, [CONV])
    assert rep.ok, rep.render()
    names = {f.name for f in rep.findings}
    assert {"target weights", "tokenizer", "chat template", "layer ids", "hidden size", "vocab size",
            "feature dim", "mask token", "chat render #0"} <= names
    # an export carries the training target's record (deepspec_export.json) and checks the same way
    export_draft(ckpt, tmp_path / "v", "vllm", target=llama, target_path="tiny:llama")
    assert check_draft(tmp_path / "v", llama, [CONV]).ok


def test_other_seed_is_a_weights_mismatch_only(ckpt):
    rep = check_draft(ckpt, _target("tiny:llama:seed=1"), [CONV])
    assert _bad(rep) == {"target weights"}
    assert "another model's hidden states" in rep.mismatches[0].detail


def test_other_family_mismatches_weights_tokenizer_template(ckpt):
    rep = check_draft(ckpt, _target("tiny:qwen3"), [CONV])
    assert {"target weights", "tokenizer", "chat template"} <= _bad(rep)
    assert not rep.ok


def test_edited_layer_ids(llama, ckpt, tmp_path):
    edited = tmp_path / "edited"
    edited.mkdir()
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["target"]["layer_ids"] = [0, 3]
    (edited / "config.json").write_text(json.dumps(cfg))
    rep = check_draft(edited, llama, [CONV])
    assert _bad(rep) == {"layer ids"}
    assert "target.layer_ids=[0, 3]" in rep.mismatches[0].detail
    cfg["target"]["layer_ids"] = [0, 1, 3]          # three layers: the fc input width differs too
    cfg["target"]["feature_dim"] = 3 * 64
    (edited / "config.json").write_text(json.dumps(cfg))
    assert _bad(check_draft(edited, llama, [CONV])) == {"layer ids", "feature dim"}


def test_server_template_kwargs_that_change_the_prompt_are_reported():
    qwen = _target("tiny:qwen3")
    assert diff_renderings(qwen.tokenizer, CONV, {}, {}) == []
    diffs = diff_renderings(qwen.tokenizer, CONV, {}, {"enable_thinking": False})
    # the earlier assistant turn is rendered without a think block in training, the server adds an empty one
    assert [d["turn"] for d in diffs] == [2]
    d = diffs[0]
    assert qwen.tokenizer.convert_ids_to_tokens(d["server_id"]) == "<think>"
    assert "<think>" in d["server"] and "It is 84" in d["training"]
    assert d["position"] == len(qwen.encode_chat(CONV[:2], add_generation_prompt=True).input_ids)


def test_cli_exit_codes(ckpt, capsys):
    base = [str(ckpt), "target.dtype=float32", "target.layer_ids=[1,2]"]
    assert check_main([*base, "--target-path", "tiny:llama"]) == 0
    assert "all checks passed" in capsys.readouterr().out
    assert check_main([*base, "--target-path", "tiny:llama:seed=1", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and [f["name"] for f in report["findings"] if not f["ok"]] == ["target weights"]
    assert check_main([str(ckpt)]) == 2                  # no run.yaml and no target given
    assert "no target" in capsys.readouterr().err


# -- reduced draft vocabularies ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pruned_run(llama, tmp_path_factory):
    """RUN/checkpoints/step_1 of a dspark draft with draft.vocab_size=60, RUN/draft_vocab.json, vLLM and SGLang
    exports."""
    from deepspec.data.vocab import save_vocab
    run = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    d = build_drafter(llama, DraftConfig(algorithm="dspark", num_layers=1, gamma=4, head_rank=8, vocab_size=60))
    ids = torch.randperm(llama.vocab_size, generator=torch.Generator().manual_seed(3))[:60].sort().values
    d.set_draft_vocab(ids)
    ckpt = d.save_pretrained(run / "checkpoints" / "step_1")
    save_vocab(run / "draft_vocab.json", ids.numpy(), vocab_size=llama.vocab_size,
               tokenizer_fingerprint=llama.fingerprint()["tokenizer_sha256"], coverage_value=0.9, source="test")
    for fmt in ("vllm", "sglang"):
        export_draft(ckpt, run / fmt, fmt, target=llama, target_path="tiny:llama")
    return run, ckpt, ids


def _vocab(rep):
    return next(f for f in rep.findings if f.name == "draft vocabulary")


def test_reduced_vocabulary_checkpoint_and_export_pass(llama, pruned_run):
    run, ckpt, ids = pruned_run
    for where in (ckpt, run / "vllm", run / "sglang"):
        rep = check_draft(where, llama, [CONV])
        assert rep.ok, rep.render()
        f = _vocab(rep)
        assert f.data["draft_vocab_size"] == 60 and "made with this tokenizer" in f.detail
    exported = json.loads((run / "vllm" / "draft_vocab.json").read_text())     # the export carries the run's file
    assert exported["ids"] == ids.tolist() and exported["coverage"] == 0.9
    assert "| draft vocabulary | 60 of" in (run / "vllm" / "README.md").read_text()


def test_full_vocabulary_has_no_vocabulary_finding(llama, ckpt):
    assert not any(f.name == "draft vocabulary" for f in check_draft(ckpt, llama, [CONV]).findings)


@pytest.mark.parametrize("which, w_edit, cfg_edit, needle", [
    ("vllm", lambda w: w["d2t"].__setitem__(3, w["d2t"][4] + 1), None, "d2t: .*strictly increasing"),
    ("vllm", lambda w: w["t2d"].__setitem__(w["t2d"].nonzero()[0], False), None, "t2d marks 59 target tokens"),
    ("vllm", lambda w: w.update(t2d=w["t2d"].roll(1)), None, "d2t and t2d disagree"),
    ("vllm", None, lambda c: c.update(draft_vocab_size=61), r"d2t has shape \[60\], draft_vocab_size is 61"),
    ("vllm", lambda w: w["lm_head.weight"].mul_(3), None, "lm_head.weight is not this target's LM head"),
    ("ckpt", lambda w: w.update(draft_vocab=w["draft_vocab"].flip(0)), None, "draft_vocab: token ids must be strictly"),
    ("sglang", lambda w: w[W2][:, -1].clamp_(min=-1.0), None, "scores the full target vocabulary"),
    ("sglang", lambda w: w[W2][:, -1].__setitem__(slice(0, 3), 0.0), None, "lists other tokens than the draft"),
    ("sglang", lambda w: w["confidence_head.proj.weight"][0, -1].fill_(1.0), None, "confidence_head.proj.weight"),
    ("ckpt", None, lambda c: c["draft"].update(vocab_size=59), "draft.vocab_size=59"),
])
def test_bad_vocabulary_maps_are_one_finding(llama, pruned_run, tmp_path, edited_draft, which, w_edit, cfg_edit,
                                             needle):
    run, ckpt, _ = pruned_run
    bad = edited_draft(ckpt if which == "ckpt" else run / which, tmp_path / "bad", cfg_edit, w_edit)
    rep = check_draft(bad, llama, [CONV])
    f = _vocab(rep)
    assert not f.ok and any(name in f.detail for name in ("model.safetensors", "config.json", "draft_vocab.json"))
    import re
    assert re.search(needle, f.detail), f.detail


def test_vocabulary_file_of_another_tokenizer_is_reported(llama, pruned_run, tmp_path, edited_draft, capsys):
    from deepspec.data.vocab import save_vocab
    run, ckpt, ids = pruned_run
    bad = edited_draft(run / "vllm", tmp_path / "v")
    save_vocab(bad / "draft_vocab.json", ids.numpy(), vocab_size=llama.vocab_size, tokenizer_fingerprint="f" * 64,
               coverage_value=0.9, source="elsewhere")
    f = _vocab(check_draft(bad, llama, [CONV]))
    assert not f.ok and "made with another tokenizer" in f.detail and "draft_vocab.json" in f.detail
    # other ids than the draft holds
    save_vocab(bad / "draft_vocab.json", (ids + 1).clamp(max=llama.vocab_size - 1).unique().numpy(),
               vocab_size=llama.vocab_size, tokenizer_fingerprint=None, coverage_value=0.9, source="x")
    assert "lists other tokens" in _vocab(check_draft(bad, llama, [CONV])).detail
    # the command line: one MISMATCH line, exit 1
    save_vocab(bad / "draft_vocab.json", ids.numpy(), vocab_size=llama.vocab_size, tokenizer_fingerprint="f" * 64,
               coverage_value=0.9, source="elsewhere")
    assert check_main([str(bad), "--target-path", "tiny:llama", "target.dtype=float32", "target.layer_ids=[1,2]"]) == 1
    out = capsys.readouterr().out
    assert sum("[MISMATCH] draft vocabulary" in line for line in out.splitlines()) == 1
