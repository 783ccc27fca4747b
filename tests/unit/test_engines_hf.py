"""The embedded transformers engine on tiny random targets."""
from __future__ import annotations

import pytest
import torch

from deepspec.engines.base import GenerationError, SamplingParams
from deepspec.engines.hf import HFEngine

torch.set_num_threads(1)


def _prompts(n):
    return [[{"role": "user", "content": f"hello number {i}" + " tell me more" * (i % 4)}] for i in range(n)]


@pytest.fixture(scope="module")
def llama():
    from deepspec.targets.tiny import build_tiny
    model, tok = build_tiny("llama")
    return model.float(), tok


def test_greedy_batched_equals_one_by_one(llama):
    eng = HFEngine(*llama, batch_size=4)
    sp = SamplingParams(max_new_tokens=10, temperature=0.0)
    P = _prompts(6)
    batched = eng.generate(P, sp)
    single = [HFEngine(*llama, batch_size=1).generate([p], sp)[0] for p in P]
    assert batched == single
    assert all(r.num_tokens == 10 and r.finish_reason == "length" and r.prompt_tokens > 0 for r in batched)


def test_sampling_independent_of_batch_composition(llama):
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95, top_k=50, seed=5)
    P, keys = _prompts(7), [f"s{i}" for i in range(7)]
    a = HFEngine(*llama, batch_size=3).generate(P, sp, keys=keys)
    order = [6, 2, 4, 0, 1, 5, 3]
    b = HFEngine(*llama, batch_size=2).generate([P[i] for i in order], sp, keys=[keys[i] for i in order])
    assert [b[order.index(i)] for i in range(7)] == a
    assert HFEngine(*llama, batch_size=7).generate(P, sp, keys=keys) == a
    # another seed or another key gives another sample
    c = HFEngine(*llama, batch_size=3).generate(P, SamplingParams(max_new_tokens=12, temperature=1.0, seed=6), keys=keys)
    assert c != a
    d = HFEngine(*llama, batch_size=3).generate(P[:1] * 2, sp, keys=["k1", "k2"])
    assert d[0] != d[1]


def test_stops_at_eos(llama):
    model, tok = llama
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    P = _prompts(2)
    eng = HFEngine(model, tok)
    # declare the first greedy token of prompt 0 to be an end-of-sequence token
    with torch.no_grad():
        tok0 = int(model(torch.tensor([eng.encode(P[0])])).logits[0, -1].argmax())
    eng2 = HFEngine(model, tok, eos_token_ids=[tok0])
    r = eng2.generate(P[:1], sp)[0]
    assert r == "" and r.finish_reason == "stop" and r.num_tokens == 1
    assert eng.eos_token_ids == sorted({tok.eos_token_id})


def test_prompt_too_long_is_per_sample(llama):
    eng = HFEngine(*llama, batch_size=4, max_prompt_tokens=40)
    P = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "word " * 100}]]
    ok, bad = eng.generate(P, SamplingParams(max_new_tokens=4, temperature=0.0))
    assert isinstance(ok, str) and ok.num_tokens == 4
    assert isinstance(bad, GenerationError) and bad.code == "prompt_too_long" and not bad.retryable


def test_template_error_is_per_sample(llama):
    eng = HFEngine(*llama)
    out = eng.generate([[{"role": "user", "content": "hi"}], [{"role": "user", "content": None}]],
                       SamplingParams(max_new_tokens=2, temperature=0.0))
    assert isinstance(out[0], str) and out[0].num_tokens == 2
    assert isinstance(out[1], GenerationError) and out[1].code == "bad_request"


def test_thinking_switch_via_template_kwargs():
    from deepspec.targets.tiny import build_tiny
    model, tok = build_tiny("qwen3")
    msgs = [{"role": "user", "content": "hi"}]
    off = HFEngine(model, tok, chat_template_kwargs={"enable_thinking": False})
    on = HFEngine(model, tok, chat_template_kwargs={"enable_thinking": True})
    assert "<think>" in tok.decode(off.encode(msgs)) and "<think>" not in tok.decode(on.encode(msgs))
    r = off.generate([msgs], SamplingParams(max_new_tokens=3, temperature=0.0))[0]
    assert isinstance(r, str)


