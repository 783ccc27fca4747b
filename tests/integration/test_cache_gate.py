"""The cache-size gate end to end on a tiny target: regen JSONL written here → caches with the
lossless and two lossy codecs → same drafter / seed / steps on each → eval on the same prompts
→ gate.json + gate.md.  No number is asserted beyond structure and sanity (τ ≥ 1, bytes)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from deepspec.plan.gate import parse_codec, run
from deepspec.config import load_config

pytestmark = pytest.mark.integration


def _write_regen(path):
    # a handful of "regenerated" conversations, written directly
    convs = [
        ("What is 2 + 3?", "2 + 3 = 5. The answer is 5."),
        ("Name a colour.", "Blue is a colour. Red is a colour too."),
        ("Write a line of Python.", "print('hello world')"),
        ("Count to five.", "1, 2, 3, 4, 5."),
        ("Say hello.", "Hello! How can I help you today?"),
        ("What is the capital of France?", "The capital of France is Paris."),
        ("Add 10 and 7.", "10 + 7 = 17, so the answer is 17."),
        ("Give me a fruit.", "An apple is a fruit. So is a banana."),
    ]
    with open(path, "w") as f:
        for i, (u, a) in enumerate(convs):
            f.write(json.dumps({"id": f"g{i}", "conversations": [{"role": "user", "content": u},
                                                                 {"role": "assistant", "content": a}],
                                "meta": {"written_by": "test"}}) + "\n")


def test_parse_codec():
    assert parse_codec("lowrank:rank=8:coef=fp8") == ("lowrank", {"rank": 8, "lowrank_coef": "fp8"}, "lowrank-r8-fp8")
    assert parse_codec("bf16") == ("bf16", {}, "bf16")
    with pytest.raises(Exception, match="unknown parameter"):
        parse_codec("fp8:bogus=1")


def test_gate_end_to_end(tmp_path, eval_data_dir):
    torch.set_num_threads(1)
    regen = tmp_path / "regen.jsonl"
    _write_regen(regen)
    cfg = load_config([
        f"run_dir={tmp_path}/run", "target.path=tiny:llama", "target.dtype=float32", "target.device=cpu",
        "target.num_feature_layers=2", "draft=dspark", "draft.num_layers=1", "draft.gamma=3", "draft.head_rank=16",
        "data.max_length=64", "cache.shard_samples=4", "cache.calib_tokens=200", "seed=7",
        "train.strategy=single", "train.global_batch_sequences=2", "train.micro_batch_sequences=2",
        "train.anchors_per_sequence=4", "train.max_steps=2", "train.save_every=0", "train.eval_every=0",
        "data.heldout_fraction=0.25", "train.bf16=false",
        f"eval.data_dir={eval_data_dir}", "eval.benchmarks=[gsm8k]", "eval.max_samples=1",
        "eval.max_new_tokens=8", "eval.temperature=0", "eval.progress=false", "eval.measure_baseline=false",
        "eval.warmup=false"])
    rep = run(cfg, codecs=["bf16", "bf16:layout=plain", "fp8", "lowrank:rank=8"], regen_path=regen,
              out_dir=tmp_path / "gate")
    rows = {r["codec"]: r for r in rep["codecs"]}
    assert list(rows) == ["bf16", "bf16-plain", "fp8", "lowrank-r8"]
    assert rep["baseline"] == "bf16" and rep["baseline_lossless"]
    for label, r in rows.items():
        assert r["tau_ratio"] == pytest.approx(r["tau"] / rows["bf16"]["tau"])   # each codec against the lossless one
        assert r["within_tolerance"] == (abs(r["tau_ratio"] - 1) <= rep["tolerance"])
        assert r["raw_bytes_per_token"] == 6 + 2 * 64 * 3
        assert r["tokens"] == rows["bf16"]["tokens"]      # same regen, same samples
        assert (tmp_path / "gate" / f"run-{label}").is_dir() and (tmp_path / "gate" / f"eval-{label}").is_dir()
    # a second lossless layout holds the same values: the same drafter, the same τ, teacher-forced and in eval
    assert rows["bf16-plain"]["tau"] == rows["bf16"]["tau"] and rows["bf16-plain"]["heldout_tau_ratio"] == 1.0
    assert rows["bf16-plain"]["train_final"]["train/loss"] == rows["bf16"]["train_final"]["train/loss"]
    # the lossy codecs' features differ, so their drafters do: the gate measures a real change
    assert rows["fp8"]["train_final"]["train/loss"] != rows["bf16"]["train_final"]["train/loss"]
    # teacher-forced on the same held-out sequences with lossless features, paired across codecs
    held = [r["heldout"] for r in rows.values()]
    assert all(h["sequences"] == held[0]["sequences"] > 0 and h["positions"] == held[0]["positions"] > 0 for h in held)
    assert all(len(h["accept_rate"]) == 3 for h in held)
    assert rows["fp8"]["features_bytes_per_token"] < rows["bf16"]["features_bytes_per_token"]
    assert rows["lowrank-r8"]["features_bytes_per_token"] < rows["fp8"]["features_bytes_per_token"]
    # last_hidden is lossless in all three: identical bytes
    assert rows["fp8"]["last_hidden_bytes_per_token"] == rows["bf16"]["last_hidden_bytes_per_token"]
    assert rows["fp8"]["spec"]["name"] == "fp8" and rows["lowrank-r8"]["spec"]["params"]["rank"] == 8
    saved = json.loads((tmp_path / "gate" / "gate.json").read_text())
    assert [r["codec"] for r in saved["codecs"]] == list(rows)
    md = (tmp_path / "gate" / "gate.md").read_text()
    assert "| `lowrank-r8` |" in md and "τ / baseline" in md
