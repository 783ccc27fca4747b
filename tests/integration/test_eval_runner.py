"""`deepspec eval` on a tiny target: files, numbers, greedy losslessness, checkpoint + STS + threshold."""
import json

import pytest
import torch

from deepspec.config import load_config

BENCHES = "[gsm8k,humaneval,mt-bench]"


def _cfg(tmp_path, eval_data_dir, *extra):
    return load_config([
        f"run_dir={tmp_path}", "target.path=tiny:llama", "target.dtype=float32", "target.device=cpu",
        "target.num_feature_layers=2", "draft=dspark", "draft.num_layers=1", "draft.gamma=3", "draft.head_rank=16",
        f"eval.data_dir={eval_data_dir}", f"eval.benchmarks={BENCHES}", "eval.max_samples=1",
        "eval.max_new_tokens=12", "eval.temperature=0", "eval.progress=false", *extra])


def _read_jsonl(p):
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def test_eval_random_init_greedy_report(tmp_path, eval_data_dir):
    from deepspec.eval.runner import run
    torch.set_num_threads(1)
    cfg = _cfg(tmp_path, eval_data_dir, "eval.decoding=chain")
    summary = run(cfg)
    out = tmp_path / "eval"
    for f in ("report.md", "results.json", "rollouts.jsonl", "samples.jsonl", "resolved_config.yaml",
              "plots/conditional_acceptance.png", "plots/tau_per_benchmark.png", "plots/reliability.png",
              "plots/threshold_sweep.png"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["eval"]["max_new_tokens"] == 12 and res["drafter"]["source"] == "random-init"
    assert set(res["benchmarks"]) == {"gsm8k", "humaneval", "mt-bench"}
    assert res["benchmarks"]["mt-bench"]["first_turn"]["requests"] == 1
    assert res["benchmarks"]["mt-bench"]["all_turns"]["requests"] == 2
    assert res["benchmarks"]["gsm8k"]["first_turn"] is None
    assert set(res["domains"]) == {"math", "code", "chat"}
    rollouts = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
    for name, b in res["benchmarks"].items():
        m = b["all_turns"]
        mine = [r for r in rollouts if r["meta"]["benchmark"] == name]   # τ is the rollouts' tokens per round
        assert m["rounds"] == len(mine) >= 1 and m["speedup"] > 0
        assert m["tau"] == pytest.approx(sum(r["accepted"] + 1 for r in mine) / len(mine))
        assert 0 < m["generated_tokens"] <= 12 * m["requests"]
    assert res["greedy_check"]["compared"] == 4 and res["greedy_check"]["matched"] == 4
    assert res["speed"]["spec"]["verify_s"] > 0 and res["speed"]["baseline"]["tokens_per_s"] > 0
    rs = res["speed"]["round_split"]   # per-round split + the plain-decode step of the same run
    assert rs["rounds"] == sum(b["all_turns"]["rounds"] for b in res["benchmarks"].values())
    assert rs["verify_ms"] > 0 and rs["draft_ms"] > 0 and rs["overhead_ms"] >= 0
    assert rs["round_ms"] == pytest.approx(rs["draft_ms"] + rs["verify_ms"] + rs["overhead_ms"])
    assert 0 <= rs["overhead_fraction"] < 1 and rs["plain_decode_ms_per_token"] > 0
    assert rs["verify_over_plain_decode"] == pytest.approx(rs["verify_ms"] / rs["plain_decode_ms_per_token"])
    assert summary["overall"]["tau"] == pytest.approx(res["overall"]["tau"])
    # rollouts: one line per round, readable by the scheduler's reader
    rolls = _read_jsonl(out / "rollouts.jsonl")
    assert len(rolls) == sum(b["all_turns"]["rounds"] for b in res["benchmarks"].values())
    r0 = rolls[0]
    assert set(r0) >= {"request_id", "round", "confidence", "accepted", "proposed", "draft_tokens"}
    assert len(r0["confidence"]) == len(r0["draft_tokens"]) == 3
    from deepspec.schedule.rollouts import read_rollouts
    assert len(read_rollouts(out / "rollouts.jsonl")) == len(rolls)
    samples = _read_jsonl(out / "samples.jsonl")
    assert [s["request_id"] for s in samples] == ["gsm8k/0", "humaneval/0", "mt-bench/0/t0", "mt-bench/0/t1"]
    report = (out / "report.md").read_text()
    assert "Macro τ" in report and "mt-bench (turn 1)" in report and "Speedup" in report
    assert "verify ÷ plain step" in report and "plain decode ms/token" in report


def test_eval_checkpoint_with_calibration_and_threshold(tmp_path, eval_data_dir):
    from deepspec.drafts.registry import build_drafter
    from deepspec.eval.runner import run
    from deepspec.schedule.calibration import Calibration
    from deepspec.targets import load_target
    torch.set_num_threads(1)
    base = _cfg(tmp_path, eval_data_dir)
    target = load_target(base.target)
    ckpt = tmp_path / "ckpt"
    torch.manual_seed(0)
    build_drafter(target, base.draft).save_pretrained(ckpt)
    Calibration(temperatures=[2.0, 2.0, 2.0], gamma=3).save(ckpt)
    cfg = _cfg(tmp_path, eval_data_dir, f"eval.checkpoint={ckpt}", "schedule.policy=threshold", "schedule.threshold=0.2",
               "eval.benchmarks=[gsm8k]", f"eval.out_dir={tmp_path / 'ev2'}")
    run(cfg)
    res = json.loads((tmp_path / "ev2" / "results.json").read_text())
    assert res["drafter"]["source"] == str(ckpt)
    assert res["confidence"]["temperatures"] == [2.0, 2.0, 2.0]
    assert "reliability_calibrated" in res["confidence"]
    assert res["setup"]["policy"].startswith("threshold")
    assert res["greedy_check"]["matched"] == res["greedy_check"]["compared"] == 1
    rolls = _read_jsonl(tmp_path / "ev2" / "rollouts.jsonl")
    assert all(0 <= r["accepted"] <= r["proposed"] <= 3 for r in rolls)


def test_eval_scheduler_profiles_here_and_measures_the_draft_overhead(tmp_path, eval_data_dir):
    """`schedule.policy=scheduler` with neither a cost table nor a draft overhead: the target is profiled,
    the overhead is the warm-up's draft time per round, and decoding stays lossless."""
    from deepspec.eval.runner import run
    torch.set_num_threads(1)
    cfg = _cfg(tmp_path, eval_data_dir, "schedule.policy=scheduler", "schedule.profile_batch_sizes=[1,2,4]",
               "schedule.profile_repeats=1", "schedule.profile_context_len=16", "eval.benchmarks=[gsm8k]",
               f"eval.out_dir={tmp_path / 'ev3'}")
    assert cfg.schedule.draft_overhead_s is None
    run(cfg)
    res = json.loads((tmp_path / "ev3" / "results.json").read_text())
    assert res["setup"]["policy"] == "scheduler" and res["setup"]["draft_overhead_s"] > 0
    assert res["greedy_check"]["matched"] == res["greedy_check"]["compared"] == 1
    rolls = _read_jsonl(tmp_path / "ev3" / "rollouts.jsonl")
    assert all(0 <= r["accepted"] <= r["proposed"] <= 3 for r in rolls)
    # a configured overhead is used as given
    cfg = _cfg(tmp_path, eval_data_dir, "schedule.policy=scheduler", "schedule.profile_batch_sizes=[1,2,4]",
               "schedule.profile_repeats=1", "schedule.profile_context_len=16", "eval.benchmarks=[gsm8k]",
               "schedule.draft_overhead_s=0.25", f"eval.out_dir={tmp_path / 'ev4'}")
    run(cfg)
    assert json.loads((tmp_path / "ev4" / "results.json").read_text())["setup"]["draft_overhead_s"] == 0.25


def test_eval_oracle_reference_drafter_upper_bound(tmp_path, eval_data_dir):
    from deepspec.eval.runner import run
    torch.set_num_threads(1)
    cfg = _cfg(tmp_path, eval_data_dir, "draft.algorithm=target_as_draft", "eval.benchmarks=[mbpp]",
               "eval.max_new_tokens=17", "eval.measure_baseline=false")
    s = run(cfg)
    m = s["benchmarks"]["mbpp"]["all_turns"]
    assert m["conditional_acceptance"] == [1.0, 1.0, 1.0]
    # 1 prefill token + 4 full rounds of γ+1 = 17 tokens
    assert m["rounds"] == 4 and m["tau"] == 4.0 and s["greedy_check"] is None
    assert s["speed"]["baseline"] is None


def test_eval_rerun_reuses_matching_results(tmp_path, eval_data_dir, caplog):
    """Same config, checkpoint and prompts → results.json is reused as it is; a changed key or
    eval.rerun=true decodes again."""
    import logging
    from deepspec.eval.runner import run
    torch.set_num_threads(1)
    ov = ("eval.benchmarks=[gsm8k]", "eval.max_new_tokens=6", "eval.measure_baseline=false")
    first = run(_cfg(tmp_path, eval_data_dir, *ov))
    res = tmp_path / "eval" / "results.json"
    stamp = res.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="deepspec.eval.runner"):
        again = run(_cfg(tmp_path, eval_data_dir, *ov))
    assert "already complete" in caplog.text and res.stat().st_mtime_ns == stamp
    assert again["overall"]["tau"] == pytest.approx(first["overall"]["tau"])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="deepspec.eval.runner"):
        run(_cfg(tmp_path, eval_data_dir, *ov[:1], "eval.max_new_tokens=5", *ov[2:]))
    assert "already complete" not in caplog.text
    assert json.loads(res.read_text())["config"]["eval"]["max_new_tokens"] == 5
    stamp = res.stat().st_mtime_ns
    run(_cfg(tmp_path, eval_data_dir, *ov[:1], "eval.max_new_tokens=5", *ov[2:], "eval.rerun=true"))
    assert res.stat().st_mtime_ns != stamp


