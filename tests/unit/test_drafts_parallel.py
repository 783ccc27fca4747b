"""DFlash / DSpark parallel drafter: shapes, frozen target, block masks, heads, chunking, decoding."""
import pytest
import torch

from deepspec.config.draft import DraftConfig, LossConfig
from deepspec.drafts import build_drafter

G = 4
ALGOS = {
    "dflash": dict(algorithm="dflash"),
    "dspark_markov": dict(algorithm="dspark", sequential_head="markov"),
    "dspark_rnn": dict(algorithm="dspark", sequential_head="rnn"),
    # the anchor-feature ablation (draft.anchor_feature): same contracts as the published drafters
    "dflash_anchor_feature": dict(algorithm="dflash", anchor_feature=True),
    # the factored head embedding (draft.head_embedding=target): W1[x] = P·E_target[x]
    "dspark_markov_target_embed": dict(algorithm="dspark", sequential_head="markov", head_embedding="target"),
    # the embedding-projection ablation (draft.embed_proj): a learned map on the block's token embeddings
    "dflash_embed_proj": dict(algorithm="dflash", embed_proj=True),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def make_drafter(target, name, seed=0, randomize_heads=True, **kw):
    torch.manual_seed(seed)
    d = build_drafter(target, DraftConfig(gamma=G, num_layers=2, head_rank=16, **{**ALGOS[name], **kw}))
    if randomize_heads and d.head is not None:   # larger than the N(0, 0.02) init: heads that matter
        torch.nn.init.normal_(d.head.w2, std=0.3)
    return d


def make_batch(target, ids, anchors, seed=0):
    ids = ids.reshape(1, -1) if ids.dim() == 1 else ids
    B, T = ids.shape
    cap = target.capture(ids)
    return {"input_ids": ids, "loss_mask": torch.ones(B, T, dtype=torch.bool),
            "attention_mask": torch.ones(B, T, dtype=torch.bool), "features": cap.features.clone(),
            "last_hidden": cap.last_hidden.clone(), "anchors": torch.as_tensor(anchors).reshape(B, -1)}


def random_ids(target, n, seed=0):
    return torch.randint(0, target.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(ALGOS))
def test_forward_shapes_metrics_and_frozen_target(tiny_target, name):
    t = tiny_target
    d = make_drafter(t, name)
    ids = torch.stack([random_ids(t, 20, 1), random_ids(t, 20, 2)])
    batch = make_batch(t, ids, [[0, 5, 11, 15], [3, 9, -1, -1]])
    batch["attention_mask"][1, 17:] = False          # right padding: anchor 15 of row 1 would be invalid
    batch["loss_mask"][1, 17:] = False
    out = d(batch)
    m = out["metrics"]
    assert out["loss"].dim() == 0 and torch.isfinite(out["loss"])
    assert m["blocks"] == 6.0 and m["positions"] == 6 * G
    for key in ["ce", "tv", "conf_bce", "expected_tau"] + [f"{p}/{k}" for p in ("accept_rate", "top1")
                                                           for k in range(1, G + 1)]:
        assert key in m and isinstance(m[key], float)
    assert (m["conf_bce"] > 0) == (not name.startswith("dflash"))
    out["loss"].backward()
    # the target's embedding / LM head are neither parameters nor saved nor trained
    target_ptrs = {p.data_ptr() for p in t.model.parameters()}
    assert not any(p.data_ptr() in target_ptrs for p in d.parameters())
    assert not any(v.data_ptr() in target_ptrs for v in d.state_dict().values())
    assert set(d.state_dict()) == {n for n, _ in d.named_parameters()}
    assert all(p.grad is None for p in t.model.parameters())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in d.parameters())
    assert d.context.fc.weight.grad.abs().sum() > 0 and d.layers[0].attn.q_proj.weight.grad.abs().sum() > 0
    assert (d.anchor_proj is not None) == ("anchor_feature" in name)
    if d.anchor_proj is not None:
        assert d.anchor_proj.fc.weight.grad.abs().sum() > 0
    if d.head is not None:   # the factored W1 owns no V×r table, only its map, and that map is trained
        assert (d.head.w1 is None) == ("target_embed" in name)
        if d.head.w1_proj is not None:
            assert d.head.w1_proj.weight.grad.abs().sum() > 0
            assert not any(k.startswith("head.w1.") for k in d.state_dict())
    assert (d.in_proj is not None) == ("embed_proj" in name)   # the tiny targets: draft width = target width
    # the published layout's context keys (shipped and exported drafts load unchanged)
    assert {k for k in d.state_dict() if k.startswith("context.")} == {"context.fc.weight", "context.norm.weight"}
    # per block: γ logits over the target vocabulary
    bl = d.block_logits(batch)
    assert bl["logits"].shape == (2, 4, G, t.vocab_size) and bl["logits"].dtype == torch.float32
    assert bl["valid"].tolist() == [[True] * 4, [True, True, False, False]]


