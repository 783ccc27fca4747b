"""tools/install.sh picks the torch build: the pinned CPU one by default, a CUDA one where a GPU is seen,
or what DEEPSPEC_TORCH says (never a CPU-only torch forced onto a GPU machine)."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "install.sh"


def _choice(tmp_path, gpu: bool, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("grep", "dirname"):
        (bin_dir / tool).unlink(missing_ok=True)
        (bin_dir / tool).symlink_to(shutil.which(tool))
    smi = bin_dir / "nvidia-smi"
    smi.unlink(missing_ok=True)
    if gpu:
        smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
        smi.chmod(0o755)
    e = {"PATH": str(bin_dir), **{k: v for k, v in env.items()}}
    out = subprocess.run([shutil.which("bash"), str(SCRIPT), "--print-torch"], env=e, capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


def test_default_is_the_pinned_cpu_build_without_a_gpu(tmp_path):
    assert _choice(tmp_path, gpu=False) == "cpu"


def test_a_visible_gpu_gets_a_cuda_torch(tmp_path):
    assert _choice(tmp_path, gpu=True) == "cuda"


@pytest.mark.parametrize("want", ["cpu", "keep", "torch==2.11.0"])
def test_explicit_choice_wins(tmp_path, want):
    assert _choice(tmp_path, gpu=True, DEEPSPEC_TORCH=want) == want


def test_the_package_does_not_pin_torch():
    text = (REPO / "pyproject.toml").read_text()
    assert '"torch>=' in text and '"torch==' not in text
    assert os.access(SCRIPT, os.R_OK)
