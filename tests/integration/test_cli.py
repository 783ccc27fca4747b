"""The installed `deepspec` console script."""
import json
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _run(*args):
    exe = shutil.which("deepspec")
    cmd = [exe, *args] if exe else [sys.executable, "-m", "deepspec.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_help_lists_every_stage():
    r = _run("--help")
    assert r.returncode == 0
    for cmd in ("prepare", "train", "eval", "plan", "demo", "cache", "gate", "serve", "calibrate"):
        assert cmd in r.stdout
    for cmd, sub in ((["cache", "--help"], ("verify", "info", "build", "finalize")), (["gate", "--help"], ("--codecs",))):
        r = _run(*cmd)
        assert r.returncode == 0 and all(s in r.stdout for s in sub), r.stdout + r.stderr


def test_train_cfg_job_prints_resolved_config():
    r = _run("train", "--cfg", "job", "draft=dspark", "target=qwen3_4b", "train.lr=3e-4")
    assert r.returncode == 0, r.stderr
    assert "algorithm: dspark" in r.stdout and "lr: 0.0003" in r.stdout and "Qwen/Qwen3-4B" in r.stdout


def test_unknown_key_is_an_error_naming_it():
    r = _run("train", "--cfg", "job", "train.not_a_key=1")
    assert r.returncode == 2
    assert "train.not_a_key" in r.stderr


def test_unknown_command():
    r = _run("frobnicate")
    assert r.returncode == 2 and "unknown command" in r.stderr


def test_corrupted_shard_stops_train_with_one_line(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"question {i}?"]}) + "\n" for i in range(4)))
    tiny = ["target.path=tiny:llama", "target.dtype=float32", f"run_dir={tmp_path / 'run'}"]
    r = _run("prepare", "data=jsonl", f"data.path={prompts}", "data.heldout_fraction=0", "engine.max_new_tokens=8",
             "cache.shard_samples=2", *tiny)
    assert r.returncode == 0, r.stderr[-3000:]
    for shard in (tmp_path / "run" / "cache").glob("shard-*.arrow"):   # whichever sample is read first
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    train = ["train", *tiny, "train.strategy=single", "train.max_steps=2", "train.global_batch_sequences=2",
             "train.micro_batch_sequences=2", "draft.num_layers=1"]
    r = _run(*train)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert last.startswith("deepspec train: cache corrupt error: shard-") and ".arrow" in last
    r = _run("--debug", *train)
    assert r.returncode == 1 and "Traceback" in r.stderr
