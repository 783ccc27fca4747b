"""Eagle3: shapes, frozen target, exact training-time-test masking, decoding == training.

Every test runs for both layouts (``draft.eagle3_layout``): the native one and the
engines' EAGLE-3 layer (which needs exactly 3 feature layers, so the targets here capture 3).
"""
import pytest
import torch

from conftest import make_tiny_target
from deepspec.config.draft import DraftConfig, LossConfig
from deepspec.drafts import build_drafter

S = 3
pytestmark = [pytest.mark.parametrize("layout", ["native", "engine"]), pytest.mark.usefixtures("one_thread")]


@pytest.fixture(params=["llama", "qwen3", "gemma3"])
def tiny_target(request):
    return make_tiny_target(request.param, num_feature_layers=3)


@pytest.fixture
def tiny_llama():
    return make_tiny_target("llama", num_feature_layers=3)


@pytest.fixture
def tiny_qwen3():
    return make_tiny_target("qwen3", num_feature_layers=3)


def make_eagle(target, layout, seed=0, **kw):
    torch.manual_seed(seed)
    if layout == "engine":
        kw["num_layers"] = 1          # the engines' EAGLE-3 has one layer
    return build_drafter(target, DraftConfig(algorithm="eagle3", gamma=S, ttt_steps=S, eagle3_layout=layout, **kw))


def make_batch(target, ids):
    ids = ids.reshape(1, -1) if ids.dim() == 1 else ids
    B, T = ids.shape
    cap = target.capture(ids)
    return {"input_ids": ids, "loss_mask": torch.ones(B, T, dtype=torch.bool),
            "attention_mask": torch.ones(B, T, dtype=torch.bool), "features": cap.features.clone(),
            "last_hidden": cap.last_hidden.clone(), "anchors": torch.full((B, 1), -1)}


def random_ids(target, n, seed=0):
    return torch.randint(0, target.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def test_forward_shapes_and_frozen_target(tiny_target, layout):
    t = tiny_target
    d = make_eagle(t, layout, num_layers=1)
    ids = torch.stack([random_ids(t, 14, 1), random_ids(t, 14, 2)])
    batch = make_batch(t, ids)
    batch["loss_mask"][:, :4] = False                 # prompt: no loss
    batch["attention_mask"][1, 11:] = False            # padding
    batch["loss_mask"][1, 11:] = False
    out = d(batch)
    m = out["metrics"]
    # step j at root r predicts x_{r+2+j}: counted where that token is loss-masked
    lm = batch["loss_mask"]
    want = sum(int(lm[:, 2 + j:].sum()) for j in range(S))
    assert m["positions"] == want
    assert all(f"accept_rate/{k}" in m and f"top1/{k}" in m for k in range(1, S + 1))
    assert torch.isfinite(out["loss"])
    out["loss"].backward()
    target_ptrs = {p.data_ptr() for p in t.model.parameters()}
    assert not any(p.data_ptr() in target_ptrs for p in d.parameters())
    assert set(d.state_dict()) == {n for n, _ in d.named_parameters()}
    assert all(p.grad is None for p in t.model.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in d.parameters())
    logits = d.step_logits(batch)
    assert logits.shape == (2, S, 14, t.vocab_size) and logits.dtype == torch.float32


def test_training_time_test_dependencies(tiny_qwen3, layout):
    """Step j at root r sees features <= r and tokens x_1..x_{r+1+j}, nothing later."""
    t = tiny_qwen3
    d = make_eagle(t, layout, num_layers=2)
    r = 6
    batch = make_batch(t, random_ids(t, 16))
    base = d.step_logits(batch)[0, :, r]

    def changed(b):
        return ((d.step_logits(b)[0, :, r] - base).abs().amax(-1) > 1e-5).tolist()

    b = {k: v.clone() for k, v in batch.items()}
    b["features"][:, r + 1:] += torch.randn_like(b["features"][:, r + 1:])
    assert changed(b) == [False] * S                   # later steps use the draft's own hidden, not f_{>r}
    b = {k: v.clone() for k, v in batch.items()}
    b["features"][:, r] += 1.0
    assert changed(b) == [True] * S
    b = {k: v.clone() for k, v in batch.items()}
    b["features"][:, 0] += 1.0                          # earlier context: attended by every step
    assert changed(b) == [True] * S
    for m in range(S + 1):                              # token x_{r+1+m} enters at step m
        b = {k: v.clone() for k, v in batch.items()}
        b["input_ids"][0, r + 1 + m] = (b["input_ids"][0, r + 1 + m] + 5) % t.vocab_size
        assert changed(b) == [j >= m for j in range(S)], m


def test_loss_and_metrics_by_hand(tiny_llama, layout):
    """Soft CE to softmax(last_hidden[r+1+j]) for x_{r+2+j}, step weights step_decay**j, loss-masked only."""
    t = tiny_llama
    d = make_eagle(t, layout, num_layers=1, loss=LossConfig(step_decay=0.5))
    T = 10
    batch = make_batch(t, random_ids(t, T, 9))
    batch["loss_mask"][0, :3] = False
    batch["loss_mask"][0, 6] = False
    out = d(batch)
    logits = d.step_logits(batch)[0]
    ids, last, lm = batch["input_ids"][0], batch["last_hidden"][0], batch["loss_mask"][0]
    num = den = 0.0
    tv = {j: [] for j in range(S)}
    ce = []
    for j in range(S):
        for r in range(T - 2 - j):
            if not lm[r + 2 + j]:
                continue
            logq = torch.log_softmax(logits[j, r], -1)
            pt = torch.softmax(t.logits_from_hidden(last[r + 1 + j]), -1)
            num += 0.5 ** j * float(-(pt * logq).sum())
            den += 0.5 ** j
            tv[j].append(float(0.5 * (logq.exp() - pt).abs().sum()))
            ce.append(float(-logq[ids[r + 2 + j]]))
    m = out["metrics"]
    assert float(out["loss"].detach()) == pytest.approx(num / den, rel=1e-5)
    assert m["ce"] == pytest.approx(sum(ce) / len(ce), rel=1e-5)
    for j in range(S):
        assert m[f"accept_rate/{j + 1}"] == pytest.approx(1 - sum(tv[j]) / len(tv[j]), abs=1e-6)


def test_chunked_equals_unchunked(tiny_llama, layout):
    t = tiny_llama
    ids = torch.stack([random_ids(t, 12, 3), random_ids(t, 12, 4)])
    res = []
    for chunk in (0, 1):                                # 1 anchor-chunk = gamma rows per chunk
        d = make_eagle(t, layout, num_layers=1, loss=LossConfig(chunk_size=chunk))
        out = d(make_batch(t, ids))
        out["loss"].backward()
        res.append((out, {n: p.grad.clone() for n, p in d.named_parameters()}))
    (o1, g1), (o2, g2) = res
    torch.testing.assert_close(o1["loss"], o2["loss"], rtol=1e-5, atol=1e-6)
    for k, v in o1["metrics"].items():
        assert v == pytest.approx(o2["metrics"][k], rel=1e-5, abs=1e-6), k
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-4, atol=1e-6)


