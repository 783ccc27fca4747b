"""Serving simulator: replay logged draft rollouts for R concurrent requests.

Each of the R slots replays one request's logged verification rounds in order; when a
request's log is exhausted the slot takes the next request from the pool (a fixed
shuffled cycle), so the system stays at concurrency R.  Every simulated step:

1. each slot presents its next logged round: raw confidences c[γ] and the logged
   ``accepted`` count (logged with full verification, ℓ = γ);
2. the policy picks ℓ_r from the confidences (draft-side only);
3. the request keeps ``min(accepted, ℓ_r)`` drafts plus one target token — valid because
   whether a draft prefix is accepted does not depend on the drafts after it;
4. the step takes ``1/SPS(B) + draft_time_s`` seconds with B = Σ_r (1 + ℓ_r) (with an
   `SPSGrid`, 1/SPS_R(B): the curve profiled at this concurrency R).

Approximation: after a truncated round the real request would continue from a different
position; the replay instead moves on to the next logged round, i.e. it treats a request's
rounds as samples of its per-round behaviour.  Rounds logged with a truncated draft
(``verified < γ`` and fully accepted) are censored and would undercount; use fixed-length logs.

``on_step`` (optional) is called once per step with a `SimStep` (the slots' traces and round
positions, ℓ_r, logged and kept counts, B) after the policy chose and before the replay
advances; `bench/decode_cost.py batched` uses it to run the real target forward of the same replay.
It does not change the result.

Reported per run: system tokens/s, per-user tokens/s (= system / R: all slots stay busy),
tokens per request-step, mean B, verified draft tokens and verified-but-rejected ones.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from .prefix_scheduler import ConfidencePolicy
from .sps_grid import CostModel, cost_at
from .rollouts import RequestTrace

log = logging.getLogger(__name__)


@dataclass
class SimResult:
    policy: str
    concurrency: int
    steps: int
    time_s: float
    tokens: int                 # tokens produced (accepted drafts + 1 target token per request-step)
    accepted_drafts: int
    verified_drafts: int        # Σ ℓ_r
    rejected_drafts: int        # verified but rejected
    request_steps: int
    batch_tokens_total: int     # Σ over steps of B
    system_tps: float = 0.0
    per_user_tps: float = 0.0
    tokens_per_request_step: float = 0.0
    mean_batch_tokens: float = 0.0
    rejected_fraction: float = 0.0
    extra: Dict[str, float] = field(default_factory=dict)

    def finalize(self) -> "SimResult":
        self.system_tps = self.tokens / self.time_s if self.time_s > 0 else 0.0
        self.per_user_tps = self.system_tps / max(self.concurrency, 1)
        self.tokens_per_request_step = self.tokens / max(self.request_steps, 1)
        self.mean_batch_tokens = self.batch_tokens_total / max(self.steps, 1)
        self.rejected_fraction = self.rejected_drafts / max(self.verified_drafts, 1)
        return self

    def to_json(self) -> Dict:
        return asdict(self)


@dataclass
class SimStep:
    """What one simulated step replays (passed to ``simulate(on_step=...)``)."""
    index: int                      # 0-based step
    traces: List[RequestTrace]      # the trace each slot replays
    positions: List[int]            # row of that trace (round in logged order)
    lengths: np.ndarray             # [R] ℓ_r chosen by the policy
    accepted: np.ndarray            # [R] logged accepted counts
    kept: np.ndarray                # [R] min(accepted, ℓ_r): drafts this step keeps
    batch_tokens: int               # B = Σ (1 + ℓ_r)


class _Replay:
    """Slot-by-slot replay of request traces (deterministic given the seed)."""

    def __init__(self, traces: Sequence[RequestTrace], concurrency: int, seed: int = 0):
        self.traces = [t for t in traces if len(t) > 0]
        if not self.traces:
            raise ValueError("no request traces to replay")
        gammas = {t.confidence.shape[1] for t in self.traces}
        if len(gammas) != 1:
            raise ValueError(f"traces mix draft lengths γ={sorted(gammas)}")
        self.gamma = gammas.pop()
        self.rng = np.random.default_rng(seed)
        self.perm = self.rng.permutation(len(self.traces))
        self.next_req = 0
        self.slot_req = [self._take() for _ in range(concurrency)]
        # stagger start positions so slots are not in lockstep
        self.slot_pos = [int(self.rng.integers(0, len(self.traces[r]))) for r in self.slot_req]

    def _take(self) -> int:
        if self.next_req >= len(self.perm):
            self.perm = self.rng.permutation(len(self.traces))
            self.next_req = 0
        r = int(self.perm[self.next_req])
        self.next_req += 1
        return r

    def current(self):
        conf = np.stack([self.traces[r].confidence[p] for r, p in zip(self.slot_req, self.slot_pos)])
        acc = np.array([self.traces[r].accepted[p] for r, p in zip(self.slot_req, self.slot_pos)])
        ver = np.array([self.traces[r].verified[p] for r, p in zip(self.slot_req, self.slot_pos)])
        return conf, acc, ver

    def advance(self) -> None:
        for s in range(len(self.slot_req)):
            self.slot_pos[s] += 1
            if self.slot_pos[s] >= len(self.traces[self.slot_req[s]]):
                self.slot_req[s] = self._take()
                self.slot_pos[s] = 0


def simulate(traces: Sequence[RequestTrace], policy: ConfidencePolicy, sps_table: CostModel,
             concurrency: int, steps: int = 200, draft_time_s: float = 0.0, seed: int = 0,
             on_step: Optional[Callable[[SimStep], None]] = None) -> SimResult:
    """Simulate ``steps`` verification steps at concurrency R under one policy.

    The same ``seed`` replays the same rounds in the same slots for every policy, so
    policies are compared on identical inputs.  ``on_step`` observes each step (see
    `SimStep`); its return value and run time are ignored.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be ≥ 1")
    rep = _Replay(traces, concurrency, seed)
    cost = cost_at(sps_table, concurrency)   # a grid prices R requests with its curve for R
    res = SimResult(policy=getattr(policy, "name", type(policy).__name__), concurrency=concurrency,
                    steps=0, time_s=0.0, tokens=0, accepted_drafts=0, verified_drafts=0,
                    rejected_drafts=0, request_steps=0, batch_tokens_total=0)
    censored = 0
    for i in range(steps):
        conf, acc, ver = rep.current()
        ell = np.asarray(policy.lengths(conf), dtype=np.int64)
        if ell.shape != (concurrency,) or ell.min() < 0 or ell.max() > rep.gamma:
            raise ValueError(f"policy {res.policy} returned bad lengths {ell.tolist()}")
        censored += int(np.sum((ell > ver) & (acc >= ver)))
        kept = np.minimum(acc, ell)
        B = int(np.sum(1 + ell))
        res.steps += 1
        res.time_s += float(cost.step_time(B)) + draft_time_s
        res.tokens += int(np.sum(kept + 1))
        res.accepted_drafts += int(kept.sum())
        res.verified_drafts += int(ell.sum())
        res.rejected_drafts += int((ell - kept).sum())
        res.request_steps += concurrency
        res.batch_tokens_total += B
        if on_step is not None:
            on_step(SimStep(i, [rep.traces[r] for r in rep.slot_req], list(rep.slot_pos), ell, acc, kept, B))
        rep.advance()
    if censored:
        log.warning("simulator: %d request-steps used censored rounds (logged with verified < γ)", censored)
    res.extra["censored_request_steps"] = float(censored)
    return res.finalize()


