"""Training data: held-out split, world-size independent batch plan, collate, online features."""
import json

import pytest
import torch

from deepspec.train.data import (GlobalBatchPlan, MicroBatches, OnlineFeatures, OnlineSequences,
                                 build_micro_batch, check_batch_sizes, collate, heldout_micro_batches,
                                 split_heldout)


class ListSource:
    """Plain in-memory sequences (input_ids, loss_mask, features, last_hidden)."""

    def __init__(self, n=23, dim=3, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.samples = []
        for i in range(n):
            T = int(torch.randint(8, 30, (1,), generator=g))
            self.samples.append({"input_ids": torch.randint(0, 50, (T,), generator=g),
                                 "loss_mask": torch.rand(T, generator=g) > 0.2,
                                 "features": torch.randn(T, dim, generator=g).bfloat16(),
                                 "last_hidden": torch.randn(T, 2, generator=g).bfloat16()})

    def __len__(self):
        return len(self.samples)

    def lengths(self):
        return [s["input_ids"].numel() for s in self.samples]

    def __getitem__(self, i):
        return self.samples[i]


def test_split_heldout_deterministic_disjoint():
    """The trainer's held-out sequences are the data split's (a seeded hash of each sample id): stable under
    reordering, disjoint, and the ids that regeneration wrote to heldout.jsonl."""
    from deepspec.data.split import is_heldout
    ids = [f"s{i}" for i in range(400)]
    tr, ho = split_heldout(ids, 0.1, seed=3)
    assert 20 < len(ho) < 60 and not set(tr) & set(ho) and sorted(tr + ho) == list(range(400))
    assert {ids[i] for i in ho} == {s for s in ids if is_heldout(s, 0.1, 3)}
    assert (tr, ho) == split_heldout(ids, 0.1, seed=3)
    assert ho != split_heldout(ids, 0.1, seed=4)[1]
    rev = split_heldout(ids[::-1], 0.1, seed=3)[1]                # the same ids, whatever their order
    assert {ids[::-1][i] for i in rev} == {ids[i] for i in ho}
    assert split_heldout(ids[:10], 0.0, 0) == (list(range(10)), [])
    with pytest.raises(ValueError, match="data.heldout_fraction"):
        split_heldout(ids, 1.0, 0)


def test_batch_size_divisibility_error_is_clear():
    assert check_batch_sizes(16, 2, 4) == 2
    with pytest.raises(ValueError, match=r"not divisible.*2 × 3 = 6"):
        check_batch_sizes(16, 2, 3)


@pytest.mark.parametrize("lengths", [None, "source"])
def test_plan_is_world_size_independent(lengths):
    src = ListSource(n=22)
    idx = list(range(2, 22))          # a train split
    lens = src.lengths() if lengths else None
    G, M = 8, 2
    per_world = {}
    for W in (1, 2, 4):
        plan = GlobalBatchPlan(idx, G, M, W, seed=5, lengths=lens)
        assert plan.accum == G // (M * W)
        steps = []
        for step in range(6):                            # crosses epoch boundaries (20 per epoch)
            consumed = step * G
            mbs = [tuple(mb.items) for r in range(W) for mb in plan.micro_batches(consumed, r)]
            assert all(len(mb) == M for mb in mbs)
            assert sorted(x for mb in mbs for x in mb) == sorted(plan.global_batch_at(consumed))
            steps.append(sorted(mbs))
        per_world[W] = steps
    assert per_world[1] == per_world[2] == per_world[4]   # same micro-batches, only their placement moves


def test_plan_epochs_cover_the_split_once():
    idx = list(range(30))
    plan = GlobalBatchPlan(idx, 10, 5, 1, seed=0)
    ep0 = [i for c in (0, 10, 20) for (e, i) in plan.global_batch_at(c)]
    assert sorted(ep0) == idx
    ep1 = [(e, i) for c in (30, 40, 50) for (e, i) in plan.global_batch_at(c)]
    assert {e for e, _ in ep1} == {1} and sorted(i for _, i in ep1) == idx
    assert ep0 != [i for _, i in ep1]                     # a fresh permutation each epoch
    straddle = plan.global_batch_at(25)                    # a batch may span two epochs
    assert [e for e, _ in straddle] == [0] * 5 + [1] * 5
    # group_by_length sorts a global batch longest first
    src = ListSource(n=30)
    plan = GlobalBatchPlan(idx, 10, 5, 1, seed=0, lengths=src.lengths())
    lens = [src.lengths()[i] for _, i in plan.global_batch_at(0)]
    assert lens == sorted(lens, reverse=True)


def test_collate_right_pads():
    src = ListSource(n=3)
    s = [src[0], src[1]]
    a = [torch.tensor([1, 4]), torch.tensor([2])]
    b = collate(s, a, pad_to_multiple_of=8)
    T = max(x["input_ids"].numel() for x in s)
    assert b["input_ids"].shape[1] == -(-T // 8) * 8
    assert b["anchors"].tolist() == [[1, 4], [2, -1]]
    for r, x in enumerate(s):
        n = x["input_ids"].numel()
        assert b["attention_mask"][r].sum() == n and not b["attention_mask"][r, n:].any()
        assert torch.equal(b["input_ids"][r, :n], x["input_ids"]) and not b["loss_mask"][r, n:].any()
        assert torch.equal(b["features"][r, :n], x["features"]) and b["features"].dtype == torch.bfloat16
        assert (b["features"][r, n:] == 0).all()


def test_micro_batches_resume_and_world_size_give_the_same_batches():
    src = ListSource(n=20)
    idx = list(range(20))
    G, M = 4, 2
    full = MicroBatches(src, GlobalBatchPlan(idx, G, M, 1, 0, src.lengths()), 0, 0, 0, 10, 4, seed=0)
    assert len(full) == 10 * 2
    # resumed at step 6 (24 sequences consumed) on 2 ranks: rank r holds micro-batch r of each step
    for r in range(2):
        part = MicroBatches(src, GlobalBatchPlan(idx, G, M, 2, 0, src.lengths()), r, 6, 24, 4, 4, seed=0)
        assert len(part) == 4
        for k in range(4):
            a, b = full[(6 + k) * 2 + r], part[k]
            assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    # anchors are valid positions of their rows
    b = full[0]
    for row in range(b["anchors"].shape[0]):
        for p in b["anchors"][row][b["anchors"][row] >= 0].tolist():
            n = int(b["attention_mask"][row].sum())
            assert p + 1 < n and b["loss_mask"][row, p:p + 2].all()


def test_heldout_micro_batches_balanced():
    parts = [heldout_micro_batches(list(range(7)), 2, r, 3) for r in range(3)]
    assert [len(p) for p in parts] == [2, 2, 2]                  # same forward count on every rank
    real = [i for p in parts for items, w in p if w > 0 for _, i in items]
    assert sorted(real) == list(range(7))
    assert heldout_micro_batches(list(range(7)), 2, 0, 1, max_sequences=3)[-1][0] == [(-1, 2)]


def test_online_sequences_and_features_match_per_sample_capture(tmp_path, tiny_llama):
    t = tiny_llama
    path = tmp_path / "regen.jsonl"
    recs = [{"id": str(i), "conversations": [{"role": "user", "content": "What is 12 times 7?" * (i + 1)},
                                             {"role": "assistant", "content": "It is 84. " * (2 * i + 1)}],
             "meta": {}} for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    src = OnlineSequences.from_jsonl(path, t, max_length=60)
    assert len(src) == 3 and max(src.lengths()) <= 60
    enc = t.encode_chat(recs[0]["conversations"])
    assert src[0]["input_ids"].tolist() == enc.input_ids[:60]
    batch = build_micro_batch(src, [(0, 0), (0, 1), (0, 2)], anchors_per_sequence=4, seed=0)
    batch = OnlineFeatures(t, torch.float32)(batch)
    assert batch["features"].requires_grad is False and not batch["features"].is_inference()
    for r in range(3):
        ids = src[r]["input_ids"]
        cap = t.capture(ids[None])
        n = ids.numel()
        torch.testing.assert_close(batch["features"][r, :n], cap.features[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(batch["last_hidden"][r, :n], cap.last_hidden[0], atol=1e-5, rtol=1e-5)
        assert (batch["features"][r, n:] == 0).all()
    bf = OnlineFeatures(t)(build_micro_batch(src, [(0, 0)], 4, 0))
    assert bf["features"].dtype == torch.bfloat16       # what the cache stores


def test_loader_workers_auto_and_explicit():
    from deepspec.train.data import loader_workers
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert loader_workers(None, cpu) == 0 and loader_workers(None, gpu, online=True) == 0
    assert 1 <= loader_workers(None, gpu) <= 4 and loader_workers(None, gpu, world_size=10 ** 6) == 1
    assert loader_workers(3, cpu) == 3 and loader_workers(0, gpu) == 0
