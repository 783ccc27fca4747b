"""Pickle-free, atomic checkpoints: optimizer/RNG round trips, pruning, half-written dirs."""
import json
import random

import numpy as np
import pytest
import torch

from deepspec.config import DraftConfig, TrainConfig
from deepspec.drafts import build_drafter, load_drafter
from deepspec.train import checkpoint as ckpt
from deepspec.train.distributed import DistEnv
from deepspec.train.strategies import SingleStrategy


def _batch(target, B=2, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (B, T), generator=g)
    cap = target.capture(ids)
    return {"input_ids": ids, "loss_mask": torch.ones(B, T, dtype=torch.bool),
            "attention_mask": torch.ones(B, T, dtype=torch.bool), "features": cap.features.bfloat16(),
            "last_hidden": cap.last_hidden.bfloat16(), "anchors": torch.tensor([[1, 6, 12], [3, 9, 15]])}


def _strategy(target, seed=0):
    torch.manual_seed(seed)
    d = build_drafter(target, DraftConfig(algorithm="dspark", gamma=3, num_layers=1, head_rank=8))
    s = SingleStrategy(DistEnv(), TrainConfig(lr=1e-2, compile=False, grad_clip=1.0))
    s.setup(d)
    return s


def _train(s, batches, lr=1e-2):
    out = []
    for b in batches:
        loss = s.forward(b)["loss"]
        s.backward(loss, 1, True)
        s.step(lr)
        out.append(float(loss.detach()))
    return out


def test_save_resume_reproduces_the_trajectory_exactly(tmp_path, tiny_llama):
    t = tiny_llama
    batches = [_batch(t, seed=i) for i in range(4)]
    ref = _train(_strategy(t), batches)

    s = _strategy(t)
    first = _train(s, batches[:2])
    weights, optim = s.full_state()
    path = ckpt.save_checkpoint(tmp_path, 2, save_draft=s.drafter.save_pretrained, weights=weights,
                                optimizer=optim, meta={"sequences_consumed": 4},
                                rng=[ckpt.capture_rng()], config_yaml="seed: 0\n")
    assert path == tmp_path / "step_2" and (tmp_path / "latest").read_text().strip() == "step_2"
    ts = path / "training_state"
    assert sorted(p.name for p in ts.iterdir()) == ["master_weights.safetensors", "meta.json",
                                                    "optimizer.safetensors", "rng.json", "rng.safetensors"]
    assert json.loads((ts / "meta.json").read_text())["step"] == 2
    # the draft part is a normal from_pretrained dir
    assert load_drafter(path, t).state_dict().keys() == s.drafter.state_dict().keys()

    state = ckpt.load_training_state(path)
    s2 = _strategy(t, seed=123)              # different init: everything must come from the checkpoint
    with torch.no_grad():
        for n, p in s2.drafter.named_parameters():
            p.copy_(state.weights[n])
    s2.load_optimizer_state(state.optimizer)
    assert first + _train(s2, batches[2:]) == ref          # bit-exact on CPU


def test_rng_round_trip():
    st = ckpt.capture_rng()
    a = (torch.rand(3), random.random(), np.random.rand())
    tensors, meta = ckpt._rng_files([st])
    back = ckpt._rng_from_files(tensors, json.loads(json.dumps(meta)))
    ckpt.restore_rng(back[0])
    b = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_flatten_optimizer_state():
    st = {"layers.0.w": {"exp_avg": torch.ones(2), "step": torch.tensor(3.0)}, "x::y": {"exp_avg": torch.zeros(1)}}
    back = ckpt.unflatten_optimizer_state(ckpt.flatten_optimizer_state(st))
    assert back.keys() == st.keys() and torch.equal(back["layers.0.w"]["step"], torch.tensor(3.0))


def _save(root, step, fail=False):
    def save_draft(d):
        (d / "config.json").write_text("{}")
        if fail:
            raise KeyboardInterrupt   # e.g. killed while writing
    return ckpt.save_checkpoint(root, step, save_draft=save_draft, weights={"w": torch.ones(2)},
                                optimizer={"w": {"exp_avg": torch.zeros(2)}}, meta={"sequences_consumed": step},
                                rng=[ckpt.capture_rng()], config_yaml="", keep_last=2)


def test_atomic_write_pruning_and_partial_cleanup(tmp_path):
    for s in (1, 2, 3):
        _save(tmp_path, s)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3]     # keep_last=2
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 4, fail=True)
    assert (tmp_path / "step_4.tmp").is_dir() and not (tmp_path / "step_4").exists()
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_3"
    assert (tmp_path / "latest").read_text().strip() == "step_3"
    (tmp_path / "step_9").mkdir()                                       # no meta.json: not a checkpoint
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_3"
    assert ckpt.remove_partial(tmp_path) == [tmp_path / "step_4.tmp"]
    _save(tmp_path, 3)                                                  # re-saving a step swaps atomically
    assert ckpt.load_training_state(tmp_path / "step_3").step == 3
    assert not list(tmp_path.glob("*.old"))


def test_checkpoint_files_need_no_pickle(tmp_path):
    path = _save(tmp_path, 1)
    for f in (path / "training_state").iterdir():
        head = f.read_bytes()[:2]
        assert head != b"\x80\x04" and head != b"PK"      # neither pickle nor torch.save zip