def compare_policies(traces: Sequence[RequestTrace], policies: Sequence[ConfidencePolicy],
                     sps_table: CostModel, concurrencies: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
                     steps: int = 200, draft_time_s: float = 0.0, seed: int = 0) -> List[SimResult]:
    out = []
    for R in concurrencies:
        for p in policies:
            out.append(simulate(traces, p, sps_table, R, steps=steps, draft_time_s=draft_time_s, seed=seed))
    return out


def best_threshold_results(results: Sequence[SimResult], prefix: str = "threshold") -> Dict[int, SimResult]:
    """Per concurrency, the static-threshold run with the highest system throughput (oracle-tuned)."""
    best: Dict[int, SimResult] = {}
    for r in results:
        if r.policy.startswith(prefix) and (r.concurrency not in best or r.system_tps > best[r.concurrency].system_tps):
            best[r.concurrency] = r
    return best


def plot_pareto(results: Sequence[SimResult], path, title: str = "") -> None:
    """System tokens/s vs per-user tokens/s, one curve per policy over R (PNG, Agg)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    by: Dict[str, List[SimResult]] = {}
    for r in results:
        by.setdefault(r.policy, []).append(r)
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for name, rs in by.items():
        rs = sorted(rs, key=lambda r: r.concurrency)
        style = "-o" if name == "scheduler" else ("-s" if name.startswith("fixed") else "--.")
        ax.plot([r.per_user_tps for r in rs], [r.system_tps for r in rs], style, label=name, ms=4,
                lw=2 if name == "scheduler" else 1)
        if name == "scheduler":
            for r in rs:
                ax.annotate(f"R={r.concurrency}", (r.per_user_tps, r.system_tps), fontsize=7,
                            textcoords="offset points", xytext=(4, -8))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("per-user tokens/s")
    ax.set_ylabel("system tokens/s")
    ax.set_title(title or "Pareto: system vs per-user throughput")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
