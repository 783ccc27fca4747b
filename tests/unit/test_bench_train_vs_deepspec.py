"""bench/train_vs_deepspec.py: our side runs without DeepSpec; the record is complete and consistent."""
import json
import math
import statistics

import torch

TINY = ["--hidden", "32", "--heads", "4", "--kv-heads", "2", "--intermediate", "64", "--vocab", "128",
        "--target-layers", "6", "--feature-layers", "2", "--seq-len", "24", "--anchors", "3", "--seqs", "2",
        "--gamma", "3", "--rank", "4", "--steps", "3", "--warmup", "1", "--rounds", "1", "--threads", "1"]


def test_our_side_alone_writes_a_consistent_record(tmp_path, bench_module, capsys):
    mod = bench_module("train_vs_deepspec")
    out = tmp_path / "rec.json"
    assert mod.main(TINY + ["--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["bench"] == "train_vs_deepspec" and rec["deepspec"] is None and "ratios" not in rec
    assert {"cpu", "cpus", "platform", "python", "torch", "transformers"} <= set(rec["machine"])
    c = rec["config"]
    assert (c["hidden"], c["vocab"], c["gamma"], c["steps"], c["warmup"]) == (32, 128, 3, 3, 1)
    assert len(c["layer_ids"]) == 2 and all(0 <= i < 6 for i in c["layer_ids"])
    run, defaults = rec["runs"]
    assert run["side"] == "ours" and run["round"] == 1 and run["package"].endswith("deepspec")
    assert defaults["side"] == "ours_defaults" and defaults["optimizer"] == "fused AdamW"
    assert isinstance(defaults["bf16_autocast"], bool)
    assert run["positions_per_step"] == 3 * 3 * 2 and len(run["step_s"]) == 3
    rates = [run["positions_per_step"] / t for t in run["step_s"]]
    assert abs(run["positions_per_s"] - statistics.median(rates)) <= 0.01 * max(rates) + 0.1
    assert run["positions_per_s_min"] <= run["positions_per_s"] <= run["positions_per_s_max"]
    assert abs(run["added_rss_mb"] - (run["peak_rss_mb"] - run["baseline_rss_mb"])) < 0.2
    assert 0 < run["baseline_rss_mb"] <= run["peak_rss_mb"]
    assert run["trainable_params"] > 0 and math.isfinite(run["loss_first"]) and math.isfinite(run["loss_last"])
    s = rec["summary"]["ours"]
    assert s["runs"] == 1 and s["peak_rss_mb"] == run["peak_rss_mb"]
    assert s["positions_per_s_min"] <= s["positions_per_s"] <= s["positions_per_s_max"]
    table = capsys.readouterr().out
    assert "ours (dspark)" in table and "DeepSpec (DSpark)" not in table and "/ DeepSpec" not in table


def test_render_with_both_sides_shows_the_ratio_column(bench_module):
    mod = bench_module("train_vs_deepspec")
    side = lambda r, p: {"runs": 2, "positions_per_s": r, "positions_per_s_min": r - 10,  # noqa: E731
                         "positions_per_s_max": r + 10, "peak_rss_mb": p, "added_rss_mb": p / 2,
                         "baseline_rss_mb": p / 2}
    cfg = {"hidden": 576, "heads": 9, "kv_heads": 3, "vocab": 49152, "intermediate": 1536, "target_layers": 30,
           "layer_ids": [1, 7, 14, 20, 27], "layers": 1, "gamma": 7, "anchors": 16, "seqs": 4, "seq_len": 384,
           "rank": 64, "threads": 2, "steps": 25, "warmup": 2}
    rec = {"config": cfg, "machine": {"cpu": "x", "torch": "2"}, "notes": ["note A"],
           "summary": {"ours": side(200.0, 1500.0), "deepspec": side(300.0, 1700.0),
                       "ours_defaults": side(600.0, 1360.0)}}
    md = mod.render_train_vs_deepspec(rec)
    assert md.splitlines()[0] == ("| | DeepSpec (DSpark) | ours (dspark), fp32 | ours (dspark), trainer defaults | "
                                  "ours (dspark), fp32 / DeepSpec | ours (dspark), trainer defaults / DeepSpec |")
    assert "| draft positions/s, median (min–max) | 300 (290–310) | 200 (190–210) | 600 (590–610) | 0.67 | 2.00 |" in md
    assert "| peak RSS (MB) | 1,700 | 1,500 | 1,360 | 0.88 | 0.80 |" in md and "note A" in md and "V 49,152" in md


def test_dense_mask_for_old_checkouts(bench_module):
    """The mask patched into pre-PR-#41 DeepSpec: context before the anchor, own block, dropped rows -> key 0."""
    mod = bench_module("train_vs_deepspec")
    T, g = 6, 2
    m = mod._dense_mask(anchor_positions=torch.tensor([[2, 0]]), block_keep_mask=torch.tensor([[True, False]]),
                        seq_len=T, block_size=g, device=torch.device("cpu"))
    assert m.shape == (1, 1, 2 * g, T + 2 * g)
    ok = (m[0, 0] == 0)
    assert ok[0].tolist() == [True, True, False, False, False, False, True, True, False, False]
    assert ok[1].tolist() == ok[0].tolist()
    assert ok[2].tolist() == ok[3].tolist() == [True] + [False] * 9   # dropped block: key 0 only
