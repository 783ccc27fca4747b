"""`deepspec check`: a draft against matching and deliberately mismatched targets."""
import json

import pytest
import torch

from deepspec.config import TargetConfig
from deepspec.config.draft import DraftConfig
from deepspec.drafts import build_drafter
from deepspec.export import export_draft
from deepspec.export.check import check_draft, diff_renderings, main as check_main
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
