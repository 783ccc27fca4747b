"""Drafters for the export tests: moved off their init (so every tensor matters), optionally pruned to a
draft vocabulary, saved, and compared block by block and proposal by proposal."""
from __future__ import annotations

import torch

from deepspec.config import TargetConfig
from deepspec.config.draft import DraftConfig
from deepspec.drafts import build_drafter
from deepspec.export.api import probe_batch
from deepspec.targets import load_target

LAYER_IDS = [1, 2]
TINY = "tiny:llama"
N_DRAFT = 100


def tiny_target(path=TINY, layer_ids=LAYER_IDS):
    return load_target(TargetConfig(path=path, dtype="float32", device="cpu", layer_ids=layer_ids))


def trained(target, algorithm, seed=0, **kw):
    """A drafter with every parameter moved off its init."""
    torch.manual_seed(seed)
    d = build_drafter(target, DraftConfig(algorithm=algorithm, num_layers=1, gamma=4, head_rank=8, **kw))
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return d.eval()


def pruned(target, algorithm, seed=0, **kw):
    """A trained-looking drafter scoring N_DRAFT random target tokens (token 0 and the last one included)."""
    d = trained(target, algorithm, seed=seed, vocab_size=N_DRAFT, **kw)
    g = torch.Generator().manual_seed(seed + 11)
    rest = torch.randperm(target.vocab_size - 2, generator=g)[:N_DRAFT - 2] + 1
    ids = torch.cat([torch.tensor([0, target.vocab_size - 1]), rest]).sort().values
    d.set_draft_vocab(ids)
    return d, ids


def save(d, path, run_yaml=None):
    d.save_pretrained(path)
    if run_yaml:
        (path / "run.yaml").write_text(run_yaml)
    return path


def same_blocks(a, b, target, atol=0.0):
    """Assert equal teacher-forced block logits (and confidences) on a probe batch; returns the batch."""
    batch = probe_batch(target, a.cfg.gamma, seed=3)
    x, y = a.block_logits(batch), b.block_logits(batch)
    assert (x["logits"] - y["logits"]).abs().max() <= atol
    if x["confidence"] is not None:
        assert (x["confidence"] - y["confidence"]).abs().max() <= atol
    return batch


def same_proposals(a, b, target, temperature):
    """Assert equal proposals (tokens and probabilities) from the same prefix and seed; returns a's."""
    from deepspec.decoding.warp import make_warp
    batch = probe_batch(target, a.cfg.gamma, seed=5)
    ids, feats = batch["input_ids"][0], batch["features"][0]
    warp = make_warp(temperature)
    p1 = a.propose(a.init_state(ids[:6], feats[:6]), int(ids[6]), a.cfg.gamma, warp, torch.Generator().manual_seed(4))
    p2 = b.propose(b.init_state(ids[:6], feats[:6]), int(ids[6]), b.cfg.gamma, warp, torch.Generator().manual_seed(4))
    assert torch.equal(p1.tokens, p2.tokens) and torch.equal(p1.probs, p2.probs)
    return p1
