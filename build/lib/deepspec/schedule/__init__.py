"""Confidence calibration (STS) and confidence-scheduled verification (DSpark, second half).

- `rollouts`: the per-round rollout record eval logs (JSONL I/O)
- `calibration`: Sequential Temperature Scaling, ECE / AUROC / Brier, threshold sweep
- `calibrate.run(cfg)`: the `deepspec calibrate` stage
- `profile`: SPS(B) cost tables (measured or synthetic)
- `sps_grid`: SPS(R, B) — one table per concurrency R, for costs that are not a function of B alone
- `cost_model`: the scheduler's cost model from the config (a saved table or grid, or a profile)
- `profile_cmd.run(cfg)`: the `deepspec profile` stage
- `prefix_scheduler`: Alg. 1 and the verification-length policies eval calls
- `simulator`: replay rollouts at concurrency R, compare policies
"""
from .calibration import (CALIBRATION_FILENAME, Calibration, apply_temperature, apply_temperatures, auroc,
                          brier, calibration_metrics, cumulative, ece, find_calibration, fit_sts,
                          temperature_grid, threshold_lengths, threshold_sweep)
from .prefix_scheduler import (ConfidencePolicy, FixedLengthPolicy, PrefixSchedulerPolicy, ScheduleResult,
                               ThresholdPolicy, expected_throughput, make_policy, optimal_lengths_bruteforce,
                               policy_from_config, schedule_prefix, verify_lengths)
from .cost_model import load_sps_table, profile_from_config
from .profile import SPSTable, profile_sps, synthetic_gpu_table
from .sps_grid import SPSGrid, cost_at, load_cost_model, profile_sps_grid
from .rollouts import (RolloutRecord, RolloutWriter, default_rollouts_path, group_by_request, make_record,
                       read_rollouts, synthetic_rollouts, to_arrays, write_rollouts)
from .simulator import SimResult, compare_policies, plot_pareto, simulate

__all__ = [
    "CALIBRATION_FILENAME", "Calibration", "apply_temperature", "apply_temperatures", "auroc", "brier",
    "calibration_metrics", "cumulative", "ece", "find_calibration", "fit_sts", "temperature_grid",
    "threshold_lengths", "threshold_sweep", "ConfidencePolicy", "FixedLengthPolicy", "PrefixSchedulerPolicy",
    "ScheduleResult", "ThresholdPolicy", "expected_throughput", "make_policy", "optimal_lengths_bruteforce",
    "policy_from_config", "schedule_prefix", "verify_lengths", "SPSTable", "load_sps_table",
    "profile_from_config", "profile_sps",
    "synthetic_gpu_table", "RolloutRecord", "RolloutWriter", "default_rollouts_path", "group_by_request",
    "make_record", "read_rollouts", "synthetic_rollouts", "to_arrays", "write_rollouts", "SimResult",
    "compare_policies", "plot_pareto", "simulate", "SPSGrid", "cost_at", "load_cost_model", "profile_sps_grid",
]
