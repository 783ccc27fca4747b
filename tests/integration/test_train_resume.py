"""Resumability of `deepspec train`: kill -9, SIGTERM, non-finite loss.

A real `deepspec train` subprocess is killed with SIGKILL mid-run, resumed, stopped with SIGTERM,
resumed again; the stitched loss trajectory, grad norms and final weights must equal an
uninterrupted run bit for bit (CPU, fixed seed, one thread)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deepspec.config import load_config
from deepspec.train import checkpoint as ckpt
from deepspec.train.loop import run
from deepspec.train.stopping import NonFiniteLossError

from test_train_distributed import common, write_regen  # noqa: E402  (same directory, pytest rootdir import)

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _records(run_dir: Path):
    f = run_dir / "metrics.jsonl"
    if not f.is_file():
        return []
    out = []
    for line in f.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:   # a line being written
            pass
    return out


def _last_step(run_dir: Path) -> int:
    return max([r["step"] for r in _records(run_dir) if "train/loss" in r] or [0])


def _launch(overrides):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DEEPSPEC_NO_PROGRESS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "deepspec.cli", "train", *overrides], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_step(proc, run_dir: Path, step: int, timeout: float = 240) -> int:
    end = time.time() + timeout
    while time.time() < end:
        s = _last_step(run_dir)
        if s >= step:
            return s
        if proc.poll() is not None:
            raise AssertionError(f"training exited early ({proc.returncode}):\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"step {step} not reached in {timeout}s")


def test_kill9_and_sigterm_resume_reproduce_the_uninterrupted_run(tmp_path):
    torch.set_num_threads(1)
    regen = write_regen(tmp_path / "regen.jsonl")
    extra = {"train.max_steps": 12, "train.save_every": 3, "train.keep_last": 2, "train.strategy": "single",
             "train.eval_every": 4, "data.heldout_fraction": 0.2}
    ref_dir, dir_ = tmp_path / "ref", tmp_path / "run"
    run(load_config(common(regen, run_dir=str(ref_dir), **extra)))
    overrides = common(regen, run_dir=str(dir_), **extra)

    # 1) SIGKILL somewhere after step 4 (a checkpoint exists; maybe one is half-written)
    p = _launch(overrides)
    _wait_for_step(p, dir_, 4)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    killed_at = _last_step(dir_)
    assert killed_at < 12, "the run finished before it could be killed"
    first = ckpt.latest_checkpoint(dir_ / "checkpoints")
    assert first is not None and ckpt.load_training_state(first).step % 3 == 0

    # 2) resume; SIGTERM after step 8: the step finishes, a complete checkpoint is written
    p = _launch(overrides)
    _wait_for_step(p, dir_, 8)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 143 and "training stopped by SIGTERM after step" in out, out[-3000:]
    stopped = ckpt.latest_checkpoint(dir_ / "checkpoints")
    stop_step = ckpt.load_training_state(stopped).step
    assert 8 <= stop_step < 12, out[-3000:]
    assert (dir_ / "checkpoints" / "latest").read_text().strip() == f"step_{stop_step}"
    assert not list((dir_ / "checkpoints").glob("*.tmp"))
    assert "resuming from" in (dir_ / "train.log").read_text()

    # 3) resume to the end
    p = _launch(overrides)
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, out[-3000:]

    ref, got = _records(ref_dir), _records(dir_)
    assert [r["step"] for r in got] == [r["step"] for r in ref]          # each step logged once
    for a, b in zip(ref, got):
        for k in ("train/loss", "grad_norm", "lr", "tokens", "sequences", "eval/loss", "train/expected_tau"):
            assert a.get(k) == b.get(k), (a["step"], k, a.get(k), b.get(k))
    final = lambda d: load_file(str(d / "checkpoints" / "step_12" / "training_state" / "master_weights.safetensors"))
    wa, wb = final(ref_dir), final(dir_)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [s for s, _ in ckpt.list_checkpoints(dir_ / "checkpoints")] == [9, 12]   # keep_last=2


def test_non_finite_loss_stops_naming_step_and_term(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setenv("WANDB_MODE", "offline")       # wandb without a login; closed on the error path
    regen = write_regen(tmp_path / "regen.jsonl")
    d = tmp_path / "nan"
    cfg = load_config(common(regen, run_dir=str(d), **{"train.lr": 1e30, "train.warmup_ratio": 0.0,
                                                       "train.save_every": 1, "train.strategy": "single",
                                                       "train.wandb": True}))
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss at step 2 in loss term\(s\) 'ce'"):
        run(cfg)
    # step 1 was saved; nothing of step 2 (no checkpoint, no half-written directory, no metrics)
    assert [s for s, _ in ckpt.list_checkpoints(d / "checkpoints")] == [1]
    assert not list((d / "checkpoints").glob("*.tmp"))
    assert [r["step"] for r in _records(d)] == [1]
    assert "non-finite loss at step 2" in (d / "train.log").read_text()
    assert list((d / "wandb").glob("offline-run-*")) and list((d / "tb").glob("events.*"))
