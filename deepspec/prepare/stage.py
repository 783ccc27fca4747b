"""`deepspec prepare`: regenerate answers with the target, then capture the hidden-state cache.

Both halves resume: re-running with the same config continues where a killed run stopped.
With `data.online=true` the cache is skipped (training runs the frozen target itself).
"""
from __future__ import annotations

import logging
from pathlib import Path

from ..config import DeepSpecConfig, save_config
from ..paths import cache_dir, regen_path, run_dir
from ..cache.writer import build_cache
from ..targets.loader import check_target_source
from .regen import regenerate

log = logging.getLogger(__name__)


def run(cfg: DeepSpecConfig) -> int:
    if cfg.engine.kind == "hf" or not cfg.data.online:   # the target runs here: find it before writing anything
        check_target_source(cfg.target)
    save_config(cfg, run_dir(cfg))
    regen = Path(regenerate(cfg))
    log.info("regenerated conversations: %s", regen)
    if cfg.data.online:
        log.info("data.online=true: no cache is built; `deepspec train` will run the target online")
        return 0
    out = build_cache(cfg, regen_path=regen)
    log.info("cache: %s (target regen %s)", out, regen_path(cfg))
    print(f"prepare done: regen={regen} cache={cache_dir(cfg)}")
    return 0
