"""Benchmark (not a test): real batched verification on this machine vs the serving simulator.

    python bench/verify_batched.py --rollouts eval/rollouts.jsonl [--calibration calibration.json]
        [--sps-table sps.json] [--target reference:smollm2-135m] [--concurrency 1 2 4 8] [--steps 30]

For each R and policy (fixed ℓ = γ, static threshold(s), prefix scheduler: the constructors
bench/schedule_gain.py uses) the simulator replays the logged rollouts for ``--steps`` steps and
predicts system tokens/s from the SPS(B) table.  In the *same* replay (`simulate(on_step=...)`:
same seed, slots, rounds, lengths ℓ_r, accepted counts) every step also runs the real target
verification forward: ``target.decode`` of ``[R, max_r(1+ℓ_r)]`` new tokens over R cached
contexts of ``--context-len`` tokens (prefilled once per R, untimed; rolled back after each step).
HF batches are padded to the longest request, so each row is [anchor, ℓ_r drafts, padding]; drafts
are the logged ``draft_tokens`` where present, the anchor and padding random ids.

ACCEPTANCE COMES FROM THE LOG: the forward is timed only; its outputs are not compared to the
drafts.  Measured tokens/s = replay tokens / (Σ forward wall time + steps · --draft-time-s).
Predictions: packed B = Σ(1+ℓ_r) (what the simulator assumes) and padded B = R·max(1+ℓ_r)
(what this HF forward computes); the gap between them is the padding.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.records import part_path, record_path  # noqa: E402
from deepspec.schedule.calibration import Calibration  # noqa: E402
from deepspec.schedule.prefix_scheduler import PrefixSchedulerPolicy, make_policy  # noqa: E402
from deepspec.schedule.profile import SPSTable, device_name, profile_sps  # noqa: E402
from deepspec.schedule.sps_grid import SPSGrid  # noqa: E402
from deepspec.schedule.rollouts import RequestTrace, iter_rollout_lines  # noqa: E402
from deepspec.schedule.simulator import SimResult, SimStep, simulate  # noqa: E402

NOTE = ("acceptance outcomes come from the rollout log; the target forward is timed only "
        "(its outputs are not checked against the drafts)")


def sync(device) -> None:
    """Wait for queued CUDA work so a timed forward is complete (no-op elsewhere)."""
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class TokenTrace(RequestTrace):
    """A request's rounds plus the logged draft token ids and the JSONL line of each round."""
    draft_tokens: List[Optional[List[int]]] = field(default_factory=list)
    lines: List[int] = field(default_factory=list)


def load_traces(path) -> Tuple[List[TokenTrace], Dict[str, int]]:
    """Rollouts JSONL → one trace per request (rounds in logged order); errors name path:line."""
    rows: Dict[str, list] = {}
    seen: Dict[Tuple[str, int], int] = {}
    gamma, first = None, 0
    for line, rec in iter_rollout_lines(path):
        where = f"{path}:{line}"
        if rec.confidence is None:
            raise ValueError(f"{where}: request {rec.request_id!r} round {rec.round} has no confidence "
                             "(log rollouts with a drafter that has a confidence head)")
        if gamma is None:
            gamma, first = rec.gamma, line
        elif rec.gamma != gamma:
            raise ValueError(f"{where}: γ={rec.gamma} but line {first} has γ={gamma} (log one draft length)")
        key = (rec.request_id, rec.round)
        if key in seen:
            raise ValueError(f"{where}: round {rec.round} of request {rec.request_id!r} repeats line {seen[key]}")
        seen[key] = line
        rows.setdefault(rec.request_id, []).append((rec.round, line, rec))
    if gamma is None:
        raise ValueError(f"{path}: no rollout records")
    traces = []
    for rid, rs in rows.items():
        rs.sort(key=lambda x: x[0])
        recs = [r for _, _, r in rs]
        traces.append(TokenTrace(rid, np.array([r.confidence for r in recs], dtype=np.float64),
                                 np.array([r.accepted for r in recs], dtype=np.int64),
                                 np.array([r.verified_len for r in recs], dtype=np.int64),
                                 draft_tokens=[r.draft_tokens for r in recs], lines=[ln for _, ln, _ in rs]))
    info = {"gamma": gamma, "requests": len(traces), "rounds": len(seen),
            "rounds_with_draft_tokens": sum(d is not None for t in traces for d in t.draft_tokens),
            "censored_rounds": int(sum(np.sum((t.verified < gamma) & (t.accepted >= t.verified)) for t in traces))}
    return traces, info


