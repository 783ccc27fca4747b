"""The root config: one dataclass per Hydra group, unknown keys are errors."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .cache import CacheConfig
from .data import DataConfig
from .draft import DraftConfig, LossConfig
from .engine import EngineConfig
from .eval import EvalConfig
from .schedule import ScheduleConfig
from .target import TargetConfig
from .train import TrainConfig

__all__ = [
    "DeepSpecConfig", "TargetConfig", "DraftConfig", "LossConfig", "DataConfig",
    "CacheConfig", "TrainConfig", "EvalConfig", "ScheduleConfig", "EngineConfig",
]


@dataclass
class DeepSpecConfig:
    # Where this run writes its outputs (resolved config, regen JSONL, cache, checkpoints).
    run_dir: str = "runs/default"
    seed: int = 0
    # Name of the recipe this config came from (informational).
    recipe: Optional[str] = None
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
