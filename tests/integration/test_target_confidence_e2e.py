"""bench/eval_drafters.py --confidence end to end: a greedy fp32 eval on a tiny target, then the script re-decodes
the prompts with the target alone and walks every round of the rollouts along that path."""
import json

import torch

from deepspec.config import load_config


def test_every_round_lies_on_the_targets_greedy_path(tmp_path, eval_data_dir, bench_module, monkeypatch):
    from deepspec.eval.runner import run
    torch.set_num_threads(1)
    out = tmp_path / "ev"
    run(load_config([f"run_dir={tmp_path}", "target.path=tiny:llama", "target.dtype=float32", "target.device=cpu",
                     "target.num_feature_layers=2", "draft=dspark", "draft.num_layers=1", "draft.gamma=3",
                     "draft.head_rank=16", f"eval.data_dir={eval_data_dir}", "eval.benchmarks=[gsm8k,mbpp]",
                     "eval.max_samples=2", "eval.max_new_tokens=12", "eval.temperature=0", "eval.decoding=chain", "eval.multi_turn=false",
                     "eval.measure_baseline=false", "eval.progress=false", f"eval.out_dir={out}"]))
    mod = bench_module("eval_drafters")
    rec_path = tmp_path / "tc.json"
    mod.main(["--confidence", f"d={out}", "--out", str(rec_path), "--paths", str(tmp_path / "paths.json")])
    rec = json.loads(rec_path.read_text())
    # a second analysis reads the kept paths (no target forward) and gives the same record
    monkeypatch.setattr(bench_module("eval_tables"), "greedy_paths", None)
    mod.main(["--confidence", f"d={out}", "--out", str(tmp_path / "tc2.json"),
              "--paths", str(tmp_path / "paths.json")])
    again = json.loads((tmp_path / "tc2.json").read_text())
    assert again["target"] == rec["target"] and again["drafters"] == rec["drafters"]
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    rolls = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
    # fp32 greedy speculative decoding is the target's greedy decoding: same tokens, every round on the path
    assert rec["target"]["tokens"] == sum(s["generated_tokens"] for s in samples)
    d = rec["drafters"]["d"]
    assert d["requests_diverged"] == 0 and d["rounds_used"] == len(rolls)
    reached = sum(min(r["accepted"] + 1, r["verified"]) for r in rolls)
    assert sum(d["all_positions"]["reached"]) == reached
    assert sum(d["position1"]["reached"]) == sum(1 for r in rolls if r["verified"] > 0)
    assert abs(sum(x for x in rec["target"]["share"]) - 1.0) < 1e-9