def check_vocab(traces: List[TokenTrace], vocab_size: int, path) -> None:
    for t in traces:
        for d, line in zip(t.draft_tokens, t.lines):
            if d is not None and (max(d) >= vocab_size or min(d) < 0):
                raise ValueError(f"{path}:{line}: draft token ids {d} outside the target vocab 0..{vocab_size - 1} "
                                 "(rollouts of another target? pass --random-tokens)")


class RealVerifier:
    """``on_step`` callback: runs and times the real batched verification forward of each step."""

    def __init__(self, target, cache, base: int, table: SPSTable, draft_time_s: float = 0.0,
                 seed: int = 0, logged_tokens: bool = True, progress=None):
        import torch
        self.torch, self.target, self.cache, self.base = torch, target, cache, int(base)
        self.table, self.draft_time_s, self.logged_tokens, self.progress = table, draft_time_s, logged_tokens, progress
        self.gen = torch.Generator().manual_seed(seed)
        self.times: List[float] = []
        self.shapes: List[List[int]] = []
        self.lengths: List[List[int]] = []
        self.tokens = 0
        self.padded_time_s = 0.0
        self.padded_tokens_total = 0

    def step_ids(self, step: SimStep):
        """[R, max(1+ℓ_r)] ids: random anchor, the ℓ_r drafts (logged ids if present), random padding."""
        torch = self.torch
        R, L = len(step.lengths), 1 + int(step.lengths.max())
        ids = torch.randint(0, int(self.target.vocab_size), (R, L), generator=self.gen)
        for r, (tr, pos) in enumerate(zip(step.traces, step.positions)):
            ell = int(step.lengths[r])
            d = tr.draft_tokens[pos] if self.logged_tokens and isinstance(tr, TokenTrace) else None
            if d is not None and ell:
                ids[r, 1:1 + ell] = torch.tensor(d[:ell])
        return ids

    def __call__(self, step: SimStep) -> None:
        ids = self.step_ids(step).to(self.target.device)
        R, L = ids.shape
        dev = self.target.device
        sync(dev)
        t0 = time.perf_counter()
        self.target.decode(ids, past_key_values=self.cache)
        sync(dev)
        self.times.append(time.perf_counter() - t0)
        self.target.rollback(self.cache, self.base)
        self.shapes.append([int(R), int(L)])
        self.lengths.append([int(x) for x in step.lengths])
        self.tokens += int(np.sum(step.kept + 1))
        self.padded_tokens_total += int(R * L)
        self.padded_time_s += float(self.table.step_time(R * L)) + self.draft_time_s
        if self.progress is not None:
            self.progress.update(1)


def prefill(target, R: int, context_len: int, seed: int = 0):
    """R cached contexts of ``context_len`` random tokens (untimed); returns (cache, its length)."""
    import torch
    cache = target.new_cache()
    if context_len > 0:
        gen = torch.Generator().manual_seed(seed)
        target.decode(torch.randint(0, int(target.vocab_size), (R, context_len), generator=gen).to(target.device),
                      past_key_values=cache)
    return cache, target.cache_length(cache)


def warm(target, cache, base: int, R: int, width: int, n: int) -> None:
    import torch
    for _ in range(n):
        target.decode(torch.randint(0, int(target.vocab_size), (R, width)).to(target.device), past_key_values=cache)
        target.rollback(cache, base)


def measure(target, traces, policy, table: SPSTable, R: int, steps: int, cache, base: int,
            draft_time_s: float = 0.0, seed: int = 0, logged_tokens: bool = True,
            progress=None) -> Tuple[SimResult, RealVerifier]:
    """One replay: the simulator's prediction and the real forwards of the same steps."""
    ver = RealVerifier(target, cache, base, table, draft_time_s, seed, logged_tokens, progress)
    sim = simulate(traces, policy, table, R, steps=steps, draft_time_s=draft_time_s, seed=seed, on_step=ver)
    if ver.tokens != sim.tokens or len(ver.times) != sim.steps:
        raise RuntimeError(f"replay mismatch: real run {ver.tokens} tokens / {len(ver.times)} steps, "
                           f"simulator {sim.tokens} / {sim.steps}")
    return sim, ver