def softmax_warp(logits):
    return torch.softmax(logits.float(), -1)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_decoding_matches_training_forward(family, layout):
    t = make_tiny_target(family, num_feature_layers=3)
    d = make_eagle(t, layout, num_layers=2)
    T = 9
    ids = random_ids(t, T + 1, 7)
    feats = t.capture(ids[None, :T]).features[0]
    prop = d.propose(d.init_state(ids[:T], feats), int(ids[T]), S, softmax_warp, torch.Generator().manual_seed(0))
    assert prop.tokens.shape == (S,) and prop.probs.shape == (S, t.vocab_size) and prop.confidence is None
    # training chain rooted at r = T-1 over [prompt, anchor, drafts] = the decoding chain
    full = torch.cat([ids, prop.tokens])
    logits = d.step_logits(make_batch(t, full))[0, :, T - 1]
    torch.testing.assert_close(prop.probs.log(), torch.log_softmax(logits, -1), atol=1e-4, rtol=0)
    # init + advance (anchor + accepted, with their features) == one-shot init
    st = d.advance(d.init_state(ids[:3], feats[:3]), ids[3:T], feats[3:T])
    assert st.length == T
    prop2 = d.propose(st, int(ids[T]), S, softmax_warp, torch.Generator().manual_seed(0))
    torch.testing.assert_close(prop2.probs.log(), prop.probs.log(), atol=1e-4, rtol=0)
    assert torch.equal(prop2.tokens, prop.tokens)
    longer = d.propose(st, int(ids[T]), S + 2, softmax_warp)    # autoregressive: any horizon
    assert longer.tokens.shape == (S + 2,)


