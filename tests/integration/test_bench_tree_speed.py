"""bench/tree_speed.py end to end on a tiny target: chain and tree evals of one draft, the record's numbers."""
import json

import pytest
import torch


def test_tree_speed_record(tmp_path, eval_data_dir, bench_module):
    from deepspec.config import TargetConfig
    from deepspec.config.draft import DraftConfig
    from deepspec.drafts import build_drafter
    from deepspec.targets import load_target
    mod = bench_module("tree_speed")
    target = load_target(TargetConfig(path="tiny:llama", dtype="float32", device="cpu", num_feature_layers=2))
    torch.manual_seed(0)
    ckpt = build_drafter(target, DraftConfig(algorithm="dspark", gamma=3, num_layers=1, head_rank=8)).save_pretrained(
        tmp_path / "draft")
    out = tmp_path / "rec.json"
    mod.main(["--checkpoint", str(ckpt), "--settings", "chain@float32", "tree6x2@float32", "tree6x2l3@float32",
              "--benchmarks", "gsm8k", "mt-bench", "--max-samples", "2", "--max-new-tokens", "8",
              "--data-dir", str(eval_data_dir), "--resamples", "50", "--work", str(tmp_path / "work"),
              "--out", str(out), "--extra", "target.path=tiny:llama", "target.device=cpu",
              "target.num_feature_layers=2"])
    rec = json.loads(out.read_text())
    assert set(rec["settings"]) == {"chain@float32", "tree6x2@float32", "tree6x2l3@float32"}
    lk = rec["settings"]["tree6x2l3@float32"]
    assert lk["setup"]["policy"] == "tree(nodes=6, width=2, lookup=3..1)" and 0 <= lk["lookup_share"] <= 1
    assert lk["greedy_check"] == {"compared": 4, "matched": 4} and "lookup_share" not in rec["settings"]["tree6x2@float32"]
    tree, chain = rec["settings"]["tree6x2@float32"], rec["settings"]["chain@float32"]
    assert tree["setup"]["policy"] == "tree(nodes=6, width=2)" and chain["setup"]["policy"] == "fixed"
    for s in (tree, chain):
        assert s["greedy_check"] == {"compared": 4, "matched": 4}           # fp32: lossless, request for request
        assert s["speed"]["speedup_pooled"] > 0 and s["speed"]["plain_decode_ms_per_token"] > 0
    assert tree["speed"]["verified_tokens_per_round"] > chain["speed"]["verified_tokens_per_round"] - 1e-9
    r = rec["ratios"]["tree6x2@float32 / chain@float32"]
    assert r["ratio"] == pytest.approx(r["tau_a"] / r["tau_b"]) and len(r["ratio_ci95"]) == 2
    assert "tree6x2@float32" in out.with_suffix(".md").read_text()
    # --no-eval combines the finished evals into the same record, and names a setting that never ran
    again = tmp_path / "again.json"
    base = ["--checkpoint", str(ckpt), "--benchmarks", "gsm8k", "mt-bench", "--max-samples", "2",
            "--max-new-tokens", "8", "--data-dir", str(eval_data_dir), "--resamples", "50",
            "--work", str(tmp_path / "work"), "--no-eval"]
    mod.main(base + ["--settings", "chain@float32", "tree6x2@float32", "tree6x2l3@float32", "--out", str(again)])
    assert json.loads(again.read_text())["ratios"] == rec["ratios"]
    with pytest.raises(SystemExit, match="no finished eval of tree9x3@float32"):
        mod.main(base + ["--settings", "tree9x3@float32", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="treeNxW"):
        mod.parse_setting("tree6@float32")
    assert mod.parse_setting("tree16x8l3@bfloat16") == {"name": "tree16x8l3@bfloat16", "tree": (16, 8), "lookup": 3,
                                                         "lookup_min": 1, "dtype": "bfloat16"}
    assert mod.parse_setting("tree16x8l3m2@bfloat16")["lookup_min"] == 2
    with pytest.raises(SystemExit, match="1 ≤ M"):
        mod.parse_setting("tree16x8l2m3@bfloat16")