def test_from_config_tiny_target():
    from deepspec.config import load_config
    cfg = load_config(["target.path=tiny:qwen3", "target.enable_thinking=false", "target.dtype=float32",
                       "engine.batch_size=3", "engine.max_prompt_tokens=64"])
    eng = HFEngine.from_config(cfg, device="cpu")
    assert eng.batch_size == 3 and eng.max_prompt_tokens == 64
    assert eng.chat_template_kwargs == {"enable_thinking": False}
    assert eng.describe()["engine"] == "hf" and eng.parallelism == 3
    out = eng.generate(_prompts(2), SamplingParams(max_new_tokens=3, temperature=0.7), keys=["a", "b"])
    assert all(isinstance(o, str) for o in out)


def test_hub_generation_defaults_do_not_leak(llama):
    """A model's own generation_config (repetition penalty, sampling flags, ...) is ignored."""
    import copy
    model, tok = llama
    P = _prompts(3)
    sp0 = SamplingParams(max_new_tokens=12, temperature=0.0)
    sp1 = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)
    a0, a1 = HFEngine(model, tok).generate(P, sp0), HFEngine(model, tok).generate(P, sp1, keys=["a", "b", "c"])
    saved = copy.deepcopy(model.generation_config)
    try:
        g = model.generation_config
        g.do_sample, g.temperature, g.top_k, g.top_p = True, 0.6, 20, 0.5
        g.repetition_penalty, g.no_repeat_ngram_size, g.min_new_tokens = 1.5, 2, 5
        assert HFEngine(model, tok).generate(P, sp0) == a0
        assert HFEngine(model, tok).generate(P, sp1, keys=["a", "b", "c"]) == a1
        assert model.generation_config.repetition_penalty == 1.5  # restored after the call
    finally:
        model.generation_config = saved


@pytest.mark.parametrize("loop", ["deepspec", "static"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_own_loops_equal_generate_with_rows_finishing_early(llama, temperature, loop):
    """The engine's decode loops (finished rows leave the batch; static cache, graph-ready) give the
    tokens of transformers' generate, greedy and sampled, also when rows end at different steps."""
    model, tok = llama
    sp = SamplingParams(max_new_tokens=16, temperature=temperature, seed=3)
    P, keys = _prompts(8), [f"k{i}" for i in range(8)]
    ref = HFEngine(model, tok, batch_size=8, loop="generate")
    raw = [ref.encode(p) for p in P]
    full = ref._generate_hf(raw, [0] * 8, SamplingParams(max_new_tokens=16, temperature=0.0))
    # an end-of-sequence token that most rows meet, at different steps, and some row never does
    rows_with = {t: sum(t in r for r in full) for r in full for t in r}
    eos = [max((t for t, n in rows_with.items() if n < len(full)), key=lambda t: (rows_with[t], -t))]
    a = HFEngine(model, tok, batch_size=8, loop="generate", eos_token_ids=eos).generate(P, sp, keys=keys)
    b = HFEngine(model, tok, batch_size=8, eos_token_ids=eos, loop=loop).generate(P, sp, keys=keys)
    assert [(x.text, x.num_tokens, x.finish_reason) for x in a] == [(x.text, x.num_tokens, x.finish_reason) for x in b]
    if temperature == 0:
        assert {x.finish_reason for x in b} == {"stop", "length"} and len({x.num_tokens for x in b}) > 2


def test_unknown_loop_is_refused(llama):
    with pytest.raises(ValueError, match="hf_loop"):
        HFEngine(*llama, loop="fast")


def test_auto_loop_is_the_dynamic_one_on_cpu_and_static_is_refused_for_sliding_windows(llama):
    assert HFEngine(*llama).loop == "deepspec"
    from deepspec.targets.tiny import build_tiny
    model, tok = build_tiny("gemma3")
    with pytest.raises(ValueError, match="hf_loop=static"):
        HFEngine(model, tok, loop="static")
