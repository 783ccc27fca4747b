"""Slow: `deepspec eval` with the real reference target (SmolLM2-135M-Instruct) and a random-init
small DSpark draft, one prompt per domain, greedy (fp32) — report written, numbers sane, lossless."""
import json

import pytest
import torch

pytestmark = pytest.mark.slow


def test_eval_reference_target_random_draft(tmp_path, eval_data_dir, reference_target_dir):
    from deepspec.config import load_config
    from deepspec.eval.runner import run
    torch.set_num_threads(1)
    cfg = load_config([
        f"run_dir={tmp_path}", "target=smollm2_135m", "target.path=reference:smollm2-135m",
        "target.dtype=float32", "target.device=cpu", "draft=dspark", "draft.num_layers=1", "draft.gamma=4",
        "draft.head_rank=32", f"eval.data_dir={eval_data_dir}", "eval.benchmarks=[gsm8k,humaneval,mt-bench]",
        "eval.max_samples=1", "eval.max_new_tokens=12", "eval.temperature=0", "eval.progress=false"])
    summary = run(cfg)
    out = tmp_path / "eval"
    for f in ("report.md", "results.json", "rollouts.jsonl", "samples.jsonl", "resolved_config.yaml",
              "plots/conditional_acceptance.png", "plots/tau_per_benchmark.png"):
        assert (out / f).is_file(), f
    res = json.loads((out / "results.json").read_text())
    assert res["target"]["num_layers"] == 30 and res["drafter"]["source"] == "random-init"
    assert set(res["domains"]) == {"math", "code", "chat"}
    rollouts = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
    for name, b in res["benchmarks"].items():
        mine = [r for r in rollouts if r["meta"]["benchmark"] == name]
        assert b["all_turns"]["tau"] == pytest.approx(sum(r["accepted"] + 1 for r in mine) / len(mine))
        assert b["all_turns"]["speedup"] > 0
    assert res["benchmarks"]["mt-bench"]["first_turn"] is not None
    gc = res["greedy_check"]
    assert gc["compared"] == 4 and gc["matched"] == 4, gc
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert all(s["generated_tokens"] <= 12 and s["text"] for s in samples)
    assert summary["overall"]["tau"] == pytest.approx(sum(b["all_turns"]["tau"] for b in res["benchmarks"].values())
                                                      / len(res["benchmarks"]))   # the macro mean
