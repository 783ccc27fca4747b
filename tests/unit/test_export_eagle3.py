"""`deepspec export --to vllm|sglang` of Eagle3 drafts (draft.eagle3_layout=engine).

Round trips (export → import → identical logits), config fields against the engines'
schemas, refusals, and an independent plain-torch forward of the engines' EAGLE-3 layer
that reads the exported tensors by the engines' key names and must reproduce our drafter.
"""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from deepspec.config import TargetConfig
from deepspec.config.draft import DraftConfig
from deepspec.drafts import build_drafter
from deepspec.export import ExportUnsupported, ImportUnsupported, SchemaError, export_draft, import_draft
from deepspec.export.api import probe_batch
from deepspec.export.check import check_draft
from deepspec.export.cli import main as export_main
from deepspec.export.schemas import SCHEMAS, validate
from deepspec.targets import load_target

TINY = "tiny:llama"
IDS = [0, 1, 2]
PREFIX = {"vllm": "layers.0.", "sglang": "midlayer."}
LAYER_KEYS = {"input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
              "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return load_target(TargetConfig(path=TINY, dtype="float32", device="cpu", layer_ids=IDS))


def _trained(target, layout="engine", seed=0):
    torch.manual_seed(seed)
    d = build_drafter(target, DraftConfig(algorithm="eagle3", num_layers=1, gamma=4, ttt_steps=3,
                                          eagle3_layout=layout))
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return d.eval()


@pytest.fixture(scope="module")
def exported(target, tmp_path_factory):
    """One engine-layout draft, its checkpoint and both engine exports."""
    root = tmp_path_factory.mktemp("e3")
    d = _trained(target)
    d.save_pretrained(root / "ckpt")
    res = {fmt: export_draft(root / "ckpt", root / fmt, fmt, target=target, target_path=TINY)
           for fmt in ("vllm", "sglang")}
    return d, root, res


# -- an independent forward of the engines' EAGLE-3 layer, from the exported tensors ------------------------
def _engine_last(W, pre, c, embs, hiddens, pos):
    """Pre-norm output of the last entry, which attends to every entry (vLLM/SGLang layer 0)."""
    eps, nh, nkv, hd = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x):                                                  # x [n, heads, hd] at positions pos
        inv = 1.0 / c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = torch.cat([pos.double()[:, None] * inv] * 2, -1).float()[:, None, :]
        return x * ang.cos() + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * ang.sin()

    x = torch.cat([rms(embs, W[pre + "input_layernorm.weight"]), rms(hiddens, W[pre + "hidden_norm.weight"])], -1)
    q = rope((x @ W[pre + "self_attn.q_proj.weight"].T).view(-1, nh, hd))[-1:]
    k = rope((x @ W[pre + "self_attn.k_proj.weight"].T).view(-1, nkv, hd)).repeat_interleave(nh // nkv, 1)
    v = (x @ W[pre + "self_attn.v_proj.weight"].T).view(-1, nkv, hd).repeat_interleave(nh // nkv, 1)
    att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5, -1)
    h = hiddens[-1:] + torch.einsum("hqk,khd->qhd", att, v).reshape(1, -1) @ W[pre + "self_attn.o_proj.weight"].T
    m = rms(h, W[pre + "post_attention_layernorm.weight"])
    return h + (F.silu(m @ W[pre + "mlp.gate_proj.weight"].T) * (m @ W[pre + "mlp.up_proj.weight"].T)) \
        @ W[pre + "mlp.down_proj.weight"].T


def engine_chain(out_dir, fmt, feats, ids, root, steps, embed_table):
    """Logits [steps, V] of the engine's draft chain after prompt x_0..x_{root+1}, from the exported files."""
    cfg = json.loads((out_dir / "config.json").read_text())
    c = cfg["transformer_layer_config"] if fmt == "vllm" else cfg
    W = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(out_dir / "model.safetensors")).items()}
    eps = c["rms_norm_eps"]
    embs = embed_table[ids[1:root + 2]]                             # entry i: token x_{i+1} ...
    hiddens = feats[:root + 1] @ W["fc.weight"].T                  # ... with fc(features of x_i), at position i
    pos = torch.arange(root + 1)
    rows = []
    for j in range(steps):
        h = _engine_last(W, PREFIX[fmt], c, embs, hiddens, pos)
        hn = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * W["norm.weight"]
        draft = hn @ W["lm_head.weight"].T
        full = torch.full((1, c["vocab_size"]), float("-inf"))
        full[:, torch.arange(cfg["draft_vocab_size"]) + W.get("d2t", 0)] = draft
        rows.append(full)
        embs = torch.cat([embs, embed_table[ids[root + 2 + j:root + 3 + j]]])    # next step: x_{root+2+j} ...
        hiddens, pos = torch.cat([hiddens, h]), torch.cat([pos, pos[-1:] + 1])   # ... with the pre-norm output
    return torch.cat(rows)