def row(sim: SimResult, ver: RealVerifier, draft_time_s: float, table: SPSTable, table_label: str = "global") -> Dict:
    """Prediction (``sim``, made with ``table``) next to the measured forwards of the same steps."""
    wall = float(sum(ver.times)) + draft_time_s * sim.steps
    measured = sim.tokens / wall if wall > 0 else 0.0
    padded_time = sum(float(table.step_time(r * l)) + draft_time_s for r, l in ver.shapes)
    padded = sim.tokens / padded_time if padded_time > 0 else 0.0
    return {"R": sim.concurrency, "policy": sim.policy, "table": table_label, "steps": sim.steps, "tokens": sim.tokens,
            "predicted_tps_packed": sim.system_tps, "predicted_tps_padded": padded, "measured_tps": measured,
            "rel_error_packed": sim.system_tps / measured - 1 if measured else None,
            "rel_error_padded": padded / measured - 1 if measured else None,
            "mean_B_packed": sim.mean_batch_tokens, "mean_B_padded": ver.padded_tokens_total / max(sim.steps, 1),
            "mean_verified_drafts_per_request_step": sim.verified_drafts / max(sim.request_steps, 1),
            "tokens_per_request_step": sim.tokens_per_request_step,
            "predicted_time_s": sim.time_s, "measured_time_s": wall,
            "step_times_s": ver.times, "step_shapes": ver.shapes, "step_lengths": ver.lengths}


