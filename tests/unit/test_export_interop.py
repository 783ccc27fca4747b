"""Our engine exports, loaded and run by the peers' own code: speculators (the vllm format) and SpecForge
(the sglang format, which SGLang reads too).

For every draft kind: the peer's loader reports no missing or unexpected keys, the token embedding it
uses is the target's, and its logits match our drafter's within 1e-4 with the same top-1 token at
every position, the target features taken the peer's way (speculators: ``hidden_states[aux id]``;
SpecForge: its ``extract_context_feature``).  Features of the next layer up must fail that
comparison.  A reduced draft vocabulary in SpecForge (every token scored, the vocabulary one more
Markov rank dimension): the logits on the draft vocabulary are compared, the full-vocabulary top-1
must be ours, and the softmax must put exactly 0 outside the draft vocabulary.  A test skips only
when the peer library cannot be imported (``bash tools/install.sh`` installs both).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepspec.config import TargetConfig
from deepspec.config.draft import DraftConfig
from deepspec.drafts import build_drafter
from deepspec.export import export_draft
from deepspec.targets import load_target
from deepspec.targets.tiny import save_tiny

pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("one_thread")]
G, T, N_DRAFT = 4, 16, 100


def peer(module: str):
    """The peer module, or a skip naming what is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.skip(f"{module.split('.')[0]} cannot be imported ({e}); bash tools/install.sh installs it")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("target") / "llama")


def make_target(path, layer_ids):
    return load_target(TargetConfig(path=str(path), dtype="float32", device="cpu", layer_ids=layer_ids))


def trained(target, reduced: bool, seed: int = 0, **kw):
    """A drafter with every parameter moved off its init; ``reduced``: a draft vocabulary of N_DRAFT tokens."""
    torch.manual_seed(seed)
    d = build_drafter(target, DraftConfig(num_layers=1, gamma=G, head_rank=8,
                                          vocab_size=N_DRAFT if reduced else None, **kw))
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    if reduced:
        g = torch.Generator().manual_seed(seed + 1)
        rest = torch.randperm(target.vocab_size - 2, generator=g)[:N_DRAFT - 2] + 1
        d.set_draft_vocab(torch.cat([torch.tensor([0, target.vocab_size - 1]), rest]).sort().values)
    return d.eval()


def export(d, target, target_dir, root: Path, fmts):
    d.save_pretrained(root / "ckpt")
    for fmt in fmts:
        export_draft(root / "ckpt", root / fmt, fmt, target=target, target_path=str(target_dir))
    return root


