"""Training from the hidden-state cache vs online (the frozen target inside training).

A tiny cache is built with `deepspec.prepare.build_cache` from synthetic regenerated
conversations; the same micro-batch then gives the same loss from the cache and online, for
every registered drafter, and short training runs follow the same trajectory.
Measured (tiny fp32 target on CPU, bf16 features on both sides): features, per-drafter losses
and the 3-step loss trajectories are bit-identical.  Asserted: features within 1 bf16 ulp-ish
(atol 0.02) and losses within 1e-4 relative, since batching/padding in the cache builder can
flip a bf16 rounding on other hardware."""
from __future__ import annotations

import json

import pytest
import torch

from deepspec.cache import CacheReader, CacheMismatchError
from deepspec.cache.writer import build_cache
from tests.support.synthetic import write_regen_jsonl
from deepspec.config import load_config
from deepspec.drafts import build_drafter
from deepspec.targets import load_target
from deepspec.train.data import CachedSequences, OnlineFeatures, OnlineSequences, build_micro_batch
from deepspec.train.loop import run

pytestmark = pytest.mark.integration
RTOL = 1e-4


def overrides(tmp_path, **extra):
    kw = {"run_dir": str(tmp_path / "run"), "target.path": "tiny:llama", "target.dtype": "float32",
          "target.num_feature_layers": 2, "draft.num_layers": 1, "draft.gamma": 3, "draft.head_rank": 16,
          "draft.ttt_steps": 2, "data.regen_path": str(tmp_path / "regen.jsonl"), "data.max_length": 96,
          "cache.dir": str(tmp_path / "cache"), "cache.shard_samples": 8,
          "train.strategy": "single", "train.global_batch_sequences": 4, "train.micro_batch_sequences": 2,
          "train.anchors_per_sequence": 6, "train.max_steps": 3, "train.save_every": 0, "train.eval_every": 3,
          "data.heldout_fraction": 0.2, "train.bf16": False}
    kw.update(extra)
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in kw.items()]


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("cache_vs_online")
    write_regen_jsonl(tmp / "regen.jsonl", 20, seed=3, max_words=40)
    cfg = load_config(overrides(tmp))
    target = load_target(cfg.target)
    build_cache(cfg, target=target, progress=False)
    return tmp, cfg, target


def test_same_batch_same_loss_cached_and_online(cached):
    tmp, cfg, target = cached
    reader = CacheReader(tmp / "cache")
    cache_src = CachedSequences(reader, cfg.data.max_length)
    online_src = OnlineSequences.from_jsonl(tmp / "regen.jsonl", target, cfg.data.max_length)
    assert len(online_src) == len(cache_src)
    assert [reader.sample_id(i) for i in range(len(reader))] == online_src.ids
    items = [(0, i) for i in (0, 3, 5, 8)]
    for i in (0, 3, 5, 8):
        assert torch.equal(cache_src[i]["input_ids"], online_src[i]["input_ids"])
        assert torch.equal(cache_src[i]["loss_mask"], online_src[i]["loss_mask"])
    b_cache = build_micro_batch(cache_src, items, 6, seed=0)
    b_online = OnlineFeatures(target, with_lse=True)(build_micro_batch(online_src, items, 6, seed=0))
    assert torch.equal(b_cache["anchors"], b_online["anchors"]) and b_cache["anchors"].ge(0).any()
    for k in ("features", "last_hidden"):
        assert b_cache[k].dtype == b_online[k].dtype == torch.bfloat16
        torch.testing.assert_close(b_cache[k].float(), b_online[k].float(), atol=0.02, rtol=0.01)
    assert b_cache["target_lse"].dtype == b_online["target_lse"].dtype == torch.float32
    torch.testing.assert_close(b_cache["target_lse"], b_online["target_lse"], atol=0.02, rtol=0.01)
    for algo in ("dflash", "dspark", "eagle3"):  # the trainable drafters (eval registers reference ones)
        torch.manual_seed(0)
        d = build_drafter(target, type(cfg.draft)(**{**cfg.draft.__dict__, "algorithm": algo}))
        with torch.no_grad():
            lc, lo = d(b_cache), d(b_online)
        assert torch.isfinite(lc["loss"])
        assert float(lo["loss"]) == pytest.approx(float(lc["loss"]), rel=RTOL), algo
        assert lo["metrics"]["expected_tau"] == pytest.approx(lc["metrics"]["expected_tau"], rel=RTOL), algo


