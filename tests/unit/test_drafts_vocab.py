"""Draft vocabulary (draft.vocab_size): selection from data, the drafters on a subset, lossless decoding."""
import numpy as np
import pytest
import torch

from deepspec.config.draft import DraftConfig
from deepspec.data.vocab import (VocabError, count_answer_tokens, coverage, coverage_table, load_vocab, save_vocab,
                                 select_top)
from deepspec.drafts import build_drafter
from deepspec.drafts.checkpoint import read_checkpoint_config  # noqa: F401  (checkpoint module exists)
from deepspec.decoding.warp import make_warp
from deepspec.decoding.chain import speculative_generate
from deepspec.decoding.loop import target_generate

G = 3
ALGOS = {"dspark": dict(algorithm="dspark", head_rank=8), "dspark_rnn": dict(algorithm="dspark", head_rank=8,
                                                                              sequential_head="rnn"),
         "dflash": dict(algorithm="dflash"), "eagle3": dict(algorithm="eagle3", ttt_steps=G)}


def test_selection_counts_answer_tokens_only_and_keeps_required_tokens():
    samples = [{"input_ids": [5, 5, 7, 1, 1, 1], "loss_mask": [0, 0, 1, 1, 1, 1]},
               {"input_ids": [9, 7, 2], "loss_mask": [0, 1, 1]}]
    counts = count_answer_tokens(samples, 10)
    assert counts.tolist() == [0, 3, 1, 0, 0, 0, 0, 2, 0, 0]           # prompt tokens (5, 9) not counted
    assert select_top(counts, 2).tolist() == [1, 7]
    assert select_top(counts, 2, always=[9]).tolist() == [1, 9]         # EOS-like tokens always reachable
    assert select_top(counts, 4).tolist() == [0, 1, 2, 7]               # ties broken by lower id
    assert coverage(counts, np.array([1, 7])) == pytest.approx(5 / 6)
    assert coverage_table(counts, [1, 3, 99]) == {1: pytest.approx(0.5), 3: 1.0}
    with pytest.raises(VocabError, match="between 1 and the target vocabulary size 10"):
        select_top(counts, 11)
    with pytest.raises(VocabError, match="outside the target vocabulary"):
        count_answer_tokens([{"input_ids": [12], "loss_mask": [1]}], 10)


def test_vocab_file_round_trip_and_mismatches(tmp_path):
    ids = np.array([1, 4, 9])
    p = save_vocab(tmp_path / "v.json", ids, vocab_size=10, tokenizer_fingerprint="abc", coverage_value=0.9,
                   source="test")
    assert load_vocab(p, vocab_size=10, tokenizer_fingerprint="abc").tolist() == [1, 4, 9]
    with pytest.raises(VocabError, match="vocabulary of 10 tokens, the target has 12"):
        load_vocab(p, vocab_size=12)
    with pytest.raises(VocabError, match="another tokenizer"):
        load_vocab(p, vocab_size=10, tokenizer_fingerprint="xyz")


def _batch(t, B=2, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, t.vocab_size, (B, T), generator=g)
    cap = t.capture(ids)
    anchors = torch.stack([torch.randperm(T - G - 1, generator=g)[:5].sort().values for _ in range(B)])
    return {"input_ids": ids, "loss_mask": torch.ones(B, T, dtype=torch.bool),
            "attention_mask": torch.ones(B, T, dtype=torch.bool), "features": cap.features,
            "last_hidden": cap.last_hidden, "anchors": anchors}


