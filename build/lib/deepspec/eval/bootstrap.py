"""95% percentile-bootstrap intervals over requests for τ and the speedup (see docs/metrics.md).

A benchmark's τ is a ratio of sums: Σ over its rounds of (accepted + 1) ÷ its number of rounds
(`deepspec.eval.metrics.acceptance_metrics`), and its speedup is one too: (Σ spec tokens ÷ Σ spec
seconds) ÷ (Σ plain tokens ÷ Σ plain seconds).  Rounds of one request are not independent, so the
resampling unit is the **request**: draw a benchmark's n requests with replacement, add up their
per-request sums and recompute the ratio; repeat ``resamples`` times; the interval is the 2.5th and
97.5th percentile of the draws.

The macro numbers (a domain's, the overall) are unweighted means over benchmarks, so their interval
comes from a **stratified** bootstrap: every resample draws each benchmark's requests independently
from that benchmark alone and averages the per-benchmark ratios as `metrics.macro_average` does.

Each benchmark draws from its own generator, seeded from (seed, benchmark name): its interval does
not depend on which other benchmarks were evaluated or in which order.  A resample with no round at
all (possible only when some requests ended before their first round) has no τ and is left out of
the percentiles, as `metrics.nanmean` leaves a benchmark without τ out of a macro average.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from .benchmarks import domain_of

__all__ = ["LEVEL", "RequestTotals", "request_totals", "resample_indices", "ratio_draws", "percentile_interval",
           "benchmark_rng", "benchmark_draws", "macro_draws", "benchmark_interval", "bootstrap_intervals"]

LEVEL = 0.95
_CHUNK = 1 << 22          # index entries per block of resamples (bounds memory for large benchmarks)


@dataclass(frozen=True)
class RequestTotals:
    """Per-request sums whose ratios are a benchmark's statistics (one entry per request)."""
    tau_tokens: np.ndarray                  # Σ over the request's rounds of (accepted + 1)
    rounds: np.ndarray                      # its verification rounds
    spec_tokens: np.ndarray                 # generated tokens of the speculative run
    spec_time: np.ndarray                   # its wall seconds
    base_tokens: Optional[np.ndarray] = None   # the plain-decoding baseline (None when not measured
    base_time: Optional[np.ndarray] = None     # for every request)

    @property
    def n(self) -> int:
        return int(self.rounds.size)


def request_totals(requests: Sequence[Any]) -> RequestTotals:
    """`RequestTotals` of records with ``.spec`` (a `GenerationResult`) and ``.baseline`` (one or None)."""
    specs = [q.spec for q in requests]
    bases = [q.baseline for q in requests]
    have_base = bool(bases) and all(b is not None for b in bases)
    f = np.float64
    return RequestTotals(
        tau_tokens=np.array([sum(r.accepted + 1 for r in s.rounds) for s in specs], dtype=f),
        rounds=np.array([len(s.rounds) for s in specs], dtype=f),
        spec_tokens=np.array([s.num_tokens for s in specs], dtype=f),
        spec_time=np.array([s.t_total for s in specs], dtype=f),
        base_tokens=np.array([b.num_tokens for b in bases], dtype=f) if have_base else None,
        base_time=np.array([b.t_total for b in bases], dtype=f) if have_base else None)


def resample_indices(n: int, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """``[resamples, n]`` request indices drawn uniformly with replacement."""
    return rng.integers(0, n, size=(resamples, n))


def _sums(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    return x[idx].sum(axis=1)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1.0), np.nan)