# -- tests --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_round_trip_config_and_weights(target, exported, fmt):
    d, root, res = exported
    out = root / fmt
    cfg = json.loads((out / "config.json").read_text())
    assert validate(cfg, SCHEMAS[{"vllm": "speculators_eagle3", "sglang": "sglang_eagle3"}[fmt]]) == []
    layer = cfg["transformer_layer_config"] if fmt == "vllm" else cfg
    assert (layer["model_type"], layer["num_hidden_layers"], layer["hidden_size"], layer["head_dim"]) == \
        ("llama", 1, target.hidden_size, d.dims.head_dim)
    assert cfg["draft_vocab_size"] == layer["vocab_size"] == target.vocab_size and cfg["norm_before_residual"] is False
    if fmt == "vllm":
        assert (cfg["speculators_model_type"], cfg["architectures"]) == ("eagle3", ["Eagle3Speculator"])
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in IDS]   # vLLM: input of layer k
        assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
        assert cfg["target_hidden_size"] is None
    else:
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and "speculators_model_type" not in cfg
        assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": IDS, "use_aux_hidden_state": True}
        assert cfg["tie_word_embeddings"] is False
    w = load_file(str(out / "model.safetensors"))
    # d2t / t2d: SpecForge's model (the sglang format's other reader) holds them always, speculators' full-vocabulary
    # model never; the embedding is the target's (speculators keeps what the checkpoint holds)
    maps = {"d2t", "t2d"} if fmt == "sglang" else set()
    assert set(w) == {PREFIX[fmt] + k for k in LAYER_KEYS} | {"fc.weight", "norm.weight", "lm_head.weight",
                                                            "embed_tokens.weight"} | maps
    H = target.hidden_size
    assert w[PREFIX[fmt] + "self_attn.q_proj.weight"].shape[1] == 2 * H and w["fc.weight"].shape == (H, 3 * H)
    assert torch.equal(w["lm_head.weight"], target.lm_head.weight.detach())
    assert torch.equal(w["embed_tokens.weight"], target.embed_tokens.weight.detach())
    if maps:
        assert w["d2t"].dtype == torch.int64 and not w["d2t"].any() and w["t2d"].dtype == torch.bool and w["t2d"].all()
    assert res[fmt].verified["reimport_max_abs_diff"] == 0.0 and res[fmt].verified["engine_max_abs_diff"] < 1e-5
    # re-import: the same drafter (teacher-forced chains inside the probe, and decoding)
    back = import_draft(out, target)
    assert back.cfg.eagle3_layout == "engine" and back.algorithm == "eagle3"
    batch = probe_batch(target, 4, seed=3)
    a, b = d.step_logits(batch)[:, :3], back.step_logits(batch)[:, :3]
    T = a.shape[2]
    inside = (torch.arange(T)[None, :] + torch.arange(3)[:, None]) <= T - 2
    assert torch.equal(a[0][inside], b[0][inside])
    ids, feats = batch["input_ids"][0], batch["features"][0]
    greedy = lambda logits: F.one_hot(logits.argmax(-1), logits.shape[-1]).float()   # noqa: E731
    p1 = d.propose(d.init_state(ids[:6], feats[:6]), int(ids[6]), 4, greedy)
    p2 = back.propose(back.init_state(ids[:6], feats[:6]), int(ids[6]), 4, greedy)
    assert torch.equal(p1.tokens, p2.tokens)


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_independent_engine_forward_reproduces_step_logits(target, exported, fmt):
    """A plain-torch EAGLE-3 layer reading the exported tensors by the engines' names == our drafter."""
    d, root, _ = exported
    batch = probe_batch(target, 4, seed=7)
    ours = d.step_logits(batch)[0]                                 # [S, T, V]: [j, r] predicts x_{r+2+j}
    S, T = ours.shape[0], ours.shape[1]
    table = target.embed_tokens.weight.detach().float()            # the engines embed with the raw table
    feats, ids = batch["features"][0].float(), batch["input_ids"][0]
    for r in range(T - 1):
        steps = min(S, T - 1 - r)
        ref = engine_chain(root / fmt, fmt, feats, ids, r, steps, table)
        torch.testing.assert_close(ref, ours[:steps, r], atol=1e-5, rtol=1e-5)