def markdown(rows: List[Dict]) -> str:
    out = ["| R | policy | SPS table | steps | mean B packed → padded | drafts verified / req-step | tokens "
           "| predicted tok/s packed | predicted tok/s padded | measured tok/s | error packed | error padded |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['R']} | {r['policy']} | {r.get('table', 'global')} | {r['steps']} | {r['mean_B_packed']:.1f} → {r['mean_B_padded']:.1f} "
                   f"| {r['mean_verified_drafts_per_request_step']:.2f} | {r['tokens']} "
                   f"| {r['predicted_tps_packed']:.1f} | {r['predicted_tps_padded']:.1f} | {r['measured_tps']:.1f} "
                   f"| {100 * r['rel_error_packed']:+.1f}% | {100 * r['rel_error_padded']:+.1f}% |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", required=True, help="rollout JSONL logged by `deepspec eval` (fixed-length)")
    p.add_argument("--target", default="reference:smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2, help="torch threads (0 = torch default)")
    p.add_argument("--calibration", help="STS calibration JSON from `deepspec calibrate` (default: raw confidences)")
    p.add_argument("--sps-table", help="SPS table JSON (default: profile the target here, saved next to --out)")
    p.add_argument("--profile-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--tokens-per-request", type=int, help="profile_sps requests mode (default 1+γ)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per profiled size")
    p.add_argument("--context-len", type=int, default=256)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.5], help="static threshold policies")
    p.add_argument("--convex", action="store_true", help="also run the scheduler deciding on the convex hull")
    p.add_argument("--per-r-profile", action="store_true",
                   help="also profile SPS(B) at each fixed concurrency R (B = R·1 … R·(1+γ)) and predict / "
                        "schedule with that table (rows labelled 'per-R')")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=2, help="untimed forwards per R before the replays")
    p.add_argument("--draft-time-s", type=float, default=0.0)
    p.add_argument("--random-tokens", action="store_true", help="ignore logged draft token ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(record_path("verify_batched")),
                   help="record path; its table is saved beside it as <stem>.sps.json (and <stem>.sps_grid.json)")
    a = p.parse_args(argv)
    import torch
    from tqdm import tqdm
    from deepspec.config import TargetConfig
    from deepspec.targets import load_target
    if a.threads:
        torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    traces, info = load_traces(a.rollouts)
    gamma = info["gamma"]
    cal = Calibration.load(a.calibration) if a.calibration else None
    target = load_target(TargetConfig(name=a.target, path=a.target, dtype=a.dtype, device="auto"))
    if not a.random_tokens:
        check_vocab(traces, int(target.vocab_size), a.rollouts)
    print(f"rollouts: {a.rollouts}; γ={gamma}; {info['rounds']} rounds of {info['requests']} requests, "
          f"{info['rounds_with_draft_tokens']} with draft token ids; {NOTE}", flush=True)
    if a.sps_table:
        table, table_src = SPSTable.load(a.sps_table), a.sps_table
        ctx = table.meta.get("context_len")
        if ctx is not None and int(ctx) != a.context_len:
            print(f"WARNING: {a.sps_table} was profiled with context_len={ctx}, the replay uses "
                  f"--context-len {a.context_len}", flush=True)
    else:
        t0 = time.time()
        table = profile_sps(target, a.profile_sizes, context_len=a.context_len, repeats=a.repeats, mode="requests",
                            tokens_per_request=a.tokens_per_request or gamma + 1, seed=a.seed)
        table.meta["profile_wall_s"] = round(time.time() - t0, 1)
        table_src = str(table.save(part_path(out, "sps", "json")))
        print(f"profiled SPS on {table.device} in {table.meta['profile_wall_s']} s → {table_src}", flush=True)

    policies = [make_policy("fixed")] + [make_policy("threshold", calibration=cal, threshold=t) for t in a.thresholds] \
        + [make_policy("scheduler", calibration=cal, sps_table=table, overhead_s=a.draft_time_s)]
    if a.convex:
        policies.append(PrefixSchedulerPolicy(table.convexified(), cal, overhead_s=a.draft_time_s,
                                              name="scheduler-convex"))
    load0 = os.getloadavg()
    rows, per_r_tables = [], {}
    n_replays = len(policies) + (1 if a.per_r_profile else 0)
    with tqdm(total=len(a.concurrency) * n_replays * a.steps, desc="verify", unit="step") as bar:
        for R in a.concurrency:
            table_r = None
            if a.per_r_profile:   # before this R's cache exists: the profile prefills its own contexts
                table_r = profile_sps(target, [R * t for t in range(1, gamma + 2)], context_len=a.context_len,
                                      repeats=a.repeats, mode="requests", requests=R, seed=a.seed)
                per_r_tables[R] = table_r.to_json()
            cache, base = prefill(target, R, a.context_len, a.seed)
            warm(target, cache, base, R, gamma + 1, a.warmup)
            for pol in policies:
                bar.set_postfix(R=R, policy=pol.name)
                sim, ver = measure(target, traces, pol, table, R, a.steps, cache, base, a.draft_time_s, a.seed,
                                   not a.random_tokens, bar)
                rows.append(row(sim, ver, a.draft_time_s, table))
                if table_r is not None and not isinstance(pol, PrefixSchedulerPolicy):
                    # same decisions, so the same measured forwards; only the prediction changes
                    sim_r = simulate(traces, pol, table_r, R, steps=a.steps, draft_time_s=a.draft_time_s, seed=a.seed)
                    rows.append(row(sim_r, ver, a.draft_time_s, table_r, "per-R"))
            if table_r is not None:
                pol = make_policy("scheduler", calibration=cal, sps_table=table_r, overhead_s=a.draft_time_s)
                bar.set_postfix(R=R, policy="scheduler per-R")
                sim, ver = measure(target, traces, pol, table_r, R, a.steps, cache, base, a.draft_time_s, a.seed,
                                   not a.random_tokens, bar)
                rows.append(row(sim, ver, a.draft_time_s, table_r, "per-R"))
            del cache
    md = markdown(rows)
    print(md)
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
               "device": device_name(target.device), "loadavg_start": load0, "loadavg_end": os.getloadavg()}
    result = {"bench": "verify_batched", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine,
              "args": vars(a), "note": NOTE, "rollouts": info,
              "calibration": {"path": a.calibration, "temperatures": cal.temperatures} if cal else None,
              "sps_table_source": table_src, "sps_table": table.to_json(),
              "per_r_sps_tables": per_r_tables or None, "results": rows}
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(md + "\n")
    if per_r_tables:   # the per-R profiles as one SPS(R, B) grid: `schedule.sps_table=` / schedule_gain --sps-table
        grid = SPSGrid({int(r): SPSTable.from_json(t) for r, t in per_r_tables.items()}, device=table.device,
                       target=table.target, meta={"source": str(out)})
        print(f"wrote {grid.save(part_path(out, 'sps_grid', 'json'))}", flush=True)
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
