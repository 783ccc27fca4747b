"""Shared fixtures: tiny random targets of several families (built in code, no downloads)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


def make_tiny_target(family: str = "llama", num_layers: int = 4, hidden_size: int = 64, seed: int = 0,
                     num_feature_layers: int = 2, dtype=torch.float32):
    from deepspec.targets import TargetAdapter
    from deepspec.targets.tiny import build_tiny
    model, tok = build_tiny(family, num_layers=num_layers, hidden_size=hidden_size, seed=seed)
    return TargetAdapter(model.to(dtype), tok, num_feature_layers=num_feature_layers, name=f"tiny-{family}")


@pytest.fixture
def one_thread():
    """Tiny tensors: extra intra-op threads only spin on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=["llama", "qwen3", "gemma3"])
def tiny_target(request):
    """A tiny random target of each family (fp32)."""
    return make_tiny_target(request.param)


@pytest.fixture
def tiny_llama():
    return make_tiny_target("llama")


@pytest.fixture
def tiny_qwen3():
    return make_tiny_target("qwen3")


@pytest.fixture(scope="session")
def eval_data_dir(tmp_path_factory):
    """A benchmark directory of the tests' own prompts (tests/support/benchmarks.py), the same on every machine."""
    from tests.support.benchmarks import write_benchmarks
    return write_benchmarks(tmp_path_factory.mktemp("eval_datasets"))


@pytest.fixture(scope="session")
def reference_target_dir():
    """The real SmolLM2-135M-Instruct, converted once (slow tests only)."""
    from deepspec.targets.reference import fetch_reference
    return fetch_reference("smollm2-135m")


@pytest.fixture
def bench_module():
    """Import a `bench/` script as a module (the scripts are benchmarks, not part of the package)."""
    import importlib
    import sys

    def load(name: str):
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        return importlib.import_module(f"bench.{name}")
    return load


def _edited_copy(src, dst, cfg_edit=None, w_edit=None):
    """A copy of the draft directory ``src`` at ``dst`` with ``cfg_edit(config dict)`` and
    ``w_edit(weights dict)`` applied to config.json / model.safetensors (in place, on the copy)."""
    import json
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    if cfg_edit:
        cfg = json.loads((dst / "config.json").read_text())
        cfg_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if w_edit:
        w = load_file(str(dst / "model.safetensors"))
        w_edit(w)
        save_file(w, str(dst / "model.safetensors"))
    return dst


@pytest.fixture
def edited_draft():
    """``edited_draft(src, dst, cfg_edit=None, w_edit=None)``: an edited copy of a draft directory."""
    return _edited_copy