def test_cached_and_online_training_follow_the_same_trajectory(cached):
    tmp, _, _ = cached
    run(load_config(overrides(tmp, run_dir=str(tmp / "from_cache"), **{"train.num_workers": 1})))  # reader in a worker
    run(load_config(overrides(tmp, run_dir=str(tmp / "online"), **{"data.online": True})))
    _same_trajectory(tmp / "from_cache", tmp / "online")


def _same_trajectory(run_a, run_b):
    """Two 3-step runs logged the same steps, tokens and (within RTOL) train and held-out losses."""
    rec = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    a, b = rec(run_a), rec(run_b)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 3]
    for x, y in zip(a, b):
        for k in ("train/loss", "eval/loss"):
            if k in x:
                assert y[k] == pytest.approx(x[k], rel=RTOL), (x["step"], k)
        assert x.get("tokens") == y.get("tokens")


def test_cache_of_another_target_is_refused(cached):
    tmp, _, _ = cached
    with pytest.raises(CacheMismatchError):
        run(load_config(overrides(tmp, run_dir=str(tmp / "other"), **{"target.path": "'tiny:llama:seed=1'"})))


def test_draft_vocabulary_selected_from_the_training_split(cached):
    """draft.vocab_size = N: the trainer picks the N most frequent answer tokens of the training split
    (cache and online alike), saves them beside the run and in the checkpoint, and logs coverage."""
    from deepspec.data.vocab import count_answer_tokens, load_vocab, select_top
    from deepspec.drafts import load_drafter
    from deepspec.train.data import split_heldout
    tmp, cfg, target = cached
    N = 64
    ckpts = {}
    for mode, extra in (("vocab_cache", {}), ("vocab_online", {"data.online": True})):
        ckpts[mode] = run(load_config(overrides(tmp, run_dir=str(tmp / mode), **{"draft.vocab_size": N},
                                                **extra)))
    reader = CacheReader(tmp / "cache")
    src = CachedSequences(reader, cfg.data.max_length)
    train_idx, _ = split_heldout(src.sample_ids(), cfg.data.heldout_fraction, cfg.data.split_seed)
    expected = select_top(count_answer_tokens((src.tokens(i) for i in train_idx), target.vocab_size), N,
                          always=target.eos_token_ids)
    for mode, ckpt in ckpts.items():
        saved = load_vocab(tmp / mode / "draft_vocab.json", vocab_size=target.vocab_size,
                           tokenizer_fingerprint=target.fingerprint()["tokenizer_sha256"])
        assert saved.tolist() == expected.tolist(), mode
        assert load_drafter(ckpt, target).draft_vocab.tolist() == expected.tolist()
        rows = [json.loads(x) for x in (tmp / mode / "metrics.jsonl").read_text().splitlines()]
        cov = [r["eval/vocab_coverage"] for r in rows if "eval/vocab_coverage" in r]
        assert cov and 0 < cov[-1] <= 1


