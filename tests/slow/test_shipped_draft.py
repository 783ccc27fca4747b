"""The DSpark draft shipped inside the package for the reference target: it loads with
`from_pretrained`, carries its provenance, decodes losslessly and accepts above a stated floor."""
import json

import pytest
import torch

pytestmark = pytest.mark.slow

# Measured on PROMPTS with the draft shipped now (2026-12-06, fp32, two threads; the servable DSpark-RNN of 2,000
# steps on 1,251 conversations): chains τ 1.52; trees of 16 nodes, width 4: 1.88; width 8: 1.86; width 8 with
# prompt lookup (n ≤ 3): 2.01.  (The draft shipped before it, with the anchor-feature path, gave 1.45, 1.83, 1.88
# and 2.01: on three prompts the chain's τ moves with the draft more than the trees' do.)
# Each floor sits about 8-12% under its measured value: a trained draft of this quality, not a number a
# different BLAS could move; an untrained draft gives ~1.0.
TAU_FLOOR = 1.35
TREE_TAU_FLOOR = 1.65
LOOKUP_TAU_FLOOR = 1.85


@pytest.fixture(scope="module")
def shipped(reference_target_dir):
    from deepspec.config import TargetConfig
    from deepspec.drafts import load_drafter
    from deepspec.paths import shipped_draft_dir
    from deepspec.targets import load_target
    d = shipped_draft_dir("smollm2_135m")
    assert d is not None, "the package ships no draft for smollm2_135m"
    target = load_target(TargetConfig(path="reference:smollm2-135m", device="cpu"))
    return d, target, load_drafter(d, target).eval()


def test_shipped_draft_has_provenance_and_fits_the_budget(shipped):
    d, _, drafter = shipped
    prov = json.loads((d / "provenance.json").read_text())
    for key in ("command", "commit", "data", "steps", "machine", "heldout"):
        assert key in prov, key
    size = sum(f.stat().st_size for f in d.parent.rglob("*") if f.is_file())
    assert size <= 25 * 2 ** 20, f"shipped drafts take {size / 2 ** 20:.1f} MB (budget 25 MB)"
    assert drafter.algorithm == "dspark"
    # its calibration ships beside it, where the threshold and scheduler policies look for it
    from deepspec.schedule.calibration import find_calibration
    cal = find_calibration(d)
    assert cal is not None and cal.gamma == drafter.cfg.gamma and prov["calibration"]["rounds"] == cal.n_rounds


PROMPTS = ["What is 15 times 4? Explain step by step.", "Write a short Python function that reverses a string.",
           "Give me three tips for a job interview."]


@pytest.fixture(scope="module")
def chain_tau(shipped):
    """τ of the shipped draft's chains over PROMPTS (lossless, checked), decoded once for the tests that use it."""
    _, target, drafter = shipped
    return _tau(target, drafter)


def test_shipped_draft_is_lossless_and_accepts(chain_tau):
    assert chain_tau >= TAU_FLOOR, chain_tau


def _tau(target, drafter, width=None, lookup=None):
    """τ (accepted drafts + the bonus token per round) over PROMPTS of chains (``width`` None) or trees of 16 nodes,
    after checking each output equals plain greedy decoding."""
    from deepspec.decoding.chain import speculative_generate
    from deepspec.decoding.loop import target_generate
    from deepspec.decoding.tree_loop import tree_generate
    from deepspec.decoding.warp import make_warp
    from deepspec.targets import encode_prompt
    torch.set_num_threads(2)
    greedy = make_warp(0.0)
    accepted = rounds = 0
    for text in PROMPTS:
        ids = encode_prompt(target.tokenizer, [{"role": "user", "content": text}])
        base = target_generate(target, ids, max_new_tokens=48, warp=greedy, eos_token_ids=[]).tokens
        kw = dict(gamma=drafter.cfg.gamma, max_new_tokens=48, warp=greedy, eos_token_ids=[])
        if width is None:
            spec = speculative_generate(target, drafter, ids, **kw)
        else:
            spec = tree_generate(target, drafter, ids, nodes=16, width=width, lookup=lookup, **kw)
            assert all(r.proposed <= 16 for r in spec.rounds)
        assert spec.tokens == base
        accepted += sum(r.accepted for r in spec.rounds)
        rounds += len(spec.rounds)
    return (accepted + rounds) / rounds


def test_shipped_draft_tree_verification_is_lossless_and_accepts_more(shipped, chain_tau):
    """Trees of 16 nodes, width 4: the target's output, and more tokens per round than chains on the same prompts."""
    _, target, drafter = shipped
    tree = _tau(target, drafter, width=4)
    assert tree >= TREE_TAU_FLOOR and tree > chain_tau, (chain_tau, tree)


def test_shipped_draft_tree_with_prompt_lookup_is_lossless_and_accepts_more(shipped):
    """The demo's fastest setting (tree 16 × 8 with prompt lookup, n ≤ 3), in fp32: the target's output,
    with more tokens per round than the tree alone on the same prompts."""
    _, target, drafter = shipped
    alone, with_lookup = _tau(target, drafter, width=8), _tau(target, drafter, width=8, lookup=(3, 1))
    assert with_lookup >= LOOKUP_TAU_FLOOR and with_lookup > alone, (alone, with_lookup)
