"""The whole pipeline on every hard tiny family: `deepspec prepare` (regeneration + cache), a few training
steps of each drafter, `deepspec eval` under every verification policy with the greedy check (speculative
output = plain greedy output on every request), `deepspec export` + `deepspec check`.

Families: qwen3_moe, mixtral (MoE, every layer a sliding window), gpt_oss (MoE, attention sinks, mixed
sliding/full layers), qwen3_next (linear-attention hybrid: trees refused), gemma3_mm (a multimodal
checkpoint's text model, mixed sliding/full layers).  Policies: chain (fixed γ), the prefix scheduler (an
SPS profile of the target itself), tree, tree + prompt lookup.
"""
import json

import pytest
import torch

from deepspec.config import ConfigError, load_config

pytestmark = pytest.mark.integration
FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss", "qwen3_next", "gemma3_mm"]
DRAFTERS = {"dspark": ["draft=dspark", "draft.head_rank=16"], "dflash": ["draft=dflash"],
            "eagle3": ["draft=eagle3", "draft.ttt_steps=2"]}
POLICIES = {
    "chain": [],
    "scheduler": ["schedule.policy=scheduler", "schedule.profile_batch_sizes=[1,2,4]",
                  "schedule.profile_context_len=16", "schedule.profile_repeats=1"],
    "tree": ["eval.tree_nodes=6", "eval.tree_width=2"],
    "tree_lookup": ["eval.tree_nodes=6", "eval.tree_width=2", "eval.lookup_ngram=3"],
}
PROMPTS = ["What is 12 times 7?", "Write a poem about the sea.", "def add(a, b): what does it return?",
           "Natalia sold clips to 48 of her friends in April. How many in May?", "Say hello.",
           "Explain speculative decoding in one line.", "What is the square root of 16?", "Count to five."]


def _overrides(tmp, family, *extra):
    return [f"target.path=tiny:{family}", f"target.name=tiny_{family}", "target.dtype=float32", "target.device=cpu",
            "target.num_feature_layers=2", "data=jsonl", f"data.path={tmp / 'prompts.jsonl'}",
            "data.heldout_fraction=0", "data.max_length=96", "engine.max_new_tokens=16", "engine.batch_size=4",
            "engine.temperature=0.8", "engine.progress=false", f"cache.dir={tmp / 'cache'}",
            f"data.regen_path={tmp / 'prepare' / 'regen' / 'regen.jsonl'}",
            "draft.num_layers=1", "draft.gamma=3", "train.strategy=single", "train.max_steps=3",
            "train.global_batch_sequences=4", "train.micro_batch_sequences=2", "train.anchors_per_sequence=4",
            "train.save_every=0", "train.eval_every=0", "train.bf16=false",
            *extra]


@pytest.fixture(scope="module", params=FAMILIES)
def prepared(request, tmp_path_factory):
    from deepspec.prepare import run as prepare
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp(f"pipeline_{request.param}")
    (tmp / "prompts.jsonl").write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in PROMPTS))
    assert prepare(load_config(_overrides(tmp, request.param, f"run_dir={tmp / 'prepare'}"))) == 0
    return request.param, tmp


def _train(family, tmp, drafter):
    from deepspec.train.loop import run as train
    return train(load_config(_overrides(tmp, family, f"run_dir={tmp / drafter}", *DRAFTERS[drafter])))


def _eval(family, tmp, drafter, ckpt, policy, eval_data_dir):
    from deepspec.eval.runner import run as evaluate
    out = tmp / "eval" / f"{drafter}-{policy}"
    cfg = load_config(_overrides(tmp, family, f"run_dir={tmp / drafter}", *DRAFTERS[drafter], f"eval.checkpoint={ckpt}",
                                 f"eval.out_dir={out}", f"eval.data_dir={eval_data_dir}",
                                 "eval.benchmarks=[gsm8k,mt-bench]", "eval.max_samples=1", "eval.max_new_tokens=16",
                                 "eval.temperature=0", "eval.progress=false", "eval.bootstrap_resamples=50",
                                 *POLICIES[policy]))
    evaluate(cfg)
    return json.loads((out / "results.json").read_text())


def test_cache_holds_the_residual_stream_only(prepared):
    from deepspec.cache import CacheReader
    from deepspec.targets.tiny import build_tiny
    family, tmp = prepared
    reader = CacheReader(tmp / "cache")
    H = build_tiny(family)[0].config.get_text_config().hidden_size
    assert len(reader) == len(PROMPTS)
    row = reader[0]
    assert row["features"].shape == (row["input_ids"].shape[0], 2 * H)     # 2 layers × H: no router outputs
    assert row["last_hidden"].shape[1] == H


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_train_eval_every_policy_export_and_check(prepared, drafter, eval_data_dir, capsys):
    from deepspec.export.check import main as check
    from deepspec.export.cli import main as export
    family, tmp = prepared
    ckpt = _train(family, tmp, drafter)
    policies = ["chain", "scheduler", "tree", "tree_lookup"] if drafter == "dspark" else ["chain"]
    for policy in policies:
        if policy.startswith("tree") and family == "qwen3_next":
            with pytest.raises(ConfigError, match="tree verification .* refused: its linear_attention layers"):
                _eval(family, tmp, drafter, ckpt, policy, eval_data_dir)
            continue
        res = _eval(family, tmp, drafter, ckpt, policy, eval_data_dir)
        check_ = res["greedy_check"]
        assert check_["compared"] == 3 and check_["matched"] == check_["compared"], (policy, check_)
    out = tmp / "export" / drafter
    assert export(["--to", "hf", str(ckpt), str(out)]) == 0
    assert check([str(ckpt)]) == 0, capsys.readouterr()               # the target from the run's config
    assert check([str(out), "--target-path", f"tiny:{family}", "--target", "dtype=float32",
                  "--target", "num_feature_layers=2"]) == 0, capsys.readouterr()
