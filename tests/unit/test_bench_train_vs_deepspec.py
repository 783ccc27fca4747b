"""bench/train_vs_deepspec.py: the interleaved speed A/B (our side alone here: DeepSpec is not vendored), the
DeepSpec side's attention mask, our held-out evaluation as the quality mode replays it, and the
time-to-equal-quality comparison."""
import json
import math

import pytest
import torch

TINY = ["--hidden", "32", "--heads", "4", "--kv-heads", "2", "--intermediate", "64", "--vocab", "128",
        "--target-layers", "6", "--feature-layers", "2", "--seq-len", "24", "--anchors", "3", "--seqs", "2",
        "--gamma", "3", "--rank", "4", "--steps", "3", "--warmup", "1"]


def test_our_side_alone_writes_a_consistent_interleaved_record(tmp_path, bench_module):
    mod = bench_module("train_vs_deepspec")
    out = tmp_path / "rec.json"
    assert mod.main(["speed", *TINY, "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["bench"] == "train_vs_deepspec" and "ratios" not in rec
    assert set(rec["summary"]) == {"ours_fp32", "ours_bf16"} and rec["config"]["positions"] == 3 * 3 * 2
    assert len(rec["load_avg_1m"]) == 1 + 3 and rec["quiet"] == (max(rec["load_avg_1m"]) < rec["quiet_load"])
    for key, s in rec["summary"].items():
        steps = rec["steps"][key]
        assert len(steps) == 3 and all(st["cpu"] > 0 and st["wall"] > 0 for st in steps)
        per_cpu = sorted(18 / st["cpu"] for st in steps)
        assert s["positions_per_cpu_s"] == pytest.approx(per_cpu[1], abs=0.06)          # the median of three
        assert s["positions_per_cpu_s_range"] == pytest.approx([per_cpu[0], per_cpu[-1]], abs=0.06)
        assert s["peak_rss_mb"] >= s["baseline_rss_mb"] > 0 and s["trainable_params"] > 0
        assert math.isfinite(s["loss_first"]) and math.isfinite(s["loss_last"])
    assert rec["summary"]["ours_fp32"]["optimizer"] in ("fused AdamW", "AdamW")
    md = out.with_suffix(".md").read_text()
    assert "| ours, fp32 |" in md and "| ours, bf16 autocast |" in md and "interleaved steps" in md


def test_dense_mask_for_flex_only_checkouts(bench_module):
    """The mask patched into DeepSpec checkouts with flex_attention only: context before the anchor, own block,
    dropped rows see key 0."""
    mod = bench_module("deepspec_side")
    T, g = 6, 2
    m = mod.dense_mask(anchor_positions=torch.tensor([[2, 0]]), block_keep_mask=torch.tensor([[True, False]]),
                       seq_len=T, block_size=g, device=torch.device("cpu"))
    assert m.shape == (1, 1, 2 * g, T + 2 * g)
    ok = (m[0, 0] == 0)
    assert ok[0].tolist() == [True, True, False, False, False, False, True, True, False, False]
    assert ok[1].tolist() == ok[0].tolist()
    assert ok[2].tolist() == ok[3].tolist() == [True] + [False] * 9   # dropped block: key 0 only


def _metrics(path, rows):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_time_to_equal_quality(tmp_path, bench_module):
    mod = bench_module("deepspec_quality")
    ours = _metrics(tmp_path / "ours", [{"step": 1, "step_cpu_s": 2.0}, {"step": 2, "step_cpu_s": 2.0},
                                        {"step": 2, "eval/expected_tau": 1.4}, {"step": 3, "step_cpu_s": 2.0},
                                        {"step": 4, "step_cpu_s": 2.0}, {"step": 4, "eval/expected_tau": 1.6}])
    theirs = _metrics(tmp_path / "theirs", [{"step": s, "step_cpu_s": 5.0} for s in (1, 2, 3, 4)]
                      + [{"step": 4, "eval/expected_tau": 1.5}])
    r = mod.compare(ours, theirs)
    assert r["ours"] == {"run_dir": str(ours), "final_tau": 1.6, "steps": 4, "cpu_s": 8.0}
    assert r["deepspec"]["cpu_s"] == 20.0
    assert r["ours_seconds_to_deepspec_final"] == pytest.approx(6.0)       # halfway between 4 s (1.4) and 8 s (1.6)
    assert r["speedup_to_equal_quality"] == pytest.approx(20.0 / 6.0)
    assert r["deepspec_seconds_to_ours_final"] is None                    # never reached
    assert r["speedup_to_our_final"] is None and r["cpu_s_per_step_ratio"] == pytest.approx(2.5)
    assert [(c["step"], c["cpu_s"], c["expected_tau"]) for c in r["curves"]["ours"]] == [(2, 4.0, 1.4), (4, 8.0, 1.6)]
    md = mod.compare_markdown({"date": "2026-12-06T00:00:00", "command": "x", **r})
    assert "| 2 | 1.400 | – | 4.0 | – |" in md and "| 4 | 1.600 | 1.500 | 8.0 | 20.0 |" in md
    assert "DeepSpec's CPU seconds to our final held-out E[τ] ÷ ours: not reached" in md


@pytest.mark.integration
def test_the_quality_modes_held_out_evaluation_is_the_trainers(tmp_path, bench_module):
    """The quality mode scores converted DeepSpec weights with a replay of `Trainer.evaluate`: on one of our
    own runs it must give the trainer's logged held-out numbers."""
    from tests.support.synthetic import write_regen_jsonl
    from deepspec.cache.union import open_caches
    from deepspec.cache.writer import build_cache
    from deepspec.config import load_config
    from deepspec.drafts import load_drafter
    from deepspec.targets import load_target
    from deepspec.train.data import CachedSequences, split_heldout
    from deepspec.train.loop import run
    mod = bench_module("deepspec_quality")
    torch.set_num_threads(1)
    write_regen_jsonl(tmp_path / "regen.jsonl", 24, seed=3, max_words=40)
    cfg = load_config([f"run_dir={tmp_path / 'run'}", "target.path=tiny:llama", "target.dtype=float32",
                       "target.num_feature_layers=2", f"data.regen_path={tmp_path / 'regen.jsonl'}",
                       "data.max_length=96", f"cache.dir={tmp_path / 'cache'}", "cache.shard_samples=8",
                       "train.strategy=single", "train.global_batch_sequences=4", "train.micro_batch_sequences=2",
                       "train.anchors_per_sequence=6", "data.heldout_fraction=0.2", "train.bf16=false",
                       "draft.gamma=3", "draft.num_layers=1", "draft.head_rank=16", "train.max_steps=2",
                       "train.eval_every=2", "train.save_every=2"])
    target = load_target(cfg.target)
    build_cache(cfg, target=target, progress=False)
    ckpt = run(cfg)
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = next(r for r in logged if "eval/expected_tau" in r)
    source = CachedSequences(open_caches([cfg.cache.dir]), cfg.data.max_length, target.layer_ids)
    _, held = split_heldout(source.sample_ids(), cfg.data.heldout_fraction, cfg.data.split_seed)
    got = mod.heldout_metrics(load_drafter(ckpt, target), source, held, cfg)
    for k in ("eval/expected_tau", "eval/ce", "eval/accept_rate/1", "eval/loss"):
        assert got[k] == pytest.approx(logged[k], rel=1e-6), k