def test_init_from_keeps_its_draft_vocabulary_and_logs_the_difference(cached, caplog):
    """draft.init_from a draft of the same vocabulary size: its vocabulary is kept (its weights were trained on
    it), written to run_dir/draft_vocab.json, and a difference from the split's own selection is logged."""
    import logging
    from deepspec.data.vocab import load_vocab
    from deepspec.drafts import load_drafter
    tmp, cfg, target = cached
    N = 64
    init = build_drafter(target, load_config(overrides(tmp, **{"draft.vocab_size": N})).draft)
    ids = torch.arange(100, 100 + N)                       # not what the training split would select
    init.set_draft_vocab(ids)
    init_dir = init.save_pretrained(tmp / "init_vocab")
    with caplog.at_level(logging.INFO, logger="deepspec.train.loop"):
        ckpt = run(load_config(overrides(tmp, run_dir=str(tmp / "vocab_init"),
                                         **{"draft.vocab_size": N, "draft.init_from": str(init_dir)})))
    assert load_drafter(ckpt, target).draft_vocab.tolist() == ids.tolist()
    saved = json.loads((tmp / "vocab_init" / "draft_vocab.json").read_text())
    assert saved["ids"] == ids.tolist() and "draft.init_from" in saved["source"]
    assert load_vocab(tmp / "vocab_init" / "draft_vocab.json", vocab_size=target.vocab_size).tolist() == ids.tolist()
    assert any("kept from draft.init_from" in r.getMessage() and "differ from the top-64" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)


def test_training_on_a_union_of_two_caches_equals_one_cache_of_both(cached):
    """A second prepare's cache (cache.extra_dirs) extends the first: same samples, same order, same run."""
    tmp, cfg, target = cached
    lines = (tmp / "regen.jsonl").read_text().splitlines(keepends=True)
    for name, part in (("a", lines[:12]), ("b", lines[12:])):
        (tmp / f"regen_{name}.jsonl").write_text("".join(part))
        build_cache(load_config(overrides(tmp, **{"data.regen_path": str(tmp / f"regen_{name}.jsonl"),
                                                  "cache.dir": str(tmp / f"cache_{name}")})),
                    target=target, progress=False)
    union = {"cache.dir": str(tmp / "cache_a"), "cache.extra_dirs": f"[{tmp / 'cache_b'}]"}
    run(load_config(overrides(tmp, run_dir=str(tmp / "union"), **union)))
    run(load_config(overrides(tmp, run_dir=str(tmp / "whole"))))
    _same_trajectory(tmp / "union", tmp / "whole")
    with pytest.raises(FileNotFoundError, match=r"cache.extra_dirs\[0\]"):
        run(load_config(overrides(tmp, run_dir=str(tmp / "missing"), **{"cache.extra_dirs": f"[{tmp / 'nope'}]"})))


def test_training_reads_a_subset_of_the_cached_layers(cached):
    """A drafter over fewer target layers (e.g. a 3-layer EAGLE-3 from a 5-layer cache) trains from the same
    cache: its features are the chosen layers' slices, equal to what the target captures for those layers."""
    tmp, cfg, target = cached
    reader = CacheReader(tmp / "cache")
    full = list(reader.layer_ids)
    assert len(full) == 2
    sub = load_target(load_config(overrides(tmp, **{"target.layer_ids": f"[{full[1]}]"})).target)
    src = CachedSequences(reader, cfg.data.max_length, sub.layer_ids)
    items = [(0, i) for i in (1, 4)]
    b_cache = build_micro_batch(src, items, 6, seed=0)
    online = OnlineSequences.from_jsonl(tmp / "regen.jsonl", sub, cfg.data.max_length)
    b_online = OnlineFeatures(sub)(build_micro_batch(online, items, 6, seed=0))
    assert b_cache["features"].shape[-1] == sub.feature_dim == reader.feature_dim // 2
    torch.testing.assert_close(b_cache["features"].float(), b_online["features"].float(), atol=0.02, rtol=0.01)
    ckpt = run(load_config(overrides(tmp, run_dir=str(tmp / "subset"), **{"target.layer_ids": f"[{full[1]}]",
                                                                       "draft.algorithm": "eagle3"})))
    assert ckpt.is_dir()
    other = next(i for i in range(4) if i not in full)       # the tiny target has 4 layers
    with pytest.raises(CacheMismatchError, match="layer_ids"):
        run(load_config(overrides(tmp, run_dir=str(tmp / "not_subset"),
                                  **{"target.layer_ids": f"[{min(full[0], other)},{max(full[0], other)}]"})))