@pytest.mark.parametrize("name", ["dflash", "dspark_rnn"])
def test_block_mask(tiny_qwen3, name):
    t = tiny_qwen3
    d = make_drafter(t, name)
    p1, p2 = 6, 13
    batch = make_batch(t, random_ids(t, 24), [[p1, p2]])
    base = d.block_logits(batch)["logits"][0]

    def changed(b):
        return (d.block_logits(b)["logits"][0] - base).abs().amax(dim=(-1, -2)) > 1e-4   # per block

    # context at/after the anchor (features of positions >= p1) is invisible to block 1, not block 2
    b = {k: v.clone() for k, v in batch.items()}
    b["features"][:, p1:] += torch.randn_like(b["features"][:, p1:])
    assert changed(b).tolist() == [False, True]
    # context before the anchor is visible
    b = {k: v.clone() for k, v in batch.items()}
    b["features"][:, p1 - 1] += 1.0
    assert changed(b).tolist() == [True, True]
    # another block's anchor token does not leak into block 1; its own anchor changes every slot
    b = {k: v.clone() for k, v in batch.items()}
    b["input_ids"][0, p2] = (b["input_ids"][0, p2] + 1) % t.vocab_size
    assert changed(b).tolist() == [False, True]
    b = {k: v.clone() for k, v in batch.items()}
    b["input_ids"][0, p1] = (b["input_ids"][0, p1] + 1) % t.vocab_size
    assert changed(b).tolist() == [True, False]      # ... and does not leak into the later block
    per_slot = (d.block_logits(b)["logits"][0, 0] - base[0]).abs().amax(-1)
    assert (per_slot > 1e-4).all()
    # bidirectional inside the block: slot 0 attends to the mask slots after it
    d.mask_token_id = (d.mask_token_id + 1) % t.vocab_size
    assert (d.block_logits(batch)["logits"][0, :, 0] - base[:, 0]).abs().amax() > 1e-4


@pytest.mark.parametrize("name", ["dspark_markov", "dspark_rnn"])
def test_head_sees_only_the_prefix(tiny_llama, name):
    t = tiny_llama
    d = make_drafter(t, name)
    p = 5
    batch = make_batch(t, random_ids(t, 16), [[p]])
    base = d.block_logits(batch)
    for m in range(1, G):                      # perturb x_{p+m}: the input of slot m (predicting x_{p+m+1})
        b = {k: v.clone() for k, v in batch.items()}
        b["input_ids"][0, p + m] = (b["input_ids"][0, p + m] + 7) % t.vocab_size
        out = d.block_logits(b)
        diff = (out["logits"][0, 0] - base["logits"][0, 0]).abs().amax(-1) > 1e-5
        cdiff = (out["confidence"][0, 0] - base["confidence"][0, 0]).abs() > 1e-6
        assert not diff[:m].any() and not cdiff[:m].any()
        assert diff[m] and cdiff[m]
        if name == "dspark_markov":            # first-order: only the next slot
            assert not diff[m + 1:].any()
        else:                                  # the RNN state carries it forward
            assert diff[m:].all()


def test_loss_and_metrics_by_hand(tiny_llama):
    """forward's loss/metrics == an independent computation from the teacher-forced logits."""
    t = tiny_llama
    d = make_drafter(t, "dspark_markov", loss=LossConfig(chunk_size=2, position_decay=3.0))
    batch = make_batch(t, random_ids(t, 20, 8), [[0, 4, 9, 15, -1]])   # 15 + γ = 19 < 20: whole block
    batch["loss_mask"][0, 12] = False                                   # cuts anchor 9's block after x_11
    out = d(batch)
    bl = d.block_logits(batch)
    ids, last = batch["input_ids"][0], batch["last_hidden"][0]
    rows = []                                                           # (block, k, ce, tv, bce)
    for n, (p, col, kmax) in enumerate([(0, 0, G), (4, 1, G), (9, 2, 2), (15, 3, G)]):
        for k in range(1, kmax + 1):
            logits = bl["logits"][0, col, k - 1]
            q = torch.softmax(logits, -1)
            pt = torch.softmax(t.logits_from_hidden(last[p + k - 1]), -1)
            tv = 0.5 * (q - pt).abs().sum()
            c = torch.sigmoid(bl["confidence"][0, col, k - 1])
            bce = -((1 - tv) * c.log() + tv * (1 - c).log())
            rows.append((n, k, float(-torch.log_softmax(logits, -1)[ids[p + k]]), float(tv), float(bce)))
    w = {k: torch.exp(torch.tensor(-(k - 1) / 3.0)).item() for k in range(1, G + 1)}
    # the distance term is L1 = 2·TV weighted 0.9 (DeepSpec), normalised by the weights of supervised positions
    loss = sum(w[k] * (0.1 * ce + 0.9 * 2 * tv + bce) for _, k, ce, tv, bce in rows) / sum(w[r[1]] for r in rows)
    m = out["metrics"]
    assert m["blocks"] == 4
    assert float(out["loss"].detach()) == pytest.approx(loss, rel=1e-4)
    assert m["ce"] == pytest.approx(sum(r[2] for r in rows) / len(rows), rel=1e-4)
    assert m["tv"] == pytest.approx(sum(r[3] for r in rows) / len(rows), rel=1e-4, abs=1e-6)
    for k in range(1, G + 1):
        at_k = [r[3] for r in rows if r[1] == k]
        assert m[f"accept_rate/{k}"] == pytest.approx(1 - sum(at_k) / len(at_k), abs=1e-5)
    # E[τ] = 1 + Σ_k mean over the blocks supervised at k of Π_{j<=k} (1 − TV_j)
    acc = {n: [1 - r[3] for r in rows if r[0] == n] for n in range(4)}
    tau = 1 + sum(sum(torch.tensor(a[:k]).prod().item() for a in acc.values() if len(a) >= k)
                  / sum(len(a) >= k for a in acc.values()) for k in range(1, G + 1))
    assert m["expected_tau"] == pytest.approx(tau, abs=1e-5)


