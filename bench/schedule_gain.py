"""Benchmark (not a test): goodput of the prefix scheduler vs fixed-length verification.

    python bench/schedule_gain.py [--rollouts eval/rollouts.jsonl] [--target tiny:llama] [--label L]

1. Rollouts: a JSONL file logged by eval (fixed-length verification), else SYNTHETIC
   rollouts (overconfident head, see `deepspec.schedule.rollouts.synthetic_rollouts`).
   Requests are split in two halves: STS is fitted on one, the other is replayed.
2. SPS(B) tables: (a) profiled here on the given target (`profile_sps`, flat mode),
   (b) the synthetic GPU-like table (`synthetic_gpu_table`).
3. For each table and R ∈ --concurrency: simulate fixed-length (ℓ = γ), static thresholds
   on calibrated cumulative confidence, and the prefix scheduler, on identical replays.
   Prints a markdown table.  Writes `bench/results/schedule_gain[-L].json` and, with the same stem,
   `.md` (the table), `.sps.json` (the table profiled here) and `.pareto-<table>.png`.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.records import part_path, record_path  # noqa: E402
from deepspec.schedule.calibration import fit_sts  # noqa: E402
from deepspec.schedule.prefix_scheduler import (FixedLengthPolicy, PrefixSchedulerPolicy,  # noqa: E402
                                                ThresholdPolicy)
from deepspec.schedule.profile import SPSTable, profile_sps, synthetic_gpu_table  # noqa: E402
from deepspec.schedule.sps_grid import load_cost_model  # noqa: E402
from deepspec.schedule.rollouts import (group_by_request, is_synthetic, read_rollouts,  # noqa: E402
                                        synthetic_rollouts, to_arrays)
from deepspec.schedule.simulator import best_threshold_results, compare_policies, plot_pareto  # noqa: E402

THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def slug(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in name)


def split_requests(records, seed=0):
    ids = sorted({r.request_id for r in records})
    rng = np.random.default_rng(seed)
    rng.shuffle(ids)
    fit_ids = set(ids[: len(ids) // 2])
    return [r for r in records if r.request_id in fit_ids], [r for r in records if r.request_id not in fit_ids]


def profile_here(target_path: str, sizes, context_len: int, repeats: int, dtype: str, threads: int) -> SPSTable:
    import torch
    from deepspec.config import TargetConfig
    from deepspec.targets import load_target
    if threads:
        torch.set_num_threads(threads)
    t0 = time.time()
    tgt = load_target(TargetConfig(name=target_path, path=target_path, dtype=dtype, device="auto"))
    table = profile_sps(tgt, sizes, context_len=context_len, repeats=repeats, warmup=1)
    table.meta["profile_wall_s"] = round(time.time() - t0, 1)
    return table


def run_table(name, table, traces, calibration, concurrencies, steps, draft_time_s, seed):
    policies = [FixedLengthPolicy()] + [ThresholdPolicy(t, calibration) for t in THRESHOLDS] + \
               [PrefixSchedulerPolicy(table, calibration, overhead_s=draft_time_s)]
    if not table.meta.get("synthetic"):  # the same scheduler deciding on the table's convex hull
        policies.append(PrefixSchedulerPolicy(table.convexified(), calibration, overhead_s=draft_time_s,
                                              name="scheduler-convex"))
    res = []
    for R in concurrencies:  # at least ~4000 request-steps per point so small R is not replay noise
        res += compare_policies(traces, policies, table, concurrencies=[R], steps=max(steps, -(-4000 // R)),
                                draft_time_s=draft_time_s, seed=seed)
    return res


def summarize(name, results, concurrencies):
    by = {(r.policy, r.concurrency): r for r in results}
    best_thr = best_threshold_results(results)
    rows = []
    for R in concurrencies:
        f, s, b = by[("fixed", R)], by[("scheduler", R)], best_thr[R]
        t05 = by.get(("threshold0.5", R))
        cvx = by.get(("scheduler-convex", R))
        rows.append({
            "table": name, "R": R,
            "fixed_tps": f.system_tps, "scheduler_tps": s.system_tps,
            "gain_vs_fixed": s.system_tps / f.system_tps,
            "threshold0.5_tps": t05.system_tps if t05 else None,
            "best_threshold": b.policy, "best_threshold_tps": b.system_tps,
            "gain_vs_best_threshold": s.system_tps / b.system_tps,
            "fixed_tokens_per_req_step": f.tokens_per_request_step,
            "scheduler_tokens_per_req_step": s.tokens_per_request_step,
            "fixed_mean_B": f.mean_batch_tokens, "scheduler_mean_B": s.mean_batch_tokens,
            "fixed_rejected_frac": f.rejected_fraction, "scheduler_rejected_frac": s.rejected_fraction,
            "scheduler_per_user_tps": s.per_user_tps, "fixed_per_user_tps": f.per_user_tps,
            "scheduler_convex_tps": cvx.system_tps if cvx else None,
        })
    return rows


def markdown(rows):
    out = ["| SPS table | R | fixed tok/s | scheduler tok/s | gain | best static threshold (tok/s) | gain vs it "
           "| τ/req-step fixed → sched | mean B fixed → sched | rejected drafts fixed → sched "
           "| scheduler on convex hull tok/s |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['table']} | {r['R']} | {r['fixed_tps']:.1f} | {r['scheduler_tps']:.1f} | "
                   f"×{r['gain_vs_fixed']:.3f} | {r['best_threshold']} ({r['best_threshold_tps']:.1f}) | "
                   f"×{r['gain_vs_best_threshold']:.3f} | {r['fixed_tokens_per_req_step']:.2f} → "
                   f"{r['scheduler_tokens_per_req_step']:.2f} | {r['fixed_mean_B']:.0f} → {r['scheduler_mean_B']:.0f} | "
                   f"{100 * r['fixed_rejected_frac']:.0f}% → {100 * r['scheduler_rejected_frac']:.0f}% | "
                   + (f"{r['scheduler_convex_tps']:.1f} |" if r["scheduler_convex_tps"] else "— |"))
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", help="rollout JSONL logged by eval (default: synthetic rollouts)")
    p.add_argument("--gamma", type=int, default=7, help="draft length of synthetic rollouts")
    p.add_argument("--target", default="tiny:llama", help="target to profile here ('' = skip profiling)")
    p.add_argument("--sps-table", help="use this SPS table JSON instead of profiling")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch threads while profiling (0 = default)")
    p.add_argument("--profile-sizes", type=int, nargs="+",
                   default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048])
    p.add_argument("--context-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--pareto", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--draft-time-s", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default=None, help="a separate experiment: bench/results/schedule_gain-LABEL.json")
    p.add_argument("--out", default=None, help="record path (default: bench/results/schedule_gain[-LABEL].json)")
    a = p.parse_args(argv)
    out = Path(a.out) if a.out else record_path("schedule_gain", a.label)
    out.parent.mkdir(parents=True, exist_ok=True)

    if a.rollouts:
        records = read_rollouts(a.rollouts)
        source = a.rollouts
    else:
        records = synthetic_rollouts(n_requests=128, rounds_per_request=48, gamma=a.gamma, seed=a.seed)
        source = "SYNTHETIC (deepspec.schedule.rollouts.synthetic_rollouts)"
    synthetic = is_synthetic(records)
    fit_recs, replay_recs = split_requests(records, a.seed)
    fit = to_arrays(fit_recs)
    cal = fit_sts(fit.confidence, fit.accepted, verified=fit.verified)
    traces = group_by_request(replay_recs, fit.gamma)
    print(f"rollouts: {source}; γ={fit.gamma}; fit {len(fit)} rounds, replay {sum(len(t) for t in traces)} rounds "
          f"of {len(traces)} requests; STS T={[round(t, 2) for t in cal.temperatures]}", flush=True)

    tables = {}
    if a.sps_table:
        tab = load_cost_model(a.sps_table)   # an SPS(B) table or an SPS(R, B) grid
        tables[f"profiled-{slug(tab.target)}"] = tab
        print(f"loaded SPS table of {tab.target} on {tab.device}", flush=True)
    elif a.target:
        tab = profile_here(a.target, a.profile_sizes, a.context_len, a.repeats, a.dtype, a.threads)
        tables[f"profiled-{slug(tab.target)}"] = tab
        tab.save(part_path(out, "sps", "json"))
        print(f"profiled {tab.target} on {tab.device} in {tab.meta['profile_wall_s']} s:",
              dict(zip(tab.batch_tokens, [round(s, 1) for s in tab.steps_per_second])), flush=True)
    tables["synthetic-gpu"] = synthetic_gpu_table()

    all_rows, all_results = [], {}
    conc = sorted(set(a.concurrency) | set(a.pareto))
    for name, table in tables.items():
        res = run_table(name, table, traces, cal, conc, a.steps, a.draft_time_s, a.seed)
        all_results[name] = [r.to_json() for r in res]
        all_rows += summarize(name, res, a.concurrency)
        label = f"{table.target} on {table.device.split(' ')[0]}" if name != "synthetic-gpu" else "synthetic GPU-like SPS"
        keep = [r for r in res if r.concurrency in a.pareto and r.policy in ("fixed", "scheduler", "threshold0.3",
                                                                               "threshold0.5", "threshold0.7")]
        plot_pareto(keep, part_path(out, f"pareto-{name}", "png"),
                    title=f"{label}; {'SYNTHETIC rollouts' if synthetic else 'rollouts: ' + Path(source).name}")
    md = markdown(all_rows)
    print(md)
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} {platform.machine()}",
            "rollouts": source, "synthetic_rollouts": synthetic, "gamma": fit.gamma,
            "temperatures": cal.temperatures, "steps": a.steps, "draft_time_s": a.draft_time_s,
            "tables": {k: v.to_json() for k, v in tables.items()}}
    out.write_text(json.dumps({"meta": meta, "summary": all_rows, "results": all_results}, indent=1))
    out.with_suffix(".md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