def test_bf16_autocast(tiny_llama, layout):
    t = tiny_llama
    d = make_eagle(t, layout, num_layers=1)
    batch = make_batch(t, random_ids(t, 12, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = d(batch)
        prop = d.propose(d.init_state(batch["input_ids"][0, :6], batch["features"][0, :6]), 5, S, softmax_warp)
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and all(torch.isfinite(p.grad).all() for p in d.parameters())
    assert prop.probs.dtype == torch.float32 and torch.isfinite(prop.probs).all()


def test_sparse_roots_over_every_anchor_equal_dense(tiny_target, layout):
    """ttt_dense=false with anchors at every position gives the dense loss, metrics and grads."""
    t = tiny_target
    ids = torch.stack([random_ids(t, 12, 3), random_ids(t, 12, 4)])
    batch = make_batch(t, ids)
    batch["loss_mask"][:, :3] = False
    batch["attention_mask"][1, 10:] = False
    batch["loss_mask"][1, 10:] = False
    outs, grads = [], []
    for dense in (True, False):
        d = make_eagle(t, layout, seed=5, num_layers=1, ttt_dense=dense)
        b = dict(batch, anchors=torch.arange(1, 12).expand(2, 11).clone())
        out = d(b)
        out["loss"].backward()
        outs.append(out)
        grads.append(torch.cat([p.grad.reshape(-1) for p in d.parameters()]))
    assert torch.allclose(outs[0]["loss"], outs[1]["loss"], atol=1e-6)
    assert outs[0]["metrics"]["positions"] == outs[1]["metrics"]["positions"]
    assert abs(outs[0]["metrics"]["expected_tau"] - outs[1]["metrics"]["expected_tau"]) < 1e-6
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_sparse_roots_count_only_anchor_chains(tiny_target, layout):
    """With anchors {4, 7} (padding -1) only chains rooted at 3 and 6 carry the loss."""
    t = tiny_target
    batch = make_batch(t, random_ids(t, 14, 6))
    batch["anchors"] = torch.tensor([[4, 7, -1]])
    d = make_eagle(t, layout, num_layers=1, ttt_dense=False)
    m = d(batch)["metrics"]
    # root r, step j predicts x_{r+2+j}; every token is loss-masked and inside for these roots
    assert m["positions"] == 2 * S
    batch["anchors"] = torch.full((1, 3), -1)
    out = d(batch)
    assert out["metrics"]["positions"] == 0 and float(out["loss"].detach()) == 0.0


def test_layout_structure_and_config_errors(layout):
    """engine: one 2·hidden-input layer without q/k norm or in_proj; misfits are refused naming the key."""
    two = make_tiny_target("llama")                               # 2 feature layers
    with pytest.raises(ValueError, match="draft.eagle3_layout='bogus'"):
        build_drafter(two, DraftConfig(algorithm="eagle3", eagle3_layout="bogus"))
    if layout == "native":
        d = make_eagle(two, layout, num_layers=2)
        assert d.in_proj is not None and d.layers[0].attn.q_norm is not None
        return
    # any number of feature layers trains (DeepSpec's Eagle3 reads 5); only the export needs 3
    assert make_eagle(two, layout).fc.in_features == 2 * two.hidden_size
    t = make_tiny_target("llama", num_feature_layers=3)
    cfg = dict(algorithm="eagle3", eagle3_layout=layout)
    with pytest.raises(ValueError, match="draft.num_layers=2"):
        build_drafter(t, DraftConfig(**cfg, num_layers=2))
    with pytest.raises(ValueError, match="draft.hidden_size=32"):
        build_drafter(t, DraftConfig(**cfg, num_layers=1, hidden_size=32))
    d = make_eagle(t, layout)
    attn = d.layers[0].attn
    assert d.in_proj is None and d.out_proj is None and d.layers[0].input_norm is None
    assert attn.q_norm is None and attn.k_norm is None
    assert attn.q_proj.in_features == attn.k_proj.in_features == 2 * t.hidden_size
    assert d.fc.in_features == 3 * t.hidden_size


def test_sparse_chains_equal_dense_chains_at_their_roots(tiny_target, layout):
    """Steps >= 1 computed only for a few roots equal the dense TTT's outputs at those roots."""
    t = tiny_target
    batch = make_batch(t, torch.stack([random_ids(t, 13, 8), random_ids(t, 13, 9)]))
    batch["attention_mask"][1, 11:] = False
    d = make_eagle(t, layout, seed=2, num_layers=1 if layout == "engine" else 2)
    roots = torch.tensor([[0, 5, 9], [2, 3, 10]])
    with torch.no_grad():
        dense = [h for _, h in d._ttt(batch)]
        sparse = [h for _, h in d._ttt(batch, roots)]
    assert len(dense) == len(sparse) == S
    for hd, hs in zip(dense, sparse):
        want = hd.gather(1, roots.unsqueeze(-1).expand(-1, -1, hd.shape[-1]))
        assert torch.allclose(hs, want, atol=1e-5), (hs - want).abs().max()


@pytest.mark.parametrize("key", ["anchor_feature", "embed_proj"])
def test_parallel_drafter_ablations_are_refused_by_name(tiny_llama, layout, key):
    with pytest.raises(ValueError, match=rf"draft.{key}=true is an ablation of the parallel drafters"):
        build_drafter(tiny_llama, DraftConfig(algorithm="eagle3", gamma=3, num_layers=1, eagle3_layout=layout,
                                              **{key: True}))
