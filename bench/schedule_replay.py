"""Replays of logged rollouts, the machinery of `bench/decode_cost.py` ``batched`` and ``schedule``.

``batched``: for each concurrency R and policy (fixed ℓ = γ, static threshold(s), prefix scheduler) the
serving simulator (`deepspec.schedule.simulator.simulate`) replays the rollouts and predicts system
tokens/s from an SPS(B) table; in the *same* replay (`simulate(on_step=...)`: same seed, slots, rounds,
lengths ℓ_r, accepted counts) every step also runs the real target verification forward
(`RealVerifier`): ``target.decode`` of ``[R, max_r(1+ℓ_r)]`` new tokens over R cached contexts (prefilled
once per R, untimed; rolled back after each step).  HF batches are padded to the longest request, so each
row is [anchor, ℓ_r drafts, padding]; drafts are the logged ``draft_tokens`` where present, the anchor
and padding random ids.  Acceptance comes from the log: the forward is timed only.  Measured tokens/s =
replay tokens / (Σ forward wall time + steps · draft time).  Predictions: packed B = Σ(1+ℓ_r) (what the
simulator assumes) and padded B = R·max(1+ℓ_r) (what the HF forward computes).

``schedule``: the simulated goodput of the prefix scheduler against fixed-length verification and static
thresholds on calibrated cumulative confidence, per SPS table and R, on identical replays (STS fitted on
one half of the requests, the other half replayed).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from deepspec.schedule.prefix_scheduler import FixedLengthPolicy, PrefixSchedulerPolicy, ThresholdPolicy
from deepspec.schedule.profile import SPSTable, profile_sps
from deepspec.schedule.rollouts import RequestTrace, iter_rollout_lines
from deepspec.schedule.simulator import SimResult, SimStep, best_threshold_results, compare_policies, simulate


# -- batched: the real verification forward of each simulated step ----------------------------------------

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


def batched_markdown(rows: List[Dict]) -> str:
    out = ["| R | policy | SPS table | steps | mean B packed → padded | drafts verified / req-step | tokens "
           "| predicted tok/s packed | predicted tok/s padded | measured tok/s | error packed | error padded |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['R']} | {r['policy']} | {r.get('table', 'global')} | {r['steps']} | {r['mean_B_packed']:.1f} → {r['mean_B_padded']:.1f} "
                   f"| {r['mean_verified_drafts_per_request_step']:.2f} | {r['tokens']} "
                   f"| {r['predicted_tps_packed']:.1f} | {r['predicted_tps_padded']:.1f} | {r['measured_tps']:.1f} "
                   f"| {100 * r['rel_error_packed']:+.1f}% | {100 * r['rel_error_padded']:+.1f}% |")
    return "\n".join(out)


# -- schedule: the simulator's goodput per policy ------------------------------------------------------

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


def schedule_markdown(rows) -> str:
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
