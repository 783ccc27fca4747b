"""The speculative loop on tiny random targets (fp32): greedy equality, EOS / max-new-tokens
inside a block, τ bookkeeping with the oracle and the always-wrong reference drafters."""
import pytest
import torch

from conftest import make_tiny_target
from deepspec.drafts.model_free import TargetAsDraft
from tests.support.drafters import FixedDistributionDraft
from deepspec.decoding.warp import make_warp
from deepspec.decoding.chain import speculative_generate
from deepspec.decoding.loop import target_generate
from deepspec.targets.chat import encode_prompt

GREEDY = make_warp(0.0)
FAMILIES = ["llama", "qwen3", "gemma3"]


@pytest.fixture(scope="module")
def targets():
    torch.set_num_threads(1)
    return {f: make_tiny_target(f, num_layers=2) for f in FAMILIES}


def _prompts(target, n=2):
    g = torch.Generator().manual_seed(7)
    chat = encode_prompt(target.tokenizer, [{"role": "user", "content": "What is 12 times 7?"}])
    rand = [torch.randint(10, target.vocab_size, (int(L),), generator=g).tolist() for L in (5, 13)]
    return [chat] + rand[: n - 1]


def _drafters(target, gamma):
    return {"oracle": TargetAsDraft(target, gamma=gamma),
            "always_wrong": TargetAsDraft(target, gamma=gamma, logit_scale=-1.0),
            "uniform": FixedDistributionDraft(target, gamma=gamma)}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_target_decode(targets, family):
    t = targets[family]
    gamma = 3
    for i, prompt in enumerate(_prompts(t)):
        n = 20 if i == 0 else 10
        base = target_generate(t, prompt, max_new_tokens=n, warp=GREEDY, eos_token_ids=[])
        assert len(base.tokens) == n
        for name, d in _drafters(t, gamma).items():
            if name == "always_wrong" and i > 0:
                continue  # slowest drafter (γ target forwards per emitted token): one prompt is enough
            spec = speculative_generate(t, d, prompt, gamma=gamma, max_new_tokens=n, warp=GREEDY, eos_token_ids=[])
            assert spec.tokens == base.tokens, (family, name, i)
            assert spec.stop_reason == "max_new_tokens"
            assert 1 + sum(r.emitted for r in spec.rounds) == len(spec.tokens)


def test_tau_bookkeeping_oracle_and_always_wrong(targets):
    t = targets["llama"]
    prompt = _prompts(t)[0]
    gamma = 4
    spec = speculative_generate(t, TargetAsDraft(t, gamma=gamma), prompt, gamma=gamma, max_new_tokens=23,
                                warp=GREEDY, eos_token_ids=[])
    taus = [r.tau for r in spec.rounds]
    assert taus[:-1] == [gamma + 1] * (len(taus) - 1)          # every round but the last: γ + 1
    assert len(spec.tokens) == 23 and len(spec.rounds) == 5     # 1 prefill token + 4 × 5 + last round of 2
    assert spec.rounds[-1].proposed == 1 and spec.rounds[-1].drafted == gamma   # capped by the budget
    wrong = speculative_generate(t, TargetAsDraft(t, gamma=gamma, logit_scale=-1.0), prompt, gamma=gamma,
                                 max_new_tokens=8, warp=GREEDY, eos_token_ids=[])
    assert [r.tau for r in wrong.rounds] == [1] * 7
    assert all(r.confidence is not None and len(r.confidence) == gamma for r in wrong.rounds)
    assert wrong.tokens == spec.tokens[:8]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_eos_inside_a_block(targets, family):
    t = targets[family]
    gamma = 4
    prompt = _prompts(t)[0]
    base = target_generate(t, prompt, max_new_tokens=30, warp=GREEDY, eos_token_ids=[]).tokens
    # pick a token whose first occurrence j falls strictly inside an oracle block
    # (blocks emit tokens 1-5, 6-10, ... after the prefill token 0)
    j = next(j for j in range(2, 30) if base.index(base[j]) == j and (j - 1) % (gamma + 1) not in (gamma,))
    eos = [base[j]]
    ref = target_generate(t, prompt, max_new_tokens=30, warp=GREEDY, eos_token_ids=eos)
    assert ref.tokens == base[: j + 1] and ref.stop_reason == "eos"
    for name, d in _drafters(t, gamma).items():
        if name == "always_wrong":
            continue
        spec = speculative_generate(t, d, prompt, gamma=gamma, max_new_tokens=30, warp=GREEDY, eos_token_ids=eos)
        assert spec.tokens == ref.tokens and spec.stop_reason == "eos", name
        if name == "oracle":
            last = spec.rounds[-1]
            assert last.emitted < last.accepted + 1     # the block was cut at the EOS


