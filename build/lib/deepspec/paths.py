"""Where each stage reads and writes, derived from one config (one place, no guessing)."""
from __future__ import annotations

from pathlib import Path


def run_dir(cfg) -> Path:
    return Path(cfg.run_dir)


def regen_path(cfg) -> Path:
    return Path(cfg.data.regen_path) if cfg.data.regen_path else run_dir(cfg) / "regen" / "regen.jsonl"


def heldout_path(cfg) -> Path:
    return regen_path(cfg).parent / "heldout.jsonl"


def cache_dir(cfg) -> Path:
    return Path(cfg.cache.dir) if cfg.cache.dir else run_dir(cfg) / "cache"


def checkpoints_dir(cfg) -> Path:
    return run_dir(cfg) / "checkpoints"


def eval_dir(cfg) -> Path:
    return Path(cfg.eval.out_dir) if cfg.eval.out_dir else run_dir(cfg) / "eval"


# Drafts trained by the project and shipped inside the package (safetensors + config + provenance).
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"
SHIPPED_FOR_TARGET = {"smollm2_135m": "smollm2-135m-dspark"}


def shipped_draft_dir(target_name: str):
    """The shipped draft for a target config name, or None when the package ships none for it."""
    name = SHIPPED_FOR_TARGET.get(target_name)
    d = SHIPPED_DIR / name if name else None
    return d if d is not None and (d / "model.safetensors").is_file() else None