def test_native_layout_refused_for_engines(target, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    _trained(target, layout="native", seed=1).save_pretrained(ckpt)
    for fmt in ("vllm", "sglang"):
        with pytest.raises(ExportUnsupported, match="draft.eagle3_layout=engine") as e:
            export_draft(ckpt, tmp_path / fmt, fmt, target=target)
        assert "in_proj" in str(e.value) and "q/k RMSNorm" in str(e.value) and not (tmp_path / fmt).exists()
    tgt = ["--target-path", TINY, "target.dtype=float32", f"target.layer_ids=[{','.join(map(str, IDS))}]"]
    assert export_main(["--to", "vllm", str(ckpt), str(tmp_path / "v"), *tgt]) == 3
    assert "eagle3_layout=engine" in capsys.readouterr().err
    res = export_draft(ckpt, tmp_path / "hf", "hf", target=target)
    assert res.verified["reimport_max_abs_diff"] == 0.0


def test_engine_layout_over_other_than_3_layers_trains_but_is_not_exported(tmp_path):
    """DeepSpec's Eagle3 is the engine layer over 5 target layers: it builds and trains; the engines' fc takes
    3·hidden, so the export refuses it naming the count and writes nothing."""
    t = load_target(TargetConfig(path=TINY, dtype="float32", device="cpu", layer_ids=[0, 1]))
    d = _trained(t, seed=3)
    assert d.fc.in_features == 2 * t.hidden_size
    d.save_pretrained(tmp_path / "ckpt")
    for fmt in ("vllm", "sglang"):
        with pytest.raises(ExportUnsupported, match="2 target feature layers"):
            export_draft(tmp_path / "ckpt", tmp_path / fmt, fmt, target=t)
        assert not (tmp_path / fmt).exists()


def test_unordered_layer_ids_refused(tmp_path):
    t = load_target(TargetConfig(path=TINY, dtype="float32", device="cpu", layer_ids=[2, 0, 1]))
    with pytest.raises(ValueError, match="strictly increasing target.layer_ids"):
        _trained(t)


@pytest.mark.parametrize("fmt, cfg_edit, w_edit, err, needle", [
    ("vllm", lambda c: c.pop("norm_before_residual"), None, ImportUnsupported, "norm_before_residual is true"),
    ("sglang", lambda c: c.update(norm_before_residual=True), None, ImportUnsupported, "norm_before_residual"),
    ("vllm", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 3, 4]), None, ImportUnsupported,
     r"target.layer_ids=\[1, 2, 3\]"),
    ("sglang", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 1]), None, SchemaError,
     "needs at least 3 item"),
    ("sglang", None, lambda w: w["d2t"].__setitem__(0, 5), ImportUnsupported, "d2t is not the identity"),
    ("sglang", None, lambda w: w["lm_head.weight"].mul_(2), ImportUnsupported, "lm_head.weight differs"),
    ("vllm", lambda c: c.update(target_hidden_size=128), None, ImportUnsupported, "target_hidden_size 128"),
])
def test_import_refuses_what_has_no_equivalent(target, exported, tmp_path, edited_draft, fmt, cfg_edit, w_edit, err,
                                                needle):
    _, root, _ = exported
    bad = edited_draft(root / fmt, tmp_path / "bad", cfg_edit, w_edit)
    with pytest.raises(err, match=needle):
        import_draft(bad, target, fmt)


