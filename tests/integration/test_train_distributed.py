"""`deepspec train` under torchrun (2 processes, gloo): DDP / FSDP2 / DeepSpeed ZeRO-2 against a
one-process run with the same global batch, and resuming their checkpoints with another world size.

One torchrun launch runs the three strategies one after another (start-up dominates on CPU).
Tolerances (measured): per-step losses agree to ~1e-7 relative (only the order of float
additions differs); we assert 1e-5.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deepspec.config import load_config
from deepspec.train.loop import run

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
RTOL = 1e-5

WORDS = ("the quick brown fox jumps over lazy dog print return math sea waves help answer "
         "detail sold clips twelve times seven").split()

DRIVER = textwrap.dedent('''
    import json, os, sys
    import torch.distributed as dist
    from deepspec.config import load_config
    from deepspec.train.loop import run
    # one process group for every run of this launch (what `run` does on its own otherwise)
    dist.init_process_group("gloo")
    for overrides in json.loads(open(sys.argv[1]).read()):
        run(load_config(overrides))
''')


def write_regen(path: Path, n: int = 24, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)

    def text(lo, hi):
        k = int(torch.randint(lo, hi, (1,), generator=g))
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=g))

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            conv = [{"role": "user", "content": text(4, 12)}, {"role": "assistant", "content": text(10, 40)}]
            f.write(json.dumps({"id": str(i), "conversations": conv, "meta": {}}) + "\n")
    return path


def common(regen: Path, **extra) -> list:
    kw = {"target.path": "tiny:llama", "target.dtype": "float32", "target.num_feature_layers": 2,
          "draft.algorithm": "dspark", "draft.num_layers": 1, "draft.gamma": 4, "draft.head_rank": 16,
          "data.online": True, "data.regen_path": str(regen),
          "train.global_batch_sequences": 4, "train.micro_batch_sequences": 2, "train.anchors_per_sequence": 8,
          "train.max_steps": 4, "train.save_every": 2, "train.eval_every": 0, "train.bf16": False,
          "data.heldout_fraction": 0.2, "train.warmup_ratio": 0.25, "train.keep_last": 0}
    kw.update(extra)
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in kw.items()]


def losses(run_dir: Path) -> dict:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "train/loss" in rec:
            out[rec["step"]] = rec
    return out


def torchrun(tmp_path: Path, runs: list, nproc: int = 2, timeout: int = 400):
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(runs))
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DEEPSPEC_NO_PROGRESS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--standalone", str(driver), str(spec)]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return p


def _resume_single(src: Path, dst: Path, keep_step: int, regen: Path, **extra) -> Path:
    """Copy a run keeping only checkpoint step_{keep_step}, then continue it in this process."""
    shutil.copytree(src, dst)
    for p in (dst / "checkpoints").glob("step_*"):
        if p.name != f"step_{keep_step}":
            shutil.rmtree(p)
    return run(load_config(common(regen, **{"run_dir": str(dst), "train.strategy": "single", **extra})))


def test_ddp_fsdp_deepspeed_match_one_process_and_resume_across_world_sizes(tmp_path):
    from deepspec.drafts import load_drafter
    from deepspec.targets import load_target
    torch.set_num_threads(1)
    regen = write_regen(tmp_path / "regen.jsonl")

    # reference: one process, accumulation 2 over the same micro-batches (global batch 4)
    ref_dir = tmp_path / "single"
    ref_ckpt = run(load_config(common(regen, run_dir=str(ref_dir), **{"train.strategy": "single"})))
    ref = losses(ref_dir)
    assert sorted(ref) == [1, 2, 3, 4]
    # running a finished run again resumes at its end: nothing is trained, the same checkpoint returns
    assert run(load_config(common(regen, run_dir=str(ref_dir), **{"train.strategy": "single"}))) == ref_ckpt
    assert losses(ref_dir) == ref

    dirs = {s: tmp_path / s for s in ("ddp", "fsdp", "deepspeed")}
    torchrun(tmp_path, [
        common(regen, run_dir=str(dirs["ddp"]), **{"train.strategy": "ddp", "train.verify_sync": True}),
        common(regen, run_dir=str(dirs["fsdp"]), **{"train.strategy": "fsdp", "train.max_steps": 2}),
        common(regen, run_dir=str(dirs["deepspeed"]), **{"train.strategy": "deepspeed", "train.deepspeed_stage": 2,
                                                          "train.max_steps": 2}),
    ])

    # DDP: same loss as one process every step, parameters identical on both ranks
    ddp = losses(dirs["ddp"])
    assert sorted(ddp) == [1, 2, 3, 4]
    for s in ddp:
        assert ddp[s]["train/loss"] == pytest.approx(ref[s]["train/loss"], rel=RTOL)
        assert ddp[s]["param_sync_diff"] == 0.0
        assert ddp[s]["lr"] == ref[s]["lr"] and ddp[s]["tokens"] == ref[s]["tokens"]
    target = load_target(load_config(common(regen)).target)
    w_ref = load_drafter(ref_ckpt, target).state_dict()
    w_ddp = load_drafter(dirs["ddp"] / "checkpoints" / "step_4", target).state_dict()
    for k in w_ref:
        torch.testing.assert_close(w_ddp[k], w_ref[k], rtol=1e-4, atol=1e-6)

    # FSDP2 and DeepSpeed ZeRO-2 smoke runs: same losses, loadable drafts
    for s in ("fsdp", "deepspeed"):
        got = losses(dirs[s])
        assert sorted(got) == [1, 2]
        for k in got:
            assert got[k]["train/loss"] == pytest.approx(ref[k]["train/loss"], rel=RTOL), s
        load_drafter(dirs[s] / "checkpoints" / "step_2", target)
        assert json.loads((dirs[s] / "checkpoints" / "step_2" / "training_state" / "meta.json").read_text())[
            "world_size"] == 2

    # world size 2 -> 1: resume each 2-process checkpoint of step 2 in one process; steps 3..4
    # follow the one-process run (data position re-derived from the 8 sequences consumed)
    for s in ("ddp", "fsdp", "deepspeed"):
        out = tmp_path / f"{s}_to_single"
        _resume_single(dirs[s], out, 2, regen)
        got = losses(out)
        assert sorted(got) == [1, 2, 3, 4]
        for k in (3, 4):
            assert got[k]["train/loss"] == pytest.approx(ref[k]["train/loss"], rel=RTOL), (s, k)
            assert got[k]["sequences"] == ref[k]["sequences"]
        log = (out / "train.log").read_text()
        assert f"world size 2 → 1, strategy {s} → single" in log and "8 sequences consumed" in log
