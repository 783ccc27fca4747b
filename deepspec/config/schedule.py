"""Calibration and scheduling section (`schedule=...`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Literal, Optional


@dataclass
class ScheduleConfig:
    # Path of an SPS(B) cost table or SPS(R, B) grid (JSON); None = profile on this device.
    sps_table: Optional[str] = None
    profile_batch_sizes: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    # Cached context length and timed repeats per batch size when profiling SPS(B).
    profile_context_len: int = 256
    profile_repeats: int = 5
    # requests: B tokens as R requests × (1+γ) tokens over R contexts; flat: one [1, B] batch.
    profile_mode: Literal["requests", "flat"] = "requests"
    # Profile an SPS(R, B) grid instead: one fixed-concurrency table per R listed here, each over
    # B = R·(1..γ+1).  None = one SPS(B) table over profile_batch_sizes.
    profile_requests: Optional[List[int]] = None
    # Read the SPS table through the lower convex hull of its step time (makes the greedy
    # scheduler optimal w.r.t. the table, but optimistic where measurements are concave).
    sps_convex: bool = False
    temperature_grid_min: float = 0.25
    temperature_grid_max: float = 4.0
    temperature_grid_size: int = 64
    ece_bins: int = 15
    # Rollout JSONL (per verification round: confidence[γ], accepted, ...);
    # None = {eval_dir}/rollouts.jsonl.
    rollouts: Optional[str] = None
    # Verification-length policy for eval: fixed | threshold | scheduler.
    policy: Literal["fixed", "threshold", "scheduler"] = "fixed"
    # policy=threshold: verify the longest prefix whose calibrated cumulative confidence stays above this.
    threshold: Optional[float] = None
    # calibration.json to apply; None = {eval.checkpoint}/calibration.json if present.
    calibration: Optional[str] = None
    # Per-step cost independent of B added to 1/SPS(B) (seconds; e.g. the draft forward).  None = eval
    # measures it: the median draft time (propose + advance) per round of its warm-up generation.
    draft_overhead_s: Optional[float] = None
    # Cap on target batch tokens per step for the scheduler (None = no cap).
    max_batch_tokens: Optional[int] = None