def test_vllm_import_accepts_midlayer_names(target, exported, tmp_path, edited_draft):
    d, root, _ = exported
    moved = edited_draft(root / "vllm", tmp_path / "mid", w_edit=lambda w: w.update(
        {k.replace("layers.0.", "midlayer."): w.pop(k) for k in [k for k in w if k.startswith("layers.0.")]}))
    back = import_draft(moved, target)
    batch = probe_batch(target, 4, seed=1)
    assert torch.equal(d.step_logits(batch)[0, 0, :-2], back.step_logits(batch)[0, 0, :-2])


@pytest.mark.parametrize("name, mutate, needle", [
    ("speculators_eagle3", lambda c: c.pop("norm_before_residual"), "missing required key 'norm_before_residual'"),
    ("speculators_eagle3", lambda c: c.update(norm_before_residual=True), "norm_before_residual: must be False"),
    ("speculators_eagle3", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 3, 4]), "at most 3 item"),
    ("speculators_eagle3", lambda c: c["transformer_layer_config"].update(num_hidden_layers=2),
     "num_hidden_layers: must be 1"),
    ("speculators_eagle3", lambda c: c["speculators_config"].update(algorithm="dspark"), "algorithm: must be 'eagle3'"),
    ("sglang_eagle3", lambda c: c.update(speculators_model_type="eagle3"), "must not be present"),
    ("sglang_eagle3", lambda c: c.pop("eagle_config"), "missing required key 'eagle_config'"),
    ("sglang_eagle3", lambda c: c.update(model_type="qwen3"), "model_type: must be 'llama'"),
])
def test_eagle3_schemas_reject(exported, name, mutate, needle):
    _, root, _ = exported
    cfg = json.loads((root / ("vllm" if name.startswith("speculators") else "sglang") / "config.json").read_text())
    mutate(cfg)
    assert any(needle in p for p in validate(cfg, SCHEMAS[name])), validate(cfg, SCHEMAS[name])


def test_check_reads_eagle3_export_layer_ids(target, exported):
    _, root, _ = exported
    for fmt in ("vllm", "sglang"):
        rep = check_draft(root / fmt, target)
        assert rep.ok, rep.render()
        assert not any(f.name == "engine layer ids" for f in rep.findings)
    card = (root / "sglang" / "README.md").read_text()
    assert "--speculative-algorithm EAGLE3" in card and "eagle_config.eagle_aux_hidden_state_layer_ids" in card
    assert '"method": "eagle3"' in (root / "vllm" / "README.md").read_text()


