"""`deepspec profile`: measure the scheduler's cost model on this device and save it.

    deepspec profile target=qwen3_8b                                   # SPS(B) table
    deepspec profile target=qwen3_8b schedule.profile_requests=[1,8,32,128]   # SPS(R, B) grid

Writes ``{run_dir}/sps/sps_table.json`` (or ``sps_grid.json``) with the resolved config beside
it, and prints the measured step times.  Point ``schedule.sps_table=`` at the file to schedule
with it (eval, `bench/decode_cost.py schedule --sps-table`), on this machine or elsewhere.
"""
from __future__ import annotations

import logging
from pathlib import Path

from tqdm.auto import tqdm

from ..config import save_config
from ..paths import run_dir
from ..targets import load_target
from .cost_model import profile_from_config
from .sps_grid import SPSGrid

log = logging.getLogger(__name__)


def summary_lines(cost) -> list:
    """Markdown rows: R (or 'any'), B, ms per step, tokens/s."""
    tables = cost.tables.items() if isinstance(cost, SPSGrid) else [("any", cost)]
    lines = ["| R | B (tokens) | ms / step | tokens/s |", "|---|---|---|---|"]
    for r, t in tables:
        for b, s in zip(t.batch_tokens, t.steps_per_second):
            lines.append(f"| {r} | {b} | {1000.0 / s:.2f} | {b * s:.0f} |")
    return lines


def run(cfg) -> Path:
    sc = cfg.schedule
    gamma = int(cfg.draft.gamma)
    out_dir = run_dir(cfg) / "sps"
    target = load_target(cfg.target)
    if sc.profile_requests:
        total = len(set(sc.profile_requests)) * (gamma + 1)
    else:
        total = len(set(sc.profile_batch_sizes))
    with tqdm(total=total, desc="profile SPS", unit="size") as bar:
        def tick(B):
            bar.update(1)
            bar.set_postfix(B=B)
        cost = profile_from_config(cfg, target, on_size=tick)
    path = out_dir / ("sps_grid.json" if isinstance(cost, SPSGrid) else "sps_table.json")
    cost.save(path)
    save_config(cfg, out_dir)
    print("\n".join(summary_lines(cost)))
    print(f"cost model: {path}  (schedule.sps_table={path})")
    log.info("profile: %s on %s → %s", cost.target, cost.device, path)
    return path
