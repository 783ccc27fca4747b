"""Calibration and scheduling section (`schedule=...`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class ScheduleConfig:
    # Path of an SPS(B) cost table (JSON); None = profile on this device.
    sps_table: Optional[str] = None
    profile_batch_sizes: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    temperature_grid_min: float = 0.25
    temperature_grid_max: float = 4.0
    temperature_grid_size: int = 64
    ece_bins: int = 15
    rollouts: Optional[str] = None
