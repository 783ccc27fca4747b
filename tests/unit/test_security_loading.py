"""Untrusted files: no pickle is ever loaded, and remote code runs only when explicitly enabled.

* A pickle payload whose ``__reduce__`` would create a marker file is planted in draft
  checkpoints, training checkpoints and engine-format drafts — next to the real files
  (``pytorch_model.bin``, ``training_state/*.pt``) and in place of the files the loaders read.
  Loading either ignores it or refuses it with the project's error; the marker never appears.
* ``target.trust_remote_code`` / ``data.trust_remote_code`` are off by default; a local target
  directory shipping custom model + tokenizer code (``auto_map``) loads with the built-in classes
  and never runs that code, unless the flag is set — then a warning is logged and the flag
  reaches transformers (the code runs).
* A source audit: no ``torch.load`` / ``pickle.load`` / ``np.load`` anywhere in the package.
"""
from __future__ import annotations

import json
import logging
import pickle
import re
from pathlib import Path

import pytest
import torch

from deepspec.config import DataConfig, DraftConfig, TargetConfig, load_config
from deepspec.drafts import DraftCheckpointError, build_drafter, load_drafter
from deepspec.train import checkpoint as ckpt

PKG = Path(__file__).resolve().parents[2] / "deepspec"


class _Payload:
    """Unpickling this creates ``marker`` (stands in for arbitrary code execution)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(path: Path, marker: Path, kind: str = "pickle") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "pickle":
        path.write_bytes(pickle.dumps({"weights": _Payload(marker)}))
    else:   # what torch.save writes: a zip holding the pickle
        torch.save({"state_dict": _Payload(marker)}, path)
    assert not marker.exists()


def _drafter(target):
    torch.manual_seed(0)
    return build_drafter(target, DraftConfig(algorithm="dspark", gamma=3, num_layers=1, head_rank=8))


# -- draft checkpoints (save_pretrained / from_pretrained / draft.init_from) ---------------------
def test_draft_checkpoint_never_unpickles(tiny_llama, tmp_path):
    marker = tmp_path / "PWNED"
    d = _drafter(tiny_llama).save_pretrained(tmp_path / "draft")
    ref = load_drafter(d, tiny_llama).state_dict()
    # next to the real files: ignored
    for name in ("pytorch_model.bin", "model.bin", "training_args.bin", "optimizer.pt", "training_state/rng.pt"):
        _plant(d / name, marker, "torch" if name.endswith(".pt") else "pickle")
    got = load_drafter(d, tiny_llama).state_dict()
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    # in place of the weights / the config: refused with the project's error
    weights = (d / "model.safetensors").read_bytes()
    for kind in ("pickle", "torch"):
        _plant(d / "model.safetensors", marker, kind)
        with pytest.raises(DraftCheckpointError, match="safetensors"):
            load_drafter(d, tiny_llama)
        with pytest.raises(DraftCheckpointError):
            build_drafter(tiny_llama, DraftConfig(algorithm="dspark", gamma=3, num_layers=1, head_rank=8,
                                                  init_from=str(d)))
    (d / "model.safetensors").write_bytes(weights)
    _plant(d / "config.json", marker)
    with pytest.raises(DraftCheckpointError, match="config.json"):
        load_drafter(d, tiny_llama)
    assert not marker.exists()


# -- training checkpoints (resume state) ------------------------------------------------------------
def test_training_state_never_unpickles(tiny_llama, tmp_path):
    marker = tmp_path / "PWNED"
    drafter = _drafter(tiny_llama)
    w = {k: v.detach().float() for k, v in drafter.named_parameters()}
    path = ckpt.save_checkpoint(tmp_path / "ckpts", 2, save_draft=drafter.save_pretrained, weights=w,
                                optimizer={k: {"exp_avg": torch.zeros_like(v)} for k, v in w.items()},
                                meta={"sequences_consumed": 8}, rng=[ckpt.capture_rng()], config_yaml="seed: 0\n")
    ts = path / "training_state"
    for name in ("optimizer.pt", "scheduler.pt", "trainer_state.bin", "rng_state.pth"):   # HF-Trainer-style files
        _plant(ts / name, marker, "torch")
    assert ckpt.load_training_state(path).step == 2
    assert ckpt.latest_checkpoint(tmp_path / "ckpts") == path
    for name in ("master_weights.safetensors", "optimizer.safetensors", "rng.safetensors", "meta.json", "rng.json"):
        good = (ts / name).read_bytes()
        for kind in ("pickle", "torch"):
            _plant(ts / name, marker, kind)
            with pytest.raises(ckpt.CheckpointError, match=name.replace(".", r"\.")):
                ckpt.load_training_state(path)
        (ts / name).write_bytes(good)
    assert ckpt.load_training_state(path).step == 2
    assert not marker.exists()


def test_engine_format_import_never_unpickles(tmp_path):
    from deepspec.export.importers import import_sglang, import_vllm
    from deepspec.export.errors import ExportError
    marker = tmp_path / "PWNED"
    d = tmp_path / "engine_draft"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"speculators_model_type": "dspark"}))
    _plant(d / "model.safetensors", marker, "torch")
    for fn in (import_vllm, import_sglang):
        with pytest.raises(ExportError, match="safetensors"):
            fn(d, None)
    assert not marker.exists()


def test_target_bin_weights_load_with_weights_only(tmp_path):
    """A target directory with only ``pytorch_model.bin``: transformers loads it with
    ``torch.load(weights_only=True)``, which refuses the payload instead of running it."""
    from deepspec.targets import load_target
    from deepspec.targets.tiny import save_tiny
    marker = tmp_path / "PWNED"
    d = save_tiny("llama", tmp_path / "target")
    (d / "model.safetensors").unlink()
    _plant(d / "pytorch_model.bin", marker, "torch")
    with pytest.raises(pickle.UnpicklingError, match="[Ww]eights only"):
        load_target(TargetConfig(path=str(d), dtype="float32", device="cpu"))
    assert not marker.exists()


def test_no_unsafe_deserialisation_in_the_package():
    """Audit: nothing in deepspec can unpickle a user file (torch.load, pickle.load(s), np.load, …)."""
    unsafe = re.compile(r"\btorch\.load\(|\bpickle\.loads?\(|\bnp\.load\(|\bnumpy\.load\(|allow_pickle\s*=\s*True|"
                        r"weights_only\s*=\s*False|\bjoblib\.load\(|\bdill\.|\bcloudpickle\.|\bmarshal\.loads?\(|"
                        r"\byaml\.load\(|\byaml\.unsafe_load\(|(?<![\w.])eval\(|(?<![\w.])exec\(")
    hits = []
    for f in sorted(PKG.rglob("*.py")):
        for n, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if unsafe.search(code):
                hits.append(f"{f.relative_to(PKG.parent)}:{n}: {line.strip()}")
    assert not hits, "unsafe deserialisation:\n" + "\n".join(hits)


# -- trust_remote_code ------------------------------------------------------------------------------
def test_remote_code_flags_are_off_by_default():
    cfg = load_config([])
    assert cfg.target.trust_remote_code is False and cfg.data.trust_remote_code is False
    assert TargetConfig().trust_remote_code is False and DataConfig().trust_remote_code is False


@pytest.fixture
def remote_code_target(tmp_path, monkeypatch):
    """A tiny local target whose config/tokenizer point at custom code that leaves marker files."""
    import transformers.dynamic_module_utils as dmu
    from deepspec.targets.tiny import save_tiny
    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(tmp_path / "hf_modules"))   # keep ~/.cache clean
    d = save_tiny("llama", tmp_path / "target")
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "custom_model.CustomForCausalLM"}
    (d / "config.json").write_text(json.dumps(cfg))
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["auto_map"] = {"AutoTokenizer": [None, "custom_tok.CustomTokenizerFast"]}
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    markers = {"model": tmp_path / "MODEL_CODE_RAN", "tokenizer": tmp_path / "TOKENIZER_CODE_RAN"}
    (d / "custom_model.py").write_text(
        f"from pathlib import Path\nPath({str(markers['model'])!r}).touch()\n"
        "from transformers import LlamaForCausalLM\nclass CustomForCausalLM(LlamaForCausalLM):\n    pass\n")
    (d / "custom_tok.py").write_text(
        f"from pathlib import Path\nPath({str(markers['tokenizer'])!r}).touch()\n"
        "from transformers import PreTrainedTokenizerFast\nclass CustomTokenizerFast(PreTrainedTokenizerFast):\n"
        "    pass\n")
    return d, markers


def test_target_remote_code_runs_only_when_enabled(remote_code_target, caplog):
    from deepspec.targets import load_target
    d, markers = remote_code_target
    with caplog.at_level(logging.WARNING, logger="deepspec"):
        t = load_target(TargetConfig(path=str(d), dtype="float32", device="cpu"))
    assert type(t.model).__name__ == "LlamaForCausalLM" and "Custom" not in type(t.tokenizer).__name__
    assert not any(m.exists() for m in markers.values()), "remote code ran with trust_remote_code=false"
    assert not [r for r in caplog.records if "trust_remote_code" in r.getMessage()]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deepspec"):
        t = load_target(TargetConfig(path=str(d), dtype="float32", device="cpu", trust_remote_code=True))
    warned = [r for r in caplog.records if "trust_remote_code=true" in r.getMessage()]
    assert warned and warned[0].levelno == logging.WARNING and str(d) in warned[0].getMessage()
    # the flag reached both transformers calls: the shipped classes were used
    assert type(t.model).__name__ == "CustomForCausalLM" and type(t.tokenizer).__name__ == "CustomTokenizerFast"
    assert all(m.exists() for m in markers.values())


def test_dataset_remote_code_flag_is_passed_through_and_logged(tmp_path, monkeypatch, caplog):
    """`data.trust_remote_code` goes to `datasets.load_dataset` only when set (and is logged then); a
    loading script shipped in a local dataset directory is never executed, flag or not."""
    import datasets
    from deepspec.data import DataError, load_conversations
    d = tmp_path / "ds"
    d.mkdir()
    (d / "train.jsonl").write_text(json.dumps({"id": "a", "turns": ["q"]}) + "\n")
    calls = []
    real = datasets.load_dataset

    def spy(*a, **kw):        # records the call, then runs the real loader
        calls.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(datasets, "load_dataset", spy)
    with caplog.at_level(logging.WARNING, logger="deepspec"):
        convs, _ = load_conversations(DataConfig(source="hf", hf_name=str(d), hf_split="train"))
    assert [c.id for c in convs] == ["a"] and "trust_remote_code" not in calls[-1]
    assert not [r for r in caplog.records if "trust_remote_code" in r.getMessage()]
    marker = tmp_path / "SCRIPT_RAN"
    (d / "ds.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).touch()\n")
    for trust in (False, True):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="deepspec"):
            with pytest.raises(DataError, match="cannot load the dataset"):   # datasets >= 4 runs no scripts
                load_conversations(DataConfig(source="hf", hf_name=str(d), hf_split="train", trust_remote_code=trust))
        assert calls[-1].get("trust_remote_code") is (True if trust else None)
        assert any("data.trust_remote_code=true" in r.getMessage() and r.levelno == logging.WARNING
                   for r in caplog.records) == trust
    assert not marker.exists()