# -- reduced draft vocabulary (draft.vocab_size = N) -------------------------------------------------------------
@pytest.fixture(scope="module")
def pruned(target, tmp_path_factory):
    """An engine-layout draft scoring 120 target tokens, its checkpoint and both engine exports."""
    root = tmp_path_factory.mktemp("e3v")
    torch.manual_seed(5)
    d = build_drafter(target, DraftConfig(algorithm="eagle3", num_layers=1, gamma=4, ttt_steps=3,
                                          eagle3_layout="engine", vocab_size=120))
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(2))[:120].sort().values
    d.set_draft_vocab(ids)
    d.eval().save_pretrained(root / "ckpt")
    res = {fmt: export_draft(root / "ckpt", root / fmt, fmt, target=target, target_path=TINY)
           for fmt in ("vllm", "sglang")}
    return d, ids, root, res


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_reduced_vocabulary_round_trip(target, pruned, fmt):
    """d2t [N] (target id = draft id + d2t; SGLang's hot_token_id = d2t + arange), t2d [V], lm_head = the target's
    rows [N, H], draft_vocab_size = N (the layer's vocab_size stays V); re-import and an independent engine forward
    from the written tensors reproduce the drafter."""
    d, ids, root, res = pruned
    out, V = root / fmt, target.vocab_size
    cfg = json.loads((out / "config.json").read_text())
    layer = cfg["transformer_layer_config"] if fmt == "vllm" else cfg
    assert cfg["draft_vocab_size"] == 120 and layer["vocab_size"] == V
    w = load_file(str(out / "model.safetensors"))
    assert w["d2t"].dtype == torch.int64 and torch.equal(torch.arange(120) + w["d2t"], ids)
    assert w["t2d"].shape == (V,) and int(w["t2d"].sum()) == 120 and bool(w["t2d"][ids].all())
    assert torch.equal(w["lm_head.weight"], target.lm_head.weight.detach()[ids])
    assert res[fmt].verified["reimport_max_abs_diff"] == 0.0 and res[fmt].verified["engine_max_abs_diff"] < 1e-5
    back = import_draft(out, target)
    assert back.cfg.vocab_size == 120 and torch.equal(back.draft_vocab, ids)
    batch = probe_batch(target, 4, seed=3)
    ours = d.step_logits(batch)[0]                                   # [S, T, N]
    assert ours.shape[-1] == 120
    T = ours.shape[1]
    inside = (torch.arange(T)[None, :] + torch.arange(3)[:, None]) <= T - 2
    assert torch.equal(ours[:3][inside], back.step_logits(batch)[0, :3][inside])
    table = target.embed_tokens.weight.detach().float()
    feats, tok = batch["features"][0].float(), batch["input_ids"][0]
    for r in (0, T // 2):
        steps = min(3, T - 1 - r)
        ref = engine_chain(out, fmt, feats, tok, r, steps, table)   # [steps, V], −inf outside the draft vocabulary
        assert torch.isinf(ref[:, ~w["t2d"]]).all()
        torch.testing.assert_close(ref[:, ids], ours[:steps, r], atol=1e-5, rtol=1e-5)
    from deepspec.decoding.warp import make_warp
    ids6, feats6 = batch["input_ids"][0], batch["features"][0]
    for temperature in (0.0, 1.0):
        g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
        p1 = d.propose(d.init_state(ids6[:6], feats6[:6]), int(ids6[6]), 4, make_warp(temperature), g1)
        p2 = back.propose(back.init_state(ids6[:6], feats6[:6]), int(ids6[6]), 4, make_warp(temperature), g2)
        assert torch.equal(p1.tokens, p2.tokens) and torch.equal(p1.probs, p2.probs)
        assert set(p1.tokens.tolist()) <= set(ids.tolist())


@pytest.mark.parametrize("fmt, w_edit, needle", [
    ("vllm", lambda w: w.update(t2d=torch.ones_like(w["t2d"])), "t2d marks"),
    ("sglang", lambda w: w["d2t"].__setitem__(0, -5), "outside the target vocabulary"),
    ("vllm", lambda w: w.update({"lm_head.weight": w["lm_head.weight"].roll(1, 0)}), "LM head rows"),
])
def test_import_refuses_bad_reduced_vocabulary(target, pruned, tmp_path, edited_draft, fmt, w_edit, needle):
    _, _, root, _ = pruned
    with pytest.raises(ImportUnsupported, match=needle):
        import_draft(edited_draft(root / fmt, tmp_path / "bad", None, w_edit), target, fmt)