def ratio_draws(num: np.ndarray, den: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Σ num[idx_b] ÷ Σ den[idx_b] for every resample b (NaN where the denominator sums to 0)."""
    return _div(_sums(np.asarray(num, dtype=np.float64), idx), _sums(np.asarray(den, dtype=np.float64), idx))


def percentile_interval(draws: np.ndarray, level: float = LEVEL) -> Optional[List[float]]:
    """``[lo, hi]``: the (1 − level)/2 and (1 + level)/2 quantiles of the finite draws (None if none)."""
    d = np.asarray(draws, dtype=np.float64)
    d = d[np.isfinite(d)]
    if d.size == 0:
        return None
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(d, [a, 1.0 - a])
    return [float(lo), float(hi)]


def benchmark_rng(seed: int, key: str) -> np.random.Generator:
    """The generator of one benchmark's resamples, seeded from (seed, key): the same draws whatever else
    is resampled (a paired comparison of two evals draws its indices from it too)."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(key.encode())])


def benchmark_draws(t: RequestTotals, resamples: int, rng: np.random.Generator) -> Dict[str, np.ndarray]:
    """``{"tau": [resamples], "speedup": [resamples]}`` (speedup only with a baseline for every request);
    both statistics of a resample come from the same drawn requests."""
    out: Dict[str, List[np.ndarray]] = {"tau": []}
    if t.base_tokens is not None:
        out["speedup"] = []
    step = max(1, _CHUNK // max(t.n, 1))
    for start in range(0, resamples, step):
        idx = resample_indices(t.n, min(step, resamples - start), rng)
        out["tau"].append(ratio_draws(t.tau_tokens, t.rounds, idx))
        if t.base_tokens is not None:
            out["speedup"].append(_div(ratio_draws(t.spec_tokens, t.spec_time, idx),
                                       ratio_draws(t.base_tokens, t.base_time, idx)))
    return {k: np.concatenate(v) if v else np.empty(0) for k, v in out.items()}


def macro_draws(draws: Sequence[np.ndarray]) -> np.ndarray:
    """Per-resample mean over benchmarks, ignoring a benchmark without a value (as `metrics.nanmean`)."""
    m = np.stack(draws)
    cnt = np.isfinite(m).sum(axis=0)
    tot = np.where(np.isfinite(m), m, 0.0).sum(axis=0)
    return _div(tot, cnt.astype(np.float64))


def _entry(draws: Mapping[str, np.ndarray], requests: int, level: float) -> Dict[str, Any]:
    e: Dict[str, Any] = {"requests": int(requests)}
    for k, d in draws.items():
        e[f"{k}_ci95"] = percentile_interval(d, level)
    return e


def benchmark_interval(t: RequestTotals, resamples: int, seed: int = 0, key: str = "",
                       level: float = LEVEL) -> Dict[str, Any]:
    """``{"requests", "tau_ci95", ["speedup_ci95"]}`` of one set of requests (generator seeded from
    (seed, key)); an empty dict when ``resamples`` is 0 or there is no request."""
    if resamples <= 0 or t.n == 0:
        return {}
    return _entry(benchmark_draws(t, int(resamples), benchmark_rng(seed, key)), t.n, level)


def bootstrap_intervals(per_benchmark: Mapping[str, RequestTotals], resamples: int, seed: int = 0,
                        level: float = LEVEL) -> Dict[str, Any]:
    """Intervals per benchmark, per domain and overall (stratified over benchmarks).

    Returns ``{"benchmarks": {name: {"requests", "tau_ci95", ["speedup_ci95"]}}, "domains": {d: ...},
    "overall": {...}}`` with ``[lo, hi]`` lists (None where no resample had a value); an empty dict
    when ``resamples`` is 0 or there is no request."""
    benches = {b: t for b, t in per_benchmark.items() if t.n > 0}
    if resamples <= 0 or not benches:
        return {}
    draws = {b: benchmark_draws(t, int(resamples), benchmark_rng(seed, b)) for b, t in benches.items()}
    out: Dict[str, Any] = {"benchmarks": {b: _entry(draws[b], benches[b].n, level) for b in benches},
                           "domains": {}, "overall": {}}

    def group(names: Sequence[str]) -> Dict[str, Any]:
        keys = [k for k in ("tau", "speedup") if any(k in draws[b] for b in names)]
        macro = {k: macro_draws([draws[b][k] if k in draws[b] else np.full(int(resamples), np.nan) for b in names])
                 for k in keys}
        return _entry(macro, sum(benches[b].n for b in names), level)

    groups: Dict[str, List[str]] = {}
    for b in benches:
        groups.setdefault(domain_of(b), []).append(b)
    out["domains"] = {d: group(names) for d, names in groups.items()}
    out["overall"] = group(list(benches))
    return out