@pytest.mark.parametrize("name", ["dflash", "dspark_rnn", "dflash_anchor_feature",
                                  "dspark_markov_target_embed"])
def test_chunked_equals_unchunked(tiny_llama, name):
    t = tiny_llama
    results = []
    ids = torch.stack([random_ids(t, 22, 3), random_ids(t, 22, 4)])
    for chunk in (0, 2):
        d = make_drafter(t, name, loss=LossConfig(chunk_size=chunk, ce_weight=0.3, l1_weight=0.7))
        batch = make_batch(t, ids, [[0, 4, 9, 13, 17], [2, 6, 10, -1, 14]])
        out = d(batch)
        out["loss"].backward()
        results.append((out, {n: p.grad.clone() for n, p in d.named_parameters()}))
    (o1, g1), (o2, g2) = results
    torch.testing.assert_close(o1["loss"], o2["loss"], rtol=1e-5, atol=1e-6)
    for k, v in o1["metrics"].items():
        assert v == pytest.approx(o2["metrics"][k], rel=1e-5, abs=1e-6), k
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-4, atol=1e-6)


def softmax_warp(logits):
    return torch.softmax(logits.float(), -1)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("name", list(ALGOS))
def test_decoding_matches_training_forward(family, name, request):
    from conftest import make_tiny_target
    t = make_tiny_target(family)
    d = make_drafter(t, name)
    T = 11
    ids = random_ids(t, T + 1, 5)                      # prompt x_0..x_{T-1}, anchor x_T
    feats = t.capture(ids[None, :T]).features[0]
    state = d.init_state(ids[:T], feats)
    prop = d.propose(state, int(ids[T]), G, softmax_warp, torch.Generator().manual_seed(0))
    assert prop.tokens.shape == (G,) and prop.tokens.dtype == torch.long
    assert prop.probs.shape == (G, t.vocab_size) and prop.probs.dtype == torch.float32
    # the training forward on [prompt, anchor, drafts] with the anchor at T gives the same q
    full = torch.cat([ids, prop.tokens])
    out = d.block_logits(make_batch(t, full, [[T]]))
    torch.testing.assert_close(prop.probs.log(), torch.log_softmax(out["logits"][0, 0], -1), atol=1e-4, rtol=0)
    if name.startswith("dflash"):
        assert prop.confidence is None
    else:
        torch.testing.assert_close(prop.confidence, torch.sigmoid(out["confidence"][0, 0]), atol=1e-5, rtol=0)
    # incremental context (init + advance) == one-shot init; a shorter gamma keeps the first rows
    st2 = d.advance(d.init_state(ids[:4], feats[:4]), ids[4:T], feats[4:T])
    assert st2.length == T
    prop2 = d.propose(st2, int(ids[T]), G - 1, softmax_warp, torch.Generator().manual_seed(0))
    torch.testing.assert_close(prop2.probs.log(), prop.probs[:G - 1].log(), atol=1e-4, rtol=0)
    assert torch.equal(prop2.tokens, prop.tokens[:G - 1])
    with pytest.raises(ValueError, match="gamma"):
        d.propose(st2, int(ids[T]), G + 1, softmax_warp)


def test_bf16_autocast_and_bf16_target():
    from conftest import make_tiny_target
    t = make_tiny_target("qwen3")
    d = make_drafter(t, "dspark_rnn")
    batch = make_batch(t, random_ids(t, 16), [[1, 6, 10]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = d(batch)
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and all(torch.isfinite(p.grad).all() for p in d.parameters())
    tb = make_tiny_target("qwen3", dtype=torch.bfloat16)    # bf16 target, fp32 draft, bf16 features
    d = make_drafter(tb, "dspark_markov")
    batch = make_batch(tb, random_ids(tb, 16), [[1, 6, 10]])
    assert batch["features"].dtype == torch.bfloat16
    out = d(batch)
    out["loss"].backward()
    assert torch.isfinite(out["loss"])
    state = d.init_state(batch["input_ids"][0, :8], batch["features"][0, :8])
    prop = d.propose(state, 3, G, softmax_warp)
    assert prop.probs.dtype == torch.float32 and torch.isfinite(prop.probs).all()