def probe(target, seed: int = 1):
    """Token ids [1, T], our batch (features = decoder-layer outputs) and the target's ``hidden_states``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, int(target.vocab_size), (1, T), generator=g)
    cap = target.capture(ids)
    ones = torch.ones(1, T, dtype=torch.bool)
    batch = {"input_ids": ids, "attention_mask": ones, "loss_mask": ones, "features": cap.features,
             "last_hidden": cap.last_hidden, "anchors": torch.arange(T - G)[None]}
    with torch.no_grad():
        hidden_states = target.model(ids, output_hidden_states=True).hidden_states
    return ids, batch, hidden_states


def agreement(theirs: torch.Tensor, ours: torch.Tensor):
    """(max |Δ logit|, top-1 identical at every position)."""
    assert theirs.shape == ours.shape, (theirs.shape, ours.shape)
    return float((theirs.float() - ours.float()).abs().max()), bool(torch.equal(theirs.argmax(-1), ours.argmax(-1)))


def assert_match_and_shift_fails(compute, ours):
    delta, top1 = agreement(compute(0), ours)
    assert delta <= 1e-4 and top1, (delta, top1)
    delta, top1 = agreement(compute(1), ours)         # features of the next layer up
    assert delta > 1e-2 and not top1, (delta, top1)
    return delta


# -- speculators (the vllm format) --------------------------------------------------------------------------
def speculators_model(path: Path):
    """speculators' own loader (eager attention on the CPU), after its loading report shows no missing or
    unexpected keys (taken from the `PreTrainedModel.from_pretrained` that speculators' loader calls)."""
    speculators = peer("speculators")
    from transformers import PreTrainedModel
    cfg = speculators.SpeculatorModelConfig.from_pretrained(path)
    cfg.transformer_layer_config._attn_implementation = "eager"
    cls = speculators.SpeculatorModel.registered_model_class_from_config(cfg)
    _, info = PreTrainedModel.from_pretrained.__func__(cls, path, config=cfg, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return speculators.SpeculatorModel.from_pretrained(path, config=cfg).eval()


def speculators_blocks(m, ids, hidden_states, shift: int) -> torch.Tensor:
    """speculators' DSpark block logits [anchors, γ, draft vocab] at every anchor 0..T-γ-1, as its forward
    composes them (``_backbone_forward`` over every valid anchor, then the Markov head's ``block_bias``)."""
    feats = torch.cat([hidden_states[i + shift] for i in m.config.aux_hidden_state_layer_ids], -1)
    A = T - G
    with torch.no_grad():
        hidden, logits, _, _, idx = m._backbone_forward(feats, ids, torch.ones(1, T), hidden_states[-1],
                                                        torch.zeros(1, T, dtype=torch.long), max_anchors=A)
        logits = logits.view(A, G, -1)
        if m.markov_head is not None:
            logits = logits + m.markov_head.block_bias(prev_token_ids=ids[0, idx].view(A, G),
                                                       hidden_states=hidden.view(A, G, -1))
    return logits


# -- SpecForge (the sglang format) --------------------------------------------------------------------------
def specforge_dspark(path: Path):
    auto = peer("specforge.modeling.auto")
    m, info = auto.AutoDraftModel.from_pretrained(str(path), output_loading_info=True, attn_implementation="eager")
    assert not any(info.values()), info
    return m.eval()


def specforge_blocks(m, target, ids, hidden_states, shift: int):
    """SpecForge's DSpark logits [anchors, γ, V] (and confidence logits [anchors, γ] or None): one block
    ``[x_p, mask…]`` per anchor p over the context features of positions < p (its ``spec_generate`` step),
    base logits from the target's LM head, then its ``apply_logits_head`` (Markov / RNN) and
    ``predict_confidence`` with the block's teacher tokens."""
    dflash = peer("specforge.modeling.draft.dflash")
    feats = dflash.extract_context_feature(hidden_states, [i + shift for i in m.target_layer_ids])
    logits, conf = [], []
    for p in range(T - G):
        block = torch.full((1, G), int(m.mask_token_id))
        block[0, 0] = ids[0, p]
        prev = ids[:, p:p + G]
        with torch.no_grad():
            h = m(position_ids=torch.arange(p + G)[None], noise_embedding=target.model.model.embed_tokens(block),
                  target_hidden=feats[:, :p])
            logits.append(m.apply_logits_head(target.model.lm_head(h), prev_token_ids=prev, hidden_states=h)[0])
            c = m.predict_confidence(h, prev_token_ids=prev)
        if c is not None:
            conf.append(c[0])
    return torch.stack(logits), (torch.stack(conf) if conf else None)


PARALLEL = {"dspark_markov": dict(algorithm="dspark", sequential_head="markov"),
            "dspark_rnn": dict(algorithm="dspark", sequential_head="rnn"),
            # W1 as a map of the target embedding: written as the table it stands for
            "dspark_markov_w1_target": dict(algorithm="dspark", sequential_head="markov", head_embedding="target"),
            "dflash": dict(algorithm="dflash", sequential_head="none", confidence_head=False)}


@pytest.mark.parametrize("reduced", [False, True], ids=["full_vocab", "draft_vocab"])
@pytest.mark.parametrize("kind", list(PARALLEL))
def test_speculators_runs_our_parallel_export(tiny_dir, tmp_path, kind, reduced):
    target = make_target(tiny_dir, [1, 2])
    d = trained(target, reduced, **PARALLEL[kind])
    root = export(d, target, tiny_dir, tmp_path, ["vllm"])
    m = speculators_model(root / "vllm")
    assert torch.equal(m.embed_tokens.weight, target.embed_tokens.weight)
    if reduced:
        assert torch.equal(m.d2t + torch.arange(N_DRAFT), d.draft_vocab) and int(m.t2d.sum()) == N_DRAFT
    ids, batch, hs = probe(target)
    with torch.no_grad():
        ours = d.block_logits(batch)["logits"][0]                 # [anchors, γ, draft vocabulary]
    assert_match_and_shift_fails(lambda s: speculators_blocks(m, ids, hs, s), ours)


def mass_outside(logits: torch.Tensor, vocab: torch.Tensor) -> float:
    """The largest softmax probability mass (fp32) that logits [..., V] put outside the token ids ``vocab``."""
    p = torch.softmax(logits.float(), -1)
    outside = torch.ones(p.shape[-1], dtype=torch.bool)
    outside[vocab] = False
    return float(p[..., outside].sum(-1).max()) if bool(outside.any()) else 0.0


@pytest.mark.parametrize("reduced", [False, True], ids=["full_vocab", "draft_vocab"])
@pytest.mark.parametrize("kind", list(PARALLEL))
def test_specforge_runs_our_sglang_export(tiny_dir, tmp_path, kind, reduced):
    target = make_target(tiny_dir, [1, 2])
    d = trained(target, reduced, seed=2, **PARALLEL[kind])
    root = export(d, target, tiny_dir, tmp_path, ["sglang"])
    m = specforge_dspark(root / "sglang")
    assert type(m).__name__ == "DSparkDraftModel" and m.mask_token_id == d.mask_token_id
    # SpecForge's DSpark holds no embedding of its own: its loop embeds with the target's module
    assert not any("embed" in k for k in m.state_dict())
    ids, batch, hs = probe(target)
    with torch.no_grad():
        ours = d.block_logits(batch)
    vocab = d.draft_vocab if reduced else torch.arange(target.vocab_size)
    theirs, conf = specforge_blocks(m, target, ids, hs, 0)              # [anchors, γ, V]: every target token
    assert mass_outside(theirs, vocab) == 0.0
    assert torch.equal(theirs.argmax(-1), vocab[ours["logits"][0].argmax(-1)])
    assert_match_and_shift_fails(lambda s: specforge_blocks(m, target, ids, hs, s)[0][..., vocab], ours["logits"][0])
    if d.cfg.confidence_head:            # its confidence head reads what ours reads
        assert float((conf - ours["confidence"][0]).abs().max()) <= 1e-4
    else:
        assert conf is None


@pytest.mark.parametrize("damage", ["constant", "column_set"])
def test_a_wrong_vocabulary_dimension_fails_in_specforge(tiny_dir, tmp_path, damage):
    """The comparison above can fail: −1 instead of −2¹⁴ outside the draft vocabulary leaves probability there;
    one draft token swapped with an outside token in markov_w2's last column moves a draft logit by ~2¹⁴."""
    target = make_target(tiny_dir, [1, 2])
    d = trained(target, True, seed=2, **PARALLEL["dspark_markov"])
    path = export(d, target, tiny_dir, tmp_path, ["sglang"]) / "sglang"
    w = load_file(str(path / "model.safetensors"))
    col = w["markov_head.markov_w2.weight"][:, -1]
    if damage == "constant":
        col[col != 0] = -1.0
    else:
        inside, outside = int((col == 0).nonzero()[0]), int((col != 0).nonzero()[0])
        col[inside], col[outside] = col[outside].clone(), 0.0
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    m = specforge_dspark(path)
    ids, batch, hs = probe(target)
    with torch.no_grad():
        ours = d.block_logits(batch)["logits"][0]
    theirs = specforge_blocks(m, target, ids, hs, 0)[0]
    delta, _ = agreement(theirs[..., d.draft_vocab], ours)
    if damage == "constant":
        assert delta <= 1e-4 and mass_outside(theirs, d.draft_vocab) > 0.1
    else:
        assert delta > 1e3 and mass_outside(theirs, d.draft_vocab) > 1e-30


def test_specforge_decoding_loop_gives_plain_greedy_tokens(tiny_dir, tmp_path):
    """SpecForge's own ``spec_generate`` with our exported DSpark draft reproduces the target's greedy tokens
    (it pre-fills blocks with our mask token and scans them for stop tokens)."""
    import transformers
    target = make_target(tiny_dir, [1, 2])
    root = export(trained(target, False, seed=3, **PARALLEL["dspark_markov"]), target, tiny_dir, tmp_path,
                  ["sglang"])
    m = specforge_dspark(root / "sglang")
    meta = importlib.metadata.metadata("specforge").get_all("Requires-Dist") or []
    pin = next((r.split("==")[1] for r in meta if r.startswith("transformers==")), None)
    if pin and transformers.__version__ != pin:
        pytest.skip(f"SpecForge's spec_generate needs its pinned transformers=={pin} (its DynamicCache.crop(n) "
                    f"keeps n tokens; transformers {transformers.__version__} refuses a positive n)")
    eos = target.tokenizer.eos_token_id
    for text in ["Hello! How can I help", "def add(a, b):", "What is 12 times 7?"]:
        ids = torch.tensor([target.tokenizer.encode(text)])
        with torch.no_grad():
            greedy = target.model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=eos,
                                           pad_token_id=eos)
            spec = m.spec_generate(target.model, ids, max_new_tokens=24, stop_token_ids=[eos], temperature=0.0)
        assert mask_absent(greedy, m.mask_token_id) and torch.equal(spec, greedy)


def mask_absent(tokens: torch.Tensor, mask: int) -> bool:
    """spec_generate drops every mask-token id from its output: the comparison needs greedy text without it."""
    return not bool((tokens == int(mask)).any())


# -- EAGLE-3 ---------------------------------------------------------------------------------------------
def speculators_chain(m, ids, hidden_states, shift: int, steps: int, inside) -> torch.Tensor:
    """speculators' EAGLE-3 training-time-test logits at every chain step inside the probe: its forward with
    teacher forcing (entry i = fc(features of x_i) with the embedding of x_{i+1}), each step's ``lm_head``
    output observed with a forward hook."""
    feats = torch.cat([hidden_states[i + shift] for i in m.config.eagle_aux_hidden_state_layer_ids], -1)[:, :-1]
    seen = []
    hook = m.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    try:
        with torch.no_grad():
            m(feats, ids[:, 1:], torch.zeros(1, T - 1, dtype=torch.long), ttt_steps=steps)
    finally:
        hook.remove()
    return torch.stack([x[0] for x in seen])[inside]


def specforge_eagle3(path: Path):
    """SpecForge's ``LlamaForCausalLMEagle3`` holding our weights.  Its loader (``AutoDraftModel.from_pretrained``)
    must report no missing or unexpected keys; the model that runs is built by SpecForge's ``from_config``
    and loaded with ``load_state_dict(strict=True)``: under transformers 5.x's meta-device loading its
    rotary ``inv_freq`` / cos / sin caches (non-persistent buffers) come back uninitialised."""
    auto = peer("specforge.modeling.auto")
    from transformers import AutoConfig
    _, info = auto.AutoDraftModel.from_pretrained(str(path), output_loading_info=True)
    assert not any(info.values()), info
    m = auto.AutoDraftModel.from_config(AutoConfig.from_pretrained(str(path)))
    m.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
    return m.eval()


@pytest.mark.parametrize("reduced", [False, True], ids=["full_vocab", "draft_vocab"])
def test_peers_run_our_eagle3_exports(tiny_dir, tmp_path, reduced):
    target = make_target(tiny_dir, [0, 1, 2])
    d = trained(target, reduced, seed=4, algorithm="eagle3", eagle3_layout="engine", ttt_steps=3)
    root = export(d, target, tiny_dir, tmp_path, ["vllm", "sglang"])
    ids, batch, hs = probe(target)
    with torch.no_grad():
        ours = d.step_logits(batch)[0]                   # [steps, T, vocab]: [j, r] predicts x_{r+2+j}
    steps = 3
    inside = (torch.arange(T - 1)[None] + torch.arange(steps)[:, None]) <= T - 3    # x_{r+1+j} is in the probe
    m = speculators_model(root / "vllm")
    assert torch.equal(m.embed_tokens.weight, target.embed_tokens.weight)
    assert (m.d2t is not None) == reduced
    assert_match_and_shift_fails(lambda s: speculators_chain(m, ids, hs, s, steps, inside),
                                 ours[:steps, :T - 1][inside])
    sf = specforge_eagle3(root / "sglang")
    assert torch.equal(sf.embed_tokens.weight, target.embed_tokens.weight)
    dflash = peer("specforge.modeling.draft.dflash")
    layer_ids = json.loads((root / "sglang" / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"]

    def first_step(shift):
        feats = dflash.extract_context_feature(hs, [i + shift for i in layer_ids])[:, :-1]
        with torch.no_grad():
            return sf.lm_head(sf(hidden_states=feats, inputs_embeds=sf.embed_tokens(ids[:, 1:])))[0]
    assert_match_and_shift_fails(first_step, ours[0, :T - 1])


def test_export_configs_name_what_each_reader_reads(tiny_dir, tmp_path):
    """The sglang config states the heads where SGLang builds them (top level) and where SpecForge reads them
    (dflash_config), with equal values; SpecForge's GQA check passes."""
    target = make_target(tiny_dir, [1, 2])
    root = export(trained(target, False, **PARALLEL["dspark_rnn"]), target, tiny_dir, tmp_path, ["sglang"])
    cfg = json.loads((root / "sglang" / "config.json").read_text())
    for key in ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                "block_size"):
        assert cfg[key] == cfg["dflash_config"][key]
    assert set(load_file(str(root / "sglang" / "model.safetensors"))) == set(specforge_dspark(root / "sglang")
                                                                            .state_dict()) - {"rotary_emb.inv_freq"}


@pytest.mark.slow
@pytest.mark.parametrize("reduced", [False, True], ids=["full_vocab", "draft_vocab"])
def test_smollm2_dspark_rnn_in_both_peers(reference_target_dir, tmp_path, reduced):
    """The reference target: a DSpark-RNN draft over its default 5 feature layers, full or reduced vocabulary."""
    target = make_target(reference_target_dir, None)
    d = trained(target, reduced, seed=5, algorithm="dspark", sequential_head="rnn")
    root = export(d, target, reference_target_dir, tmp_path, ["vllm", "sglang"])
    ids, batch, hs = probe(target)
    with torch.no_grad():
        ours = d.block_logits(batch)["logits"][0]
    m = speculators_model(root / "vllm")
    assert torch.equal(m.embed_tokens.weight, target.embed_tokens.weight)
    assert_match_and_shift_fails(lambda s: speculators_blocks(m, ids, hs, s), ours)
    sf = specforge_dspark(root / "sglang")
    vocab = d.draft_vocab if reduced else torch.arange(target.vocab_size)
    assert mass_outside(specforge_blocks(sf, target, ids, hs, 0)[0], vocab) == 0.0
    assert_match_and_shift_fails(lambda s: specforge_blocks(sf, target, ids, hs, s)[0][..., vocab], ours)
    from deepspec.export.check import check_draft
    for fmt in ("vllm", "sglang"):                # `deepspec check` on the exports: the mask token <empty_output>
        report = check_draft(root / fmt, target)
        assert report.ok, report.render()
        assert "'<empty_output>'" in next(f.detail for f in report.findings if f.name == "mask token")
