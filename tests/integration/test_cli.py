"""The installed `deepspec` console script."""
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
    for cmd in ("prepare", "train", "eval", "plan", "demo", "cache", "serve", "calibrate"):
        assert cmd in r.stdout


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
