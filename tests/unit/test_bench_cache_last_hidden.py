"""`bench/cache_bench.py last-hidden`: what an fp8 last_hidden does to the target distribution, on a tiny
cache — a real measurement (nonzero, bounded) and a record that states it."""
from __future__ import annotations

import json

import torch

from bench.cache_bench import main
from deepspec.cache.writer import build_cache
from deepspec.targets import load_target
from tests.support.synthetic import tiny_cache_config, write_regen_jsonl


def test_last_hidden_mode_measures_the_fp8_target(tmp_path):
    torch.set_num_threads(1)
    write_regen_jsonl(tmp_path / "regen.jsonl", 6, seed=2, max_words=40)
    cfg = tiny_cache_config(tmp_path, "bf16", **{"cache.encode_threads": 1})
    cache = build_cache(cfg, target=load_target(cfg.target), progress=False)
    out = tmp_path / "rec.json"
    assert main(["last-hidden", str(cache), "--target", "tiny:llama", "--calib-tokens", "150",
                 "--tokens", "100", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["calib_tokens"] >= 150 and rec["tokens"] >= 100
    assert 0.0 < rec["tv_mean"] <= rec["tv_max"] <= 1.0 and rec["tv_p50"] <= rec["tv_p90"] <= rec["tv_max"]
    assert 0.0 < rec["top1_agreement"] <= 1.0
    assert rec["bf16_lse_gap_abs_max"] >= rec["bf16_lse_gap_abs_mean"] > 0.0
    lo, hi = rec["bf16_lse_mass_p10_p90"]
    assert 0.0 < lo <= hi