def test_eval_tree_verification(tmp_path, eval_data_dir):
    """eval.tree_nodes: the tree loop through the runner, lossless, its setting in the report; the settings
    it cannot combine with are refused by name."""
    from deepspec.config import ConfigError
    from deepspec.eval.runner import run
    torch.set_num_threads(1)
    summary = run(_cfg(tmp_path, eval_data_dir, "eval.tree_nodes=6", "eval.tree_width=2", "eval.lookup_ngram=0"))
    assert summary["setup"]["policy"] == "tree(nodes=6, width=2)"
    assert summary["setup"]["decoding_source"] == "eval config"
    assert summary["greedy_check"]["compared"] == 4 and summary["greedy_check"]["matched"] == 4
    rolls = _read_jsonl(tmp_path / "eval" / "rollouts.jsonl")
    assert rolls and all(r["proposed"] <= 6 and len(r["draft_tokens"]) == r["accepted"] for r in rolls)
    assert all(r["meta"]["tree"] == [6, 2] and r["confidence"] is None for r in rolls)
    # eval.tree_depth caps the tree: one draft node deep, at most one draft accepted a round
    capped = run(_cfg(tmp_path / "depth", eval_data_dir, "eval.tree_nodes=6", "eval.tree_width=2",
                      "eval.lookup_ngram=0", "eval.tree_depth=1"))
    assert capped["setup"]["policy"] == "tree(nodes=6, width=2, depth=1)"
    assert capped["greedy_check"]["compared"] == capped["greedy_check"]["matched"] == 4
    rolls = _read_jsonl(tmp_path / "depth" / "eval" / "rollouts.jsonl")
    assert rolls and all(r["proposed"] <= 2 and r["accepted"] <= 1 for r in rolls)
    for i, (extra, match) in enumerate([("schedule.policy=scheduler", "cannot be combined"),
                                        ("eval.tree_width=0", "must be ≥ 1"),
                                        ("eval.decoding=chain", "eval.decoding=chain verifies chains"),
                                        ("draft.algorithm=target_as_draft", "target_as_draft drafter drafts chains only"),
                                        ("target.path=tiny:qwen3_next", "linear_attention layers carry a recurrent")]):
        with pytest.raises(ConfigError, match=match):
            run(_cfg(tmp_path / f"bad{i}", eval_data_dir, "eval.tree_nodes=6", extra))


