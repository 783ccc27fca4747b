"""What a user on an offline machine meets first: every load failure of a target, dataset or checkpoint is
one line naming what was asked, where it was looked for and the fix, checked before anything is loaded or
written (exit 1, no traceback)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deepspec.targets.load_errors import explain

pytestmark = pytest.mark.integration


def _run(tmp_path, *args):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "deepspec.cli", *args, f"run_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


def _one_line(r, *needles):
    err = r.stderr.strip().splitlines()
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len([line for line in err if line.startswith("deepspec ")]) == 1, r.stderr
    assert all(n in err[-1] for n in needles), err[-1]
    return err[-1]


@pytest.mark.parametrize("cmd", [["prepare", "target=qwen3_4b"], ["plan", "recipe=dspark_qwen3_8b"],
                                 ["train", "target=qwen3_4b"]])
def test_a_hub_target_not_on_this_machine(tmp_path, cmd):
    line = _one_line(_run(tmp_path, *cmd), "target.path='Qwen/Qwen3-", "HF_HUB_OFFLINE=1", "hf download",
                     "target.path to a local directory")
    assert "not in the local cache" in line
    assert not (tmp_path / "run" / "regen").exists()       # nothing written before the target was found


def test_a_local_target_path_that_does_not_exist(tmp_path):
    _one_line(_run(tmp_path, "prepare", f"target.path={tmp_path / 'nope' / 'model'}"),
              "no such file or directory", "config.json")


def test_a_missing_checkpoint_is_named_before_the_target_loads(tmp_path):
    # the target is bogus too: an error about it would mean it was loaded first
    _one_line(_run(tmp_path, "eval", f"eval.checkpoint={tmp_path / 'ckpt'}", "target.path=no-org/no-model"),
              f"eval.checkpoint={tmp_path / 'ckpt'}", "missing config.json")
    assert not (tmp_path / "run" / "eval").exists()


def test_a_hub_dataset_not_on_this_machine(tmp_path):
    _one_line(_run(tmp_path, "prepare", "target.path=tiny:llama", "data.source=hf", "data.hf_name=no-org/no-data"),
              "data.hf_name='no-org/no-data'", "HF_DATASETS_OFFLINE=1", "data.path")


def test_a_missing_local_dataset_file(tmp_path):
    _one_line(_run(tmp_path, "prepare", "target.path=tiny:llama", "data.source=jsonl",
                   f"data.path={tmp_path / 'none.jsonl'}"), "none.jsonl", "data.path")


def test_gated_and_unknown_repositories_are_explained():
    gated = OSError("You are trying to access a gated repo.\\nMake sure to have access to it at https://…")
    assert "accept its license" in str(explain(gated, "meta-llama/Llama-3.1-8B", "model"))
    unknown = OSError("nobody/nothing is not a local folder and is not a valid model identifier listed on hub")
    msg = str(explain(unknown, "nobody/nothing", "tokenizer"))
    assert msg.startswith("target.path='nobody/nothing': the tokenizer cannot be loaded") and "check the id" in msg
