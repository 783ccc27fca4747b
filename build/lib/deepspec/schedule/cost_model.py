"""The scheduler's cost model from the config: a saved SPS table or grid, or a fresh profile of the target.

``schedule.sps_table`` names an SPS(B) table (`deepspec.schedule.profile`) or an SPS(R, B)
grid (`deepspec.schedule.sps_grid`); without it the target is profiled as
``schedule.profile_*`` says.
"""
from __future__ import annotations

from typing import Callable, Optional

from .profile import profile_sps
from .sps_grid import CostModel, load_cost_model, profile_sps_grid


def profile_from_config(cfg, target, on_size: Optional[Callable[[int], None]] = None) -> CostModel:
    """Profile ``target`` as configured: an SPS(R, B) grid over ``schedule.profile_requests`` if
    set (B = R·1 … R·(γ+1)), else one SPS(B) table over ``schedule.profile_batch_sizes``."""
    sc = cfg.schedule
    if sc.profile_requests:
        return profile_sps_grid(target, sc.profile_requests, tokens_per_request=int(cfg.draft.gamma) + 1,
                                context_len=sc.profile_context_len, repeats=sc.profile_repeats, on_size=on_size)
    return profile_sps(target, sc.profile_batch_sizes, context_len=sc.profile_context_len,
                       repeats=sc.profile_repeats, mode=sc.profile_mode, on_size=on_size)


def load_sps_table(cfg, target=None) -> CostModel:
    """The scheduler's cost model: ``cfg.schedule.sps_table`` (an SPS(B) table or an SPS(R, B)
    grid) if set, else `profile_from_config` of ``target``."""
    if cfg.schedule.sps_table:
        return load_cost_model(cfg.schedule.sps_table)
    if target is None:
        raise ValueError("schedule.sps_table is not set and no target was given to profile")
    return profile_from_config(cfg, target)
