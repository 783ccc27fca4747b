"""A non-editable install finds its config groups and recipes: `conf/` and `recipes/` sit at the
repository root and the wheel maps them into the package (setup.py)."""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CHECK = textwrap.dedent("""
    import sys
    from pathlib import Path
    import deepspec
    from deepspec.cli import main
    from deepspec.config import list_recipes, load_config
    site = Path(sys.argv[1]).resolve()
    assert Path(deepspec.__file__).resolve().is_relative_to(site), deepspec.__file__
    assert {"demo", "dspark_qwen3_4b", "eagle3_smollm2_cpu"} <= set(list_recipes())
    cfg = load_config(["recipe=dflash_qwen3_8b", "train.lr=1e-4"])
    assert cfg.draft.algorithm == "dflash" and cfg.target.path == "Qwen/Qwen3-8B", cfg
    assert cfg.run_dir == "runs/dflash_qwen3_8b" and cfg.train.lr == 1e-4
    sys.exit(main(["config", "recipe=demo"]))
""")


def test_installed_package_composes_configs_from_another_directory(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("deepspec", "conf", "recipes"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                        "--no-build-isolation", "--target", str(site), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr

    shipped = sorted(p.relative_to(site / "deepspec").as_posix() for p in (site / "deepspec").rglob("*.yaml"))
    in_repo = sorted(p.relative_to(REPO).as_posix() for d in ("conf", "recipes") for p in (REPO / d).rglob("*.yaml"))
    assert shipped == in_repo and "conf/config.yaml" in shipped

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPSPEC_")}
    env["PYTHONPATH"] = str(site)
    r = subprocess.run([sys.executable, "-c", CHECK, str(site)], cwd=elsewhere, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "run_dir: runs/demo" in r.stdout and "num_layers: 1" in r.stdout
