"""Every registered drafter through the real loop: greedy output == the target's own greedy decode
(random init and after a few training steps), and the loop's contract checks."""
import pytest
import torch

from conftest import make_tiny_target
from deepspec.config.draft import DraftConfig
from deepspec.decoding.warp import make_warp
from deepspec.decoding.chain import speculative_generate
from deepspec.decoding.loop import target_generate
from deepspec.drafts import registry
GAMMA = 3


def _learned_drafters():
    import tests.support.drafters  # noqa: F401  (registers fixed_distribution_draft)
    return [n for n in registry.available_drafters() if not getattr(registry.drafter_class(n), "model_free", False)]


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return make_tiny_target("llama", num_layers=2)


def _small_cfg(name):
    return DraftConfig(algorithm=name, gamma=GAMMA, num_layers=1, head_rank=16, ttt_steps=GAMMA)


def _batch(target, gamma, B=2, T=28, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, target.vocab_size, (B, T), generator=g)
    cap = target.capture(ids)
    anchors = torch.stack([torch.randperm(T - gamma - 1, generator=g)[:6] for _ in range(B)])
    return {"input_ids": ids, "loss_mask": torch.ones(B, T, dtype=torch.bool),
            "attention_mask": torch.ones(B, T, dtype=torch.bool), "features": cap.features,
            "last_hidden": cap.last_hidden, "anchors": anchors}


def _train(drafter, target, steps=3):
    drafter.train()
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=3e-3)
    for s in range(steps):
        out = drafter(_batch(target, GAMMA, seed=s))
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    drafter.eval()
    return drafter


def _prompts(target):
    from deepspec.targets.chat import encode_prompt
    g = torch.Generator().manual_seed(3)
    return [encode_prompt(target.tokenizer, [{"role": "user", "content": "Write a poem about the sea."}]),
            torch.randint(10, target.vocab_size, (9,), generator=g).tolist()]


def test_learned_drafters_greedy_lossless(target):
    names = _learned_drafters()
    assert names, "no drafter registered"
    greedy = make_warp(0.0)
    prompts = _prompts(target)
    bases = [target_generate(target, p, max_new_tokens=14, warp=greedy, eos_token_ids=[]).tokens for p in prompts]
    # EOS inside a block: the target's 9th greedy token of the first prompt ends the sequence
    eos = [bases[0][8]]
    ref_eos = target_generate(target, prompts[0], max_new_tokens=14, warp=greedy, eos_token_ids=eos).tokens
    for name in names:
        torch.manual_seed(0)
        drafter = registry.build_drafter(target, _small_cfg(name)).eval()
        for label, d in (("random-init", drafter), ("trained", _train(drafter, target))):
            for p, base in zip(prompts, bases):
                spec = speculative_generate(target, d, p, gamma=GAMMA, max_new_tokens=14, warp=greedy,
                                            eos_token_ids=[])
                assert spec.tokens == base, (name, label)
                assert all(r.drafted == GAMMA and 0 <= r.accepted <= r.proposed for r in spec.rounds)
            spec = speculative_generate(target, d, prompts[0], gamma=GAMMA, max_new_tokens=14, warp=greedy,
                                        eos_token_ids=eos)
            assert spec.tokens == ref_eos and spec.stop_reason == "eos", (name, label)


def test_learned_drafters_sample(target):
    """Sampling mode runs end to end with each drafter's own q (distribution checked in integration)."""
    for name in _learned_drafters():
        torch.manual_seed(0)
        d = registry.build_drafter(target, _small_cfg(name)).eval()
        g = torch.Generator().manual_seed(1)
        spec = speculative_generate(target, d, _prompts(target)[1], gamma=GAMMA, max_new_tokens=12,
                                    warp=make_warp(1.0, top_k=50), generator=g, eos_token_ids=[])
        assert len(spec.tokens) == 12 and all(0 <= t < target.vocab_size for t in spec.tokens)
        conf = [r.confidence for r in spec.rounds]
        assert all(c is None for c in conf) or all(len(c) == GAMMA and all(0 < x < 1 for x in c) for c in conf)