@pytest.mark.parametrize("draft,temperature", [("dspark", 0), ("eagle3", 1)])
def test_eval_defaults_to_the_drafters_best_lossless_setting(tmp_path, eval_data_dir, draft, temperature):
    """With no decoding key set, `deepspec eval` runs the loaded drafter's documented default (the parallel
    drafters' greedy default: a 6-node tree of width 3 with prompt lookup n ≤ 3; Eagle3's sampled default a
    shallower, smaller tree), greedy or sampled."""
    from deepspec.drafts.registry import drafter_class
    from deepspec.eval.runner import run
    torch.set_num_threads(1)
    summary = run(_cfg(tmp_path, eval_data_dir, f"draft={draft}", f"eval.temperature={temperature}"))
    want = drafter_class(draft).decoding_defaults["greedy" if temperature == 0 else "sampled"]
    nodes, width, depth = want["tree_nodes"], want["tree_width"], want.get("tree_depth")
    if draft == "dspark":                                 # the measured greedy default of the parallel drafters
        assert (nodes, width, depth) == (6, 3, None)
    shape = f"nodes={nodes}, width={width}" + (f", depth={depth}" if depth else "")
    assert summary["setup"]["policy"] == f"tree({shape}, lookup=3..1)"
    assert summary["setup"]["decoding_source"] == "drafter default"
    if temperature == 0:
        assert summary["greedy_check"]["compared"] == summary["greedy_check"]["matched"] == 4
    rolls = _read_jsonl(tmp_path / "eval" / "rollouts.jsonl")
    assert rolls and all(r["meta"]["tree"] == [nodes, width] and r["meta"]["lookup"] == [3, 1] for r in rolls)
    if depth:                                             # the drafter's tree stops there; lookup may go deeper
        assert all(r["accepted"] - r.get("lookup_accepted", 0) <= depth for r in rolls)
    from deepspec.schedule.rollouts import read_rollouts      # the calibration reads chain rollouts only
    with pytest.raises(ValueError, match="draft-tree round.*eval.decoding=chain"):
        read_rollouts(tmp_path / "eval" / "rollouts.jsonl")