@pytest.mark.parametrize("name", list(ALGOS))
def test_a_full_size_draft_vocabulary_equals_the_full_vocabulary(tiny_llama, name):
    t = tiny_llama
    torch.manual_seed(0)
    full = build_drafter(t, DraftConfig(gamma=G, num_layers=1, **ALGOS[name]))
    torch.manual_seed(0)
    sub = build_drafter(t, DraftConfig(gamma=G, num_layers=1, vocab_size=t.vocab_size, **ALGOS[name]))
    sub.set_draft_vocab(torch.arange(t.vocab_size))
    batch = _batch(t)
    a, b = full(batch), sub(batch)
    torch.testing.assert_close(a["loss"], b["loss"])
    a["loss"].backward()
    b["loss"].backward()
    for (n1, p1), (n2, p2) in zip(full.named_parameters(), sub.named_parameters()):
        torch.testing.assert_close(p1.grad, p2.grad, msg=n1)
    assert b["metrics"]["vocab_coverage"] == 1.0


@pytest.mark.parametrize("name", list(ALGOS))
def test_a_stored_log_normaliser_gives_the_same_loss_and_gradients(tiny_llama, name):
    """A batch with ``target_lse`` (the cache column) lets a pruned drafter's loss score only the draft
    vocabulary's target logits; loss, metrics and gradients equal the full-V computation."""
    t = tiny_llama
    n = t.vocab_size // 3
    ids = torch.randperm(t.vocab_size, generator=torch.Generator().manual_seed(1))[:n].sort().values
    torch.manual_seed(0)
    d = build_drafter(t, DraftConfig(gamma=G, num_layers=1, vocab_size=n, **ALGOS[name]))
    d.set_draft_vocab(ids)
    batch = _batch(t)
    a = d(batch)
    ga = torch.autograd.grad(a["loss"], d.trainable_parameters(), allow_unused=True)
    batch["target_lse"] = t.log_normalizer(batch["last_hidden"])
    b = d(batch)
    gb = torch.autograd.grad(b["loss"], d.trainable_parameters(), allow_unused=True)
    torch.testing.assert_close(b["loss"], a["loss"], rtol=1e-5, atol=1e-6)
    for k in ("expected_tau", "tv", "ce", "vocab_coverage"):
        assert b["metrics"][k] == pytest.approx(a["metrics"][k], rel=1e-5, abs=1e-7), k
    for x, y in zip(ga, gb):
        if x is not None:
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("name", list(ALGOS))
def test_pruned_drafter_trains_and_decodes_losslessly(tiny_llama, name, tmp_path):
    t = tiny_llama
    torch.manual_seed(0)
    n = t.vocab_size // 3
    d = build_drafter(t, DraftConfig(gamma=G, num_layers=1, vocab_size=n, **ALGOS[name]))
    ids = torch.randperm(t.vocab_size, generator=torch.Generator().manual_seed(1))[:n].sort().values
    d.set_draft_vocab(ids)
    out = d(_batch(t))
    out["loss"].backward()
    assert 0 < out["metrics"]["vocab_coverage"] < 1 and np.isfinite(out["metrics"]["ce"])
    if getattr(d, "head", None) is not None:
        assert d.head.w2.shape[-1] == n and d.head.w1.num_embeddings == t.vocab_size
    d.eval()
    prompt = torch.randint(10, t.vocab_size, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    greedy = make_warp(0.0)
    base = target_generate(t, prompt, max_new_tokens=12, warp=greedy, eos_token_ids=[]).tokens
    spec = speculative_generate(t, d, prompt, gamma=G, max_new_tokens=12, warp=greedy, eos_token_ids=[])
    assert spec.tokens == base
    # proposals: draft-vocabulary tokens only, q over the target vocabulary with 0 outside the subset
    pids = torch.tensor(prompt)
    state = d.init_state(pids, t.capture(pids[None]).features[0])
    prop = d.propose(state, base[0], G, make_warp(1.0), torch.Generator().manual_seed(2))
    assert prop.probs.shape == (G, t.vocab_size)
    assert set(prop.tokens.tolist()) <= set(ids.tolist())
    outside = torch.ones(t.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert (prop.probs[:, outside] == 0).all()
    torch.testing.assert_close(prop.probs.sum(-1), torch.ones(G))
    # the vocabulary travels with the checkpoint
    d.save_pretrained(tmp_path)
    from deepspec.drafts import load_drafter
    back = load_drafter(tmp_path, t)
    assert torch.equal(back.draft_vocab, ids)


def test_bad_vocab_sizes_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="draft.vocab_size=.*between 1 and the target vocabulary size"):
        build_drafter(tiny_llama, DraftConfig(algorithm="dflash", gamma=G, num_layers=1,
                                              vocab_size=tiny_llama.vocab_size + 1))
    d = build_drafter(tiny_llama, DraftConfig(algorithm="dflash", gamma=G, num_layers=1, vocab_size=4))
    with pytest.raises(ValueError, match="strictly increasing"):
        d.set_draft_vocab([3, 2, 1, 0])
    with pytest.raises(ValueError, match="3 ids for draft.vocab_size=4"):
        d.set_draft_vocab([0, 1, 2])


def _saved(t, tmp_path, name="ck", vocab_size=None, ids=None, algorithm="dspark"):
    d = build_drafter(t, DraftConfig(algorithm=algorithm, gamma=G, num_layers=1, head_rank=8, vocab_size=vocab_size))
    if ids is not None:
        d.set_draft_vocab(ids)
    return d.save_pretrained(tmp_path / name)


def test_bad_saved_vocabularies_name_the_file(tiny_llama, tmp_path):
    """A checkpoint whose draft_vocab is out of range, unsorted or does not match its config: one clear error."""
    from safetensors.torch import load_file, save_file
    from deepspec.drafts import load_drafter
    from deepspec.drafts.checkpoint import DraftCheckpointError
    from deepspec.errors import DeepSpecError
    t = tiny_llama
    ck = _saved(t, tmp_path, vocab_size=5, ids=[1, 3, 5, 7, 9])
    ids = lambda *x: (lambda w: w.update(draft_vocab=torch.tensor(x)))   # noqa: E731
    cases = [(ids(1, 3, 5, 9, 7), "strictly increasing"),
             (ids(1, 3, 5, 7, t.vocab_size), "outside the target vocabulary"),
             (ids(1, 3, 5, 7), r"shape \[4\], config says draft.vocab_size=5"),
             (lambda w: w.pop("draft_vocab"), "hold no draft_vocab")]
    weights = ck / "model.safetensors"
    good = load_file(str(weights))
    for edit, needle in cases:
        w = dict(good)
        edit(w)
        save_file(w, str(weights))
        with pytest.raises(DraftCheckpointError, match=needle) as e:
            load_drafter(ck, t)
        assert str(weights) in str(e.value) and isinstance(e.value, DeepSpecError)
    assert issubclass(VocabError, DeepSpecError) and issubclass(VocabError, ValueError)


def test_init_from_needs_the_same_vocabulary_size(tiny_llama, tmp_path, caplog):
    from deepspec.drafts.checkpoint import DraftCheckpointError
    t = tiny_llama
    full = _saved(t, tmp_path, "full")
    pruned = _saved(t, tmp_path, "pruned", vocab_size=6, ids=[0, 2, 3, 5, 8, 13])
    for src, n, needle in ((full, 6, r"draft.vocab_size=null\), this run 6 \(draft.vocab_size=6\); train with "
                                     r"draft.vocab_size=null"),
                           (pruned, None, r"scores 6 of the .* train with draft.vocab_size=6"),
                           (pruned, 7, "train with draft.vocab_size=6")):
        with pytest.raises(DraftCheckpointError, match=needle):
            build_drafter(t, DraftConfig(algorithm="dflash", gamma=G, num_layers=1, vocab_size=n, init_from=str(src)))
    # the same size: the vocabulary comes with the weights (the trainer keeps it)
    d = build_drafter(t, DraftConfig(algorithm="dspark", gamma=G, num_layers=1, head_rank=8, vocab_size=6,
                                     init_from=str(pruned)))
    assert d.draft_vocab.tolist() == [0, 2, 3, 5, 8, 13]
