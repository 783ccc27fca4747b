"""Hidden-state cache section (`cache=...`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Literal, Optional


@dataclass
class CacheConfig:
    dir: Optional[str] = None
    # Training reads these finished caches too, after `dir` (same target, layers and codec; disjoint
    # sample ids), e.g. the cache of a second prepare run with data.start_sample.
    extra_dirs: List[str] = field(default_factory=list)
    # Feature codec: bf16 (lossless) | fp8 | lowrank (lossy; see docs/cache.md).
    codec: Literal["bf16", "fp8", "lowrank"] = "bf16"
    # bf16 byte layout before zstd: plain | planes | planes_cm (see docs/cache.md).
    layout: Literal["plain", "planes", "planes_cm"] = "planes_cm"
    zstd_level: int = 1
    # Samples per shard (shard k = input records [k*S, (k+1)*S), whatever the rank count).
    shard_samples: int = 256
    # Padded tokens per capture forward (batch of similar-length samples).
    batch_tokens: int = 8192
    # Threads that compress captured tensors while the target runs (0 = auto: the
    # rank's share of the CPU cores, at most 8).
    encode_threads: int = 0
    # lowrank codec rank and calibration size (tokens) for fp8/lowrank.
    rank: int = 256
    calib_tokens: int = 16384
    # Lossy codecs (deepspec/cache/lossy.py): lowrank coefficients bf16 | fp8; last_hidden
    # bf16 (lossless, default: it defines the TV/CE target) | fp8; fp8 scale = margin*maxabs/448.
    lowrank_coef: Literal["bf16", "fp8"] = "bf16"
    last_hidden_codec: Literal["bf16", "fp8"] = "bf16"
    fp8_margin: float = 1.25
