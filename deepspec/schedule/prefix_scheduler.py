"""Confidence-scheduled verification: choose how many draft tokens each request verifies.

Prefix scheduler (DSpark, Alg. 1).  R active requests have calibrated confidences
c_{r,1..γ}; the survival of draft prefix j is a_{r,j} = Π_{i≤j} c_{r,i}.  Every request
always gets its anchor/bonus slot, so B = R tokens and τ = R expected tokens at the start.
Extensions (r, j) are admitted in descending a_{r,j} — the order respects prefixes because
a_{r,·} is non-increasing — while tracking

    B = Σ_r (1 + ℓ_r)                       (target batch in tokens)
    τ = Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j})          (expected tokens produced this step)
    Θ = τ / step_time(B) = τ · SPS(B)        (expected goodput; step_time may add a draft cost)

and the scan stops at the first admission that does not raise Θ.  It never looks past
that item.

Losslessness.  ℓ_r is chosen from draft-side quantities only (the drafter's confidences,
the cost table), before the target sees the draft.  Verifying the prefix
x_1..x_{ℓ_r} with the usual speculative sampling rule — accept x_k with probability
min(1, p/q), on the first rejection resample from norm(max(0, p − q)), and if all ℓ_r
survive sample the bonus token from p at position ℓ_r + 1 — is exact for any ℓ_r fixed
independently of the target's outputs, so the output distribution is the target's.

Policies share one interface the eval loop calls per step (R = 1 in a single-stream loop)::

    policy.lengths(confidences: Tensor[R, γ]) -> list[int]     # raw head outputs in

Each policy applies its `Calibration` (if any) before forming cumulative survival.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, List, Optional, Protocol, Union, runtime_checkable

import numpy as np

from ..config import ConfigError
from .calibration import Calibration, cumulative, find_calibration, threshold_lengths
from .cost_model import load_sps_table
from .profile import SPSTable
from .sps_grid import SPSGrid, cost_at

SPSFn = Callable[[np.ndarray], np.ndarray]


def _as_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    a = np.asarray(x, dtype=np.float64)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2:
        raise ValueError(f"confidences must be [R, γ] (or [γ]), got shape {a.shape}")
    return a


def _step_time_fn(sps: Union[SPSTable, SPSFn], overhead_s: float = 0.0) -> Callable[[np.ndarray], np.ndarray]:
    if hasattr(sps, "step_time"):   # an SPSTable, or one concurrency's slice of an SPSGrid
        def step_time(b):
            return np.asarray(sps.step_time(np.asarray(b, dtype=np.float64)), dtype=np.float64) + overhead_s
        return step_time

    def step_time_fn(b):
        return 1.0 / np.asarray(sps(np.asarray(b, dtype=np.float64)), dtype=np.float64) + overhead_s
    return step_time_fn


@dataclass
class ScheduleResult:
    lengths: np.ndarray          # [R] int, ℓ_r
    batch_tokens: int            # B = Σ (1 + ℓ_r)
    expected_tokens: float       # τ
    throughput: float            # Θ = τ / step_time(B)
    admitted: int                # number of admitted extensions (= Σ ℓ_r)
    examined: int                # items looked at (admitted + the one that stopped the scan)


def admission_order(survival: np.ndarray) -> np.ndarray:
    """Flat indices r·γ + (j−1) in descending a_{r,j}; ties by position, then request."""
    R, g = survival.shape
    r_idx, j_idx = np.divmod(np.arange(R * g), g)
    return np.lexsort((r_idx, j_idx, -survival.reshape(-1)))


def schedule_prefix(survival, sps: Union[SPSTable, SPSFn], *, overhead_s: float = 0.0,
                    max_batch_tokens: Optional[int] = None, max_length: Optional[int] = None) -> ScheduleResult:
    """Greedy prefix scheduling (Alg. 1) on cumulative survival ``survival[R, γ]``.

    ``sps``: an `SPSTable` or a vectorised callable B → steps/s.  ``overhead_s``: a per-step
    cost independent of B (e.g. the draft forward), added to 1/SPS(B).  ``max_batch_tokens``
    caps B (memory); ``max_length`` caps each ℓ_r.
    """
    a = np.clip(_as_numpy(survival), 0.0, 1.0)
    a = np.minimum.accumulate(a, axis=1)  # enforce the prefix property against rounding
    R, g = a.shape
    if max_length is not None:
        g = max(0, min(g, int(max_length)))
        a = a[:, :g]
    step_time = _step_time_fn(sps, overhead_s)
    tau0, B0 = float(R), R
    theta0 = tau0 / float(step_time(B0))
    if R == 0 or g == 0:
        return ScheduleResult(np.zeros(R, np.int64), B0, tau0, theta0, 0, 0)
    order = admission_order(a)
    vals = a.reshape(-1)[order]
    n = order.size
    if max_batch_tokens is not None:
        n = max(0, min(n, int(max_batch_tokens) - R))
    # Θ after admitting the first i+1 items (vectorised; the decision below reads it in order
    # and stops at the first non-improving item, so nothing after that item matters).
    tau = tau0 + np.cumsum(vals[:n])
    B = B0 + np.arange(1, n + 1)
    theta = tau / step_time(B)
    prev = np.concatenate([[theta0], theta[:-1]])
    worse = np.flatnonzero(~(theta > prev))
    k = int(worse[0]) if worse.size else n
    examined = min(n, k + 1)
    lengths = np.bincount(order[:k] // a.shape[1], minlength=R).astype(np.int64)
    if k == 0:
        return ScheduleResult(lengths, B0, tau0, theta0, 0, examined)
    return ScheduleResult(lengths, int(B[k - 1]), float(tau[k - 1]), float(theta[k - 1]), k, examined)


def schedule_prefix_sequential(survival, sps: Union[SPSTable, SPSFn], *, overhead_s: float = 0.0) -> ScheduleResult:
    """Reference loop version of `schedule_prefix` (item by item; used by tests)."""
    a = np.minimum.accumulate(np.clip(_as_numpy(survival), 0.0, 1.0), axis=1)
    R, g = a.shape
    step_time = _step_time_fn(sps, overhead_s)
    B, tau = R, float(R)
    theta = tau / float(step_time(B))
    ell = np.zeros(R, np.int64)
    examined = 0
    for idx in admission_order(a):
        r, j = divmod(int(idx), g)
        examined += 1
        assert ell[r] == j, "admission order broke the prefix structure"
        t2 = tau + a[r, j]
        th2 = t2 / float(step_time(B + 1))
        if not th2 > theta:
            break
        ell[r] += 1
        B, tau, theta = B + 1, t2, th2
    return ScheduleResult(ell, B, tau, theta, int(ell.sum()), examined)


def expected_throughput(survival, lengths, sps: Union[SPSTable, SPSFn], overhead_s: float = 0.0) -> float:
    """Θ(ℓ) = τ(ℓ) / step_time(B(ℓ)) for an arbitrary length vector."""
    a = _as_numpy(survival)
    ell = np.asarray(lengths, dtype=np.int64)
    csum = np.concatenate([np.zeros((a.shape[0], 1)), np.cumsum(a, axis=1)], axis=1)
    tau = float(np.sum(1.0 + csum[np.arange(a.shape[0]), ell]))
    B = int(np.sum(1 + ell))
    return tau / float(_step_time_fn(sps, overhead_s)(B))


def optimal_lengths_bruteforce(survival, sps: Union[SPSTable, SPSFn], overhead_s: float = 0.0):
    """Enumerate all (γ+1)^R length vectors; returns (best lengths, best Θ). Small R·γ only."""
    a = _as_numpy(survival)
    R, g = a.shape
    if (g + 1) ** R > 2_000_000:
        raise ValueError(f"brute force over {(g + 1) ** R} length vectors is too large")
    best, best_th = None, -np.inf
    for ell in itertools.product(range(g + 1), repeat=R):
        th = expected_throughput(a, ell, sps, overhead_s)
        if th > best_th + 1e-12:
            best, best_th = np.array(ell, np.int64), th
    return best, float(best_th)


# -- policies --------------------------------------------------------------------------------


@runtime_checkable
class ConfidencePolicy(Protocol):
    """Chooses ℓ_r (0..γ) per request from raw draft confidences [R, γ]."""
    name: str

    def lengths(self, confidences) -> List[int]:
        ...


class _CalibratedPolicy:
    name = "base"

    def __init__(self, calibration: Optional[Calibration] = None):
        self.calibration = calibration

    def survival(self, confidences) -> np.ndarray:
        c = _as_numpy(confidences)
        if self.calibration is not None:
            c = np.asarray(self.calibration.apply(c), dtype=np.float64)
        return cumulative(c)


class FixedLengthPolicy:
    """Verify the whole draft (ℓ = γ), or ``min(length, γ)`` if ``length`` is set."""

    def __init__(self, length: Optional[int] = None):
        self.length = length
        self.name = "fixed" if length is None else f"fixed{length}"

    def lengths(self, confidences) -> List[int]:
        c = _as_numpy(confidences)
        g = c.shape[1] if self.length is None else min(int(self.length), c.shape[1])
        return [int(g)] * c.shape[0]


class ThresholdPolicy(_CalibratedPolicy):
    """Static threshold on cumulative confidence: ℓ_r = max{j : a_{r,j} ≥ t}."""

    def __init__(self, threshold: float, calibration: Optional[Calibration] = None):
        super().__init__(calibration)
        self.threshold = float(threshold)
        self.name = f"threshold{self.threshold:g}"

    def lengths(self, confidences) -> List[int]:
        return threshold_lengths(self.survival(confidences), self.threshold).tolist()


class PrefixSchedulerPolicy(_CalibratedPolicy):
    """The prefix scheduler (Alg. 1) under an SPS(B) cost table, or an SPS(R, B) grid
    (`SPSGrid`: each step is priced with the curve for its number of requests R)."""

    def __init__(self, sps_table: Union[SPSTable, SPSGrid, SPSFn], calibration: Optional[Calibration] = None,
                 overhead_s: Optional[float] = 0.0, max_batch_tokens: Optional[int] = None, name: str = "scheduler"):
        super().__init__(calibration)
        self.sps_table = sps_table
        # None = not known yet: eval measures it (the draft time per round of its warm-up); 0 until then
        self.overhead_s = None if overhead_s is None else float(overhead_s)
        self.max_batch_tokens = max_batch_tokens
        self.name = name
        self.last: Optional[ScheduleResult] = None

    def lengths(self, confidences) -> List[int]:
        a = self.survival(confidences)
        self.last = schedule_prefix(a, cost_at(self.sps_table, a.shape[0]), overhead_s=self.overhead_s or 0.0,
                                    max_batch_tokens=self.max_batch_tokens)
        return self.last.lengths.tolist()


def verify_lengths(confidences, policy: ConfidencePolicy) -> List[int]:
    """ℓ per request for raw confidences ``[R, γ]`` (or ``[γ]`` → a one-element list)."""
    return [int(x) for x in policy.lengths(confidences)]


def make_policy(kind: str, *, calibration: Optional[Calibration] = None, threshold: Optional[float] = None,
                sps_table: Optional[Union[SPSTable, SPSGrid, SPSFn]] = None, overhead_s: Optional[float] = 0.0,
                max_batch_tokens: Optional[int] = None, length: Optional[int] = None) -> ConfidencePolicy:
    """kind ∈ {"fixed", "threshold", "scheduler"}."""
    if kind == "fixed":
        return FixedLengthPolicy(length)
    if kind == "threshold":
        if threshold is None:
            raise ValueError("schedule.policy=threshold needs schedule.threshold")
        return ThresholdPolicy(threshold, calibration)
    if kind == "scheduler":
        if sps_table is None:
            raise ValueError("scheduler policy needs an SPS table (schedule.sps_table or a target to profile)")
        return PrefixSchedulerPolicy(sps_table, calibration, overhead_s, max_batch_tokens)
    raise ValueError(f"unknown verification policy {kind!r}: choose fixed, threshold or scheduler")


def policy_from_config(cfg, target=None, calibration: Optional[Calibration] = None) -> ConfidencePolicy:
    """The verification policy for eval.

    ``schedule.policy``: "fixed" (default), "threshold" (``schedule.threshold``) or "scheduler" (``schedule.sps_table``, a table or an SPS(R, B) grid, or a profile of
    ``target``; read through its convex hull when ``schedule.sps_convex``).  Calibration:
    the given one, else ``schedule.calibration`` (a JSON path), else
    ``{eval.checkpoint}/calibration.json`` if present, else none (raw confidences).
    """
    sc = cfg.schedule
    kind = sc.policy
    thr = sc.threshold
    if kind != "threshold" and thr is not None:
        raise ConfigError(f"schedule.threshold={thr} is read by schedule.policy=threshold only (the policy is {kind!r})")
    if calibration is None:
        calibration = Calibration.load(sc.calibration) if sc.calibration else find_calibration(cfg.eval.checkpoint)
    table = load_sps_table(cfg, target) if kind == "scheduler" else None
    if table is not None and sc.sps_convex:
        table = table.convexified()
    return make_policy(kind, calibration=calibration, threshold=thr, sps_table=table,
                       overhead_s=sc.draft_overhead_s, max_batch_tokens=sc.max_batch_tokens)
