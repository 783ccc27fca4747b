"""Real-loop τ while training (`train.decode_eval_*`): the trainer decodes fixed held-out prompts with
the lossless loop and logs τ per temperature beside the teacher-forced expected τ."""
from __future__ import annotations

import json

import pytest
import torch

from deepspec.config import load_config
from deepspec.drafts import load_drafter
from deepspec.eval.runner import evaluate
from deepspec.eval.benchmarks import Sample
from deepspec.decoding.warp import make_warp
from deepspec.cache.writer import build_cache
from tests.support.synthetic import write_regen_jsonl
from deepspec.targets import load_target
from deepspec.train.decode_eval import DecodeEval
from deepspec.train.loop import run
from test_train_cache import overrides   # the tiny-run overrides of the cache tests


pytestmark = pytest.mark.integration


PROMPTS = ["Say hello to the world", "Count from one to ten", "Name three colours", "What is two plus two"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("decode_eval")
    write_regen_jsonl(tmp / "regen.jsonl", 16, seed=5, max_words=30)
    (tmp / "prompts.jsonl").write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in PROMPTS))
    extra = {"train.decode_eval_every": 2, "train.decode_eval_prompts": str(tmp / "prompts.jsonl"),
             "train.decode_eval_samples": 3, "train.decode_eval_new_tokens": 12,
             "train.max_steps": 4, "train.save_every": 4}
    cfg = load_config(overrides(tmp, **extra))
    target = load_target(cfg.target)
    build_cache(cfg, target=target, progress=False)
    return tmp, extra, target


@pytest.mark.parametrize("algorithm", ["dspark", "eagle3"])
def test_training_logs_real_loop_tau_at_each_decode_eval(setup, algorithm):
    tmp, extra, target = setup
    run_dir = tmp / f"run_{algorithm}"
    cfg = load_config(overrides(tmp, run_dir=str(run_dir), **{**extra, "draft.algorithm": algorithm}))
    ckpt = run(cfg)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    dec = {r["step"]: r for r in rows if "decode/tau_t0" in r}
    assert sorted(dec) == [2, 4]
    for r in dec.values():
        assert r["decode/tau_t1"] >= 1.0 and r["decode/seconds"] > 0
        assert 0.0 <= r["decode/accept_t0"] <= 1.0
    assert all("step_cpu_s" in r for r in rows if "step_time_s" in r)
    # the logged greedy τ at the last step is the eval loop's pooled τ on the same prompts and tokens
    drafter = load_drafter(ckpt, target)
    bench = {"p": [Sample(benchmark="p", index=i, turns=[t]) for i, t in enumerate(PROMPTS[:3])]}
    recs = evaluate(target, drafter, bench, gamma=drafter.cfg.gamma, warp=make_warp(0.0), max_new_tokens=12,
                    measure_baseline=False, progress=False, warmup=False)
    rounds = [x for rec in recs for x in rec.spec.rounds]
    pooled = sum(x.accepted + 1 for x in rounds) / len(rounds)
    assert dec[4]["decode/tau_t0"] == pytest.approx(pooled, rel=1e-9)


def test_decode_eval_is_repeatable_and_missing_prompts_are_named(setup, tmp_path):
    tmp, extra, target = setup
    cfg = load_config(overrides(tmp, **extra))
    from deepspec.drafts import build_drafter
    torch.manual_seed(0)
    drafter = build_drafter(target, cfg.draft)
    ev = DecodeEval(cfg, target)
    a, b = ev(drafter), ev(drafter)
    assert {k: v for k, v in a.items() if k != "decode/seconds"} == {k: v for k, v in b.items() if k != "decode/seconds"}
    assert drafter.training            # restored after decoding
    bad = load_config(overrides(tmp, **{**extra, "train.decode_eval_prompts": str(tmp_path / "none.jsonl")}))
    with pytest.raises(FileNotFoundError, match="train.decode_eval_prompts"):
        DecodeEval(bad, target)
