"""bench/cache_converged.py end to end on a tiny target: a lossless cache and its fp8 transcode, the same
drafter trained on each, scored on the lossless held-out split.  Asserts consistency, not quality: the
baseline's score on lossless features is its trainer's own held-out evaluation."""
from __future__ import annotations

import json

import pytest
import torch

from deepspec.cache import CacheReader
from deepspec.cache.transcode import transcode_cache
from deepspec.cache.writer import build_cache
from deepspec.targets import load_target
from deepspec.train.loop import run as train_run
from tests.support.synthetic import tiny_cache_config, write_regen_jsonl

pytestmark = pytest.mark.integration

TRAIN = ["draft=dspark", "draft.num_layers=1", "draft.gamma=3", "draft.head_rank=16", "seed=7",
         "train.strategy=single", "train.global_batch_sequences=2", "train.micro_batch_sequences=2",
         "train.anchors_per_sequence=4", "train.max_steps=2", "train.save_every=0", "train.eval_every=2",
         "data.heldout_fraction=0.25", "train.bf16=false", "train.decode_eval_every=0"]


def test_converged_gate_record(tmp_path, bench_module):
    torch.set_num_threads(1)
    write_regen_jsonl(tmp_path / "regen.jsonl", 12, seed=5, max_words=30)
    cfg = tiny_cache_config(tmp_path, "bf16", **{"cache.encode_threads": 1})
    target = load_target(cfg.target)
    bf16 = build_cache(cfg, target=target, progress=False)
    fp8 = transcode_cache(bf16, tmp_path / "cache-fp8", tiny_cache_config(tmp_path, "fp8").cache, progress=False)
    runs = {}
    for label, cache in (("bf16", bf16), ("fp8", fp8)):
        run_dir = tmp_path / f"run-{label}"
        train = dict(o.split("=", 1) for o in TRAIN)
        train_run(tiny_cache_config(tmp_path, "bf16", **train, run_dir=str(run_dir), **{"cache.dir": str(cache)}))
        runs[label] = f"{label}={run_dir}:{cache}"
    mod = bench_module("cache_converged")
    out = tmp_path / "gate.json"
    assert mod.main(["--run", runs["bf16"], runs["fp8"], "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    base, lossy = rec["codecs"]["bf16"], rec["codecs"]["fp8"]
    assert rec["baseline"] == "bf16" and rec["heldout_sequences"] >= 1
    assert base["heldout_expected_tau_lossless_features"] == pytest.approx(base["heldout_expected_tau_own_cache"],
                                                                          abs=1e-6)
    assert base["heldout_ratio_lossless_features"] == 1.0 and lossy["heldout_expected_tau_lossless_features"] >= 1
    assert lossy["bytes_per_token"] < base["bytes_per_token"] == CacheReader(bf16).stats()["bytes_per_token"]
    assert lossy["codec"]["name"] == "fp8" and len(lossy["feature_cosine"]) == 2 and base["feature_cosine"] == []
    md = out.with_suffix(".md").read_text()
    assert "| bf16 | bf16 |" in md and "| fp8 | fp8 |" in md and "baseline" in md