@pytest.mark.parametrize("draft,extra", [("dspark", ()), ("dspark", ("eval.tree_nodes=6", "eval.tree_width=2")),
                                         ("dflash", ()), ("eagle3", ())])
def test_eval_draft_dtype_bf16_stays_lossless(tmp_path, eval_data_dir, draft, extra):
    """`eval.draft_dtype` casts the drafter only: greedy outputs still equal plain decoding."""
    from deepspec.eval.runner import run
    torch.set_num_threads(1)
    cfg = _cfg(tmp_path, eval_data_dir, f"draft={draft}", "eval.draft_dtype=bfloat16", *extra)
    run(cfg)
    res = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert res["drafter"]["dtype"] == "bfloat16" and res["drafter"]["algorithm"] == draft
    assert res["greedy_check"]["compared"] == 4 and res["greedy_check"]["matched"] == 4


def test_eval_draft_dtype_refuses_unknown_names(tmp_path, eval_data_dir):
    from deepspec.config import ConfigError
    from deepspec.eval.runner import run
    with pytest.raises(ConfigError, match="eval.draft_dtype='int3'"):
        run(_cfg(tmp_path, eval_data_dir, "eval.draft_dtype=int3"))


def test_eval_tree_with_prompt_lookup_records_what_the_lookup_gave(tmp_path, eval_data_dir):
    from deepspec.eval.runner import run
    torch.set_num_threads(1)
    run(_cfg(tmp_path, eval_data_dir, "eval.tree_nodes=6", "eval.tree_width=2", "eval.lookup_ngram=3"))
    out = tmp_path / "eval"
    res = json.loads((out / "results.json").read_text())
    assert res["greedy_check"]["compared"] == res["greedy_check"]["matched"] == 4
    assert "lookup=3..1" in res["setup"]["policy"]
    rolls = _read_jsonl(out / "rollouts.jsonl")
    assert rolls and all(r["meta"]["lookup"] == [3, 1] and 0 <= r["lookup_accepted"] <= r["accepted"]
                         and r["proposed"] <= 6 for r in rolls)


def test_eval_prompt_lookup_alone_with_no_draft(tmp_path, eval_data_dir):
    """`draft.algorithm=no_draft` + a tree + prompt lookup: prompt-lookup decoding without a draft model."""
    from deepspec.eval.runner import run
    torch.set_num_threads(1)
    run(_cfg(tmp_path, eval_data_dir, "draft.algorithm=no_draft", "eval.tree_nodes=7", "eval.lookup_ngram=3"))
    res = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert res["drafter"]["source"] == "reference" and res["drafter"]["parameters"] == 0
    assert res["greedy_check"]["compared"] == res["greedy_check"]["matched"] == 4
    rolls = _read_jsonl(tmp_path / "eval" / "rollouts.jsonl")
    assert all(r["lookup_accepted"] == r["accepted"] for r in rolls)