def test_max_new_tokens_inside_a_block(targets):
    t = targets["qwen3"]
    prompt = _prompts(t)[0]
    gamma = 4
    base = target_generate(t, prompt, max_new_tokens=12, warp=GREEDY, eos_token_ids=[]).tokens
    for m in (1, 2, 3, 5, 8, 12):
        for d in (TargetAsDraft(t, gamma=gamma), FixedDistributionDraft(t, gamma=gamma)):
            spec = speculative_generate(t, d, prompt, gamma=gamma, max_new_tokens=m, warp=GREEDY, eos_token_ids=[])
            assert spec.tokens == base[:m], (m, type(d).__name__)
            assert all(r.proposed + 1 <= r.drafted + 1 for r in spec.rounds)
        if m == 1:
            assert spec.rounds == []                     # the prefill token alone


def test_sampling_oracle_accepts_everything(targets):
    """q = p under sampling (same warp, same context): every verified draft is accepted."""
    t = targets["llama"]
    prompt = _prompts(t)[0]
    for warp in (make_warp(1.0), make_warp(0.8, top_k=20, top_p=0.9)):
        g = torch.Generator().manual_seed(0)
        spec = speculative_generate(t, TargetAsDraft(t, gamma=3), prompt, gamma=3, max_new_tokens=17, warp=warp,
                                    generator=g, eos_token_ids=[])
        assert [r.accepted for r in spec.rounds] == [r.proposed for r in spec.rounds]
        assert len(spec.tokens) == 17


class _AlternatingPolicy:
    """A verification policy that truncates the draft (ℓ = 0, 1, 2, ...)."""
    name = "alternating"

    def __init__(self):
        self.i = 0

    def lengths(self, confidences):
        assert confidences.shape[0] == 1
        self.i += 1
        return [self.i % (confidences.shape[1] + 1)]


def test_truncating_policy_stays_lossless(targets):
    t = targets["llama"]
    prompt = _prompts(t)[0]
    base = target_generate(t, prompt, max_new_tokens=16, warp=GREEDY, eos_token_ids=[]).tokens
    spec = speculative_generate(t, TargetAsDraft(t, gamma=3), prompt, gamma=3, max_new_tokens=16, warp=GREEDY,
                                eos_token_ids=[], policy=_AlternatingPolicy())
    assert spec.tokens == base
    props = [r.proposed for r in spec.rounds]
    assert 0 in props and max(props) == 3
    assert all(r.accepted == r.proposed for r in spec.rounds)       # oracle: everything verified is accepted


def test_timings_and_rollout_callback(targets):
    t = targets["llama"]
    seen = []
    spec = speculative_generate(t, FixedDistributionDraft(t, gamma=2), _prompts(t)[0], gamma=2, max_new_tokens=6,
                                warp=GREEDY, eos_token_ids=[], on_round=lambda i, r: seen.append((i, r)))
    assert [i for i, _ in seen] == list(range(len(spec.rounds)))
    assert all(r.t_draft >= 0 and r.t_verify > 0 and r.t_overhead >= 0 for r in spec.rounds)
    assert spec.t_total >= spec.t_prefill + spec.t_verify
    with pytest.raises(ValueError):
        speculative_generate(t, FixedDistributionDraft(t, gamma=2), [], gamma=2, max_new_tokens=4, warp=GREEDY)
