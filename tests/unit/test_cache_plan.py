"""`deepspec plan`: estimates from regen JSONL or raw prompts, measured codec bytes, disk check."""
import io
import json

import pytest
import torch

from deepspec.plan import estimate as planmod
from tests.support.synthetic import write_regen_jsonl
from deepspec.config import load_config
from deepspec.targets import load_target

BASE = ["target.path=tiny:llama", "target.dtype=float32", "data.max_length=128",
        "train.micro_batch_sequences=2", "train.anchors_per_sequence=8"]


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return load_target(load_config(BASE).target)


def test_plan_from_regen(tmp_path, target):
    cfg = load_config(BASE + [f"run_dir={tmp_path}"])
    write_regen_jsonl(tmp_path / "regen" / "regen.jsonl", 30, seed=2, max_words=20)
    p = planmod.estimate(cfg, target=target, probe_tokens=256, decode_steps=4, decode_batch=2)
    assert p.records == 30 and p.records_exact and p.source.startswith("regen")
    assert p.raw_bytes_per_token == 6 + 2 * 64 * (len(target.layer_ids) + 1)
    assert 0 < p.codec_bytes_per_token < p.raw_bytes_per_token
    assert p.cache_bytes == pytest.approx(p.total_tokens * p.codec_bytes_per_token)
    assert p.probe_tokens >= 256 and p.capture_tok_s > 0 and p.decode_tok_s > 0 and p.regen_s > 0
    assert p.fits
    assert p.mean_anchors > 0 and p.train_anchor_s > 0 and p.train_s > 0, p.notes
    buf = io.StringIO()
    assert planmod.run(cfg, target=target, out=buf, probe_tokens=128, decode_steps=2, decode_batch=2,
                       train_probe=False) == 0
    text = buf.getvalue()
    for needle in ("total tokens", "raw (6 + 2·64·", "codec bf16", "ratio vs raw", "free disk",
                   "regeneration", "capture + encode", "training"):
        assert needle in text


def test_plan_from_raw_prompts_without_answers(tmp_path, target):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "turns": [f"question number {i} about the sea"]}) + "\n"
                               for i in range(12)))
    cfg = load_config(BASE + [f"run_dir={tmp_path}", "data.heldout_fraction=0.25"])
    p = planmod.estimate(cfg, target=target, prompts_path=prompts, probe_tokens=128, decode_steps=2,
                         decode_batch=2, assumed_response_tokens=40, train_probe=False)
    assert p.records == 12  # every record is regenerated and cached, the held-out ones too
    assert p.assumed_response_tokens == 40 and p.mean_loss_tokens == 40
    assert any("no answers" in n for n in p.notes)


def test_plan_refuses_when_cache_exceeds_disk(tmp_path, target):
    cfg = load_config(BASE + [f"run_dir={tmp_path}"])
    write_regen_jsonl(tmp_path / "regen" / "regen.jsonl", 8, seed=2, max_words=20)
    p = planmod.estimate(cfg, target=target, probe_tokens=64, decode_steps=1, decode_batch=1, train_probe=False)
    p.free_bytes = int(p.cache_bytes) - 1  # the same plan on a nearly full disk
    assert not p.fits
    assert "exceeds the free disk" in planmod.format_plan(p)


def test_plan_reports_draft_vocabulary_coverage_and_head(tmp_path, target):
    """draft.vocab_size = N: coverage of the sampled answer tokens (as the trainer selects) and the head change."""
    from deepspec.data.vocab import count_answer_tokens, coverage, select_top
    from deepspec.plan.probes import encode_conversations
    from deepspec.plan.estimate import _regen_sample
    N = 40
    cfg = load_config(BASE + [f"run_dir={tmp_path}", f"draft.vocab_size={N}", "draft.algorithm=dspark",
                              "draft.head_rank=8", "draft.num_layers=1"])
    write_regen_jsonl(tmp_path / "regen" / "regen.jsonl", 12, seed=4, max_words=20)
    p = planmod.estimate(cfg, target=target, probe_tokens=64, decode_steps=1, decode_batch=1, train_probe=False)
    items, _ = encode_conversations(target, _regen_sample(tmp_path / "regen" / "regen.jsonl", 256), 128, 512)
    counts = count_answer_tokens(({"input_ids": i, "loss_mask": m} for i, m in items if i), target.vocab_size)
    assert p.draft_vocab_size == N and p.vocab_size == target.vocab_size
    assert p.vocab_answer_tokens == int(counts.sum())
    assert p.vocab_coverage == pytest.approx(coverage(counts, select_top(counts, N, always=target.eos_token_ids)))
    assert 0 < p.vocab_coverage < 1
    # the Markov W2 shrinks from rank×V to rank×N
    assert p.draft_params_full - p.draft_params == 8 * (target.vocab_size - N)
    text = planmod.format_plan(p)
    assert f"{N:,} of {target.vocab_size:,}" in text and "coverage" in text and "target LM-head rows 40×64" in text
    # out of range: a note, no crash
    bad = load_config(BASE + [f"run_dir={tmp_path}", f"draft.vocab_size={target.vocab_size + 1}"])
    p = planmod.estimate(bad, target=target, probe_tokens=64, decode_steps=1, decode_batch=1, train_probe=False)
    assert any("ERROR: draft.vocab_size" in n for n in p.notes)
    assert "draft vocabulary" not in planmod.format_plan(p)
