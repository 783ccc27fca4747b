"""`deepspec demo` end to end on the real reference target, scaled down to CI size.

The README's main command, with overrides that shrink every stage (8 prompts, 16 new
tokens, 2 training steps, one prompt per benchmark): regenerate → cache → train → eval on
three domains → τ table, report and plots.  A re-run reuses every stage's output."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepspec.decoding.settings import TreeSetting
from deepspec.drafts.registry import drafter_class

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SMALL = ["data.max_samples=8", "engine.max_new_tokens=16", "engine.batch_size=8",
         "train.max_steps=2", "train.global_batch_sequences=2", "train.micro_batch_sequences=2",
         "train.anchors_per_sequence=4", "train.save_every=2", "train.eval_every=0",
         "eval.max_samples=1", "eval.max_new_tokens=16"]


def _default_policy(mode: str) -> str:
    """How the eval describes the shipped DSpark's documented default tree for ``mode``."""
    d = drafter_class("dspark").decoding_defaults[mode]
    lookup = (d["lookup_ngram"], 1) if d.get("lookup_ngram") else None
    return TreeSetting(d["tree_nodes"], d["tree_width"], lookup, depth=d.get("tree_depth")).describe()


def _demo(run_dir: Path, eval_dir: Path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline")
    cmd = [sys.executable, "-m", "deepspec.cli", "demo", f"run_dir={run_dir}", f"eval.data_dir={eval_dir}", *SMALL]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


def test_reduced_demo_end_to_end(tmp_path, reference_target_dir, eval_data_dir):
    run_dir = tmp_path / "demo"
    r = _demo(run_dir, eval_data_dir)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    for stage in ("1/4 regenerate", "2/4 capture", "3/4 train a dspark", "4/4 speculative decoding", "=== result ==="):
        assert stage in out
    assert "| **overall (macro)** |" in out and "demo finished in" in out
    report = next(run_dir.rglob("report.md"))
    results = json.loads((report.parent / "results.json").read_text())
    assert set(results["benchmarks"]) == {"gsm8k", "humaneval", "mt-bench"}
    assert {b["domain"] for b in results["benchmarks"].values()} == {"math", "code", "chat"}
    # greedy speculative decoding reproduced the target's own greedy output on every prompt
    gc = results["greedy_check"]
    assert gc["compared"] >= 3 and gc["matched"] == gc["compared"], gc   # mt-bench has 2 turns
    assert list((report.parent / "plots").glob("*.png"))
    # the shipped draft is evaluated on the same prompts and shown beside the one just trained
    assert "| shipped (smollm2-135m-dspark) |" in out and "| trained just now |" in out
    shipped = json.loads((report.parent.parent / "eval_shipped" / "results.json").read_text())
    assert shipped["greedy_check"]["matched"] == shipped["greedy_check"]["compared"]
    assert shipped["overall"]["tau"] > results["overall"]["tau"]      # trained long vs 2 steps, same prompts
    # and once more with the scheduler choosing each round's verification length: still lossless
    assert "| shipped (smollm2-135m-dspark), scheduled verification |" in out
    sched = json.loads((report.parent.parent / "eval_shipped_scheduler" / "results.json").read_text())
    assert sched["setup"]["policy"] == "scheduler" and sched["setup"]["draft_overhead_s"] > 0
    assert sched["greedy_check"]["matched"] == sched["greedy_check"]["compared"]
    assert sched["confidence"]["temperatures"]        # the calibration shipped beside the draft was applied
    # and with tree verification (bf16 target: mismatches from bf16 numerics are possible, so only counted)
    assert "| shipped (smollm2-135m-dspark), tree verification, bf16 |" in out and "vs the fastest plain" in out
    tree = json.loads((report.parent.parent / "eval_shipped_tree" / "results.json").read_text())
    assert tree["setup"]["policy"].startswith("tree(") and tree["setup"]["dtype"] == "torch.bfloat16"
    assert tree["greedy_check"]["compared"] == gc["compared"]
    # and the same tree with prompt lookup in its budget
    assert "| shipped (smollm2-135m-dspark), tree + prompt lookup, bf16 |" in out
    lk = json.loads((report.parent.parent / "eval_shipped_tree_lookup" / "results.json").read_text())
    assert lk["setup"]["policy"] == _default_policy("greedy")
    assert lk["greedy_check"]["compared"] == gc["compared"]
    # and the best sampled setting beside the best greedy one: the draft's default at T = 1
    assert f"| shipped (smollm2-135m-dspark), sampled T=1: {_default_policy('sampled')}, bf16 |" in out
    smp = json.loads((report.parent.parent / "eval_shipped_sampled" / "results.json").read_text())
    assert smp["setup"]["warp"]["temperature"] == 1.0 and smp["setup"]["decoding_source"] == "drafter default"
    assert smp["greedy_check"] is None and smp["overall"]["tau"] >= 1.0
    assert (run_dir / "resolved_config.yaml").is_file() or list(run_dir.rglob("resolved_config.yaml"))
    ckpt_lines = [l for l in out.splitlines() if l.startswith("checkpoint:")]
    assert ckpt_lines and Path(ckpt_lines[0].split(":", 1)[1].strip()).exists()

    again = _demo(run_dir, eval_data_dir)       # every stage reuses what the first run wrote
    assert again.returncode == 0, again.stderr[-3000:]
    log = again.stdout + again.stderr + "".join(p.read_text() for p in run_dir.rglob("*.log"))
    assert "regenerate: already complete" in log
    assert "is already complete" in log or "already complete" in log.split("regenerate: already complete", 1)[1]
    assert "resuming from" in log and "(step 2," in log
    assert "eval: already complete" in log
