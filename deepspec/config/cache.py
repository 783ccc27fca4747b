"""Hidden-state cache section (`cache=...`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class CacheConfig:
    dir: Optional[str] = None
    # bf16 (lossless) | fp8 | lowrank
    codec: str = "bf16"
    zstd_level: int = 3
    shard_samples: int = 256
    batch_tokens: int = 8192
    # lowrank codec rank and calibration size (tokens) for fp8/lowrank.
    rank: int = 256
    calib_tokens: int = 16384
