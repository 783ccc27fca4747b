"""Acceptance and speed metrics of speculative decoding (see docs/metrics.md).

Rounds are dicts or objects with ``accepted`` (draft tokens accepted), ``proposed``
(draft tokens verified, ℓ) and optionally ``drafted`` (γ) and ``confidence``.

- τ (acceptance length) = mean over rounds of ``accepted + 1`` — the bonus/correction
  token included, pooled over all rounds of a benchmark (the paper's τ).
- prefix survival s_k = P(accepted ≥ k) and conditional acceptance
  c_k = P(accepted ≥ k | accepted ≥ k−1) (the paper's Fig. 2), both over the rounds that
  verified at least k draft tokens.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

import numpy as np

from .benchmarks import DOMAINS, domain_of

__all__ = ["acceptance_metrics", "speed_metrics", "macro_average", "cumulative_confidence_points",
           "reliability", "threshold_sweep", "nanmean"]


def _get(r, key, default=None):
    if isinstance(r, Mapping):
        return r.get(key, default)
    return getattr(r, key, default)


def nanmean(xs: Iterable[float]) -> float:
    v = [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(sum(v) / len(v)) if v else float("nan")


def acceptance_metrics(rounds: Sequence[Any], gamma: Optional[int] = None) -> Dict[str, Any]:
    """τ, acceptance rate, prefix survival and conditional acceptance by position."""
    acc = np.array([int(_get(r, "accepted")) for r in rounds], dtype=np.int64)
    ver = np.array([int(_get(r, "proposed", _get(r, "verified", 0))) for r in rounds], dtype=np.int64)
    drf = np.array([int(_get(r, "drafted", _get(r, "proposed", 0)) or 0) for r in rounds], dtype=np.int64)
    n = int(acc.size)
    g = int(gamma if gamma is not None else (max(drf.max(initial=0), ver.max(initial=0)) if n else 0))
    out: Dict[str, Any] = {
        "rounds": n,
        "tau": float((acc + 1).mean()) if n else float("nan"),
        "accepted_per_round": float(acc.mean()) if n else float("nan"),
        "verified_per_round": float((ver + 1).mean()) if n else float("nan"),  # tokens per target forward
        "drafted_per_round": float(drf.mean()) if n else float("nan"),
        "acceptance_rate": float(acc.sum() / ver.sum()) if ver.sum() > 0 else float("nan"),
        "gamma": g,
    }
    surv, cond, counts = [], [], []
    for k in range(1, g + 1):
        elig = ver >= k
        m = int(elig.sum())
        counts.append(m)
        if m == 0:
            surv.append(float("nan"))
            cond.append(float("nan"))
            continue
        surv.append(float((acc[elig] >= k).mean()))
        reached = elig & (acc >= k - 1)
        cond.append(float((acc[reached] >= k).mean()) if reached.any() else float("nan"))
    out["prefix_survival"] = surv
    out["conditional_acceptance"] = cond
    out["position_rounds"] = counts
    return out


def speed_metrics(results: Sequence[Any]) -> Dict[str, float]:
    """Totals over `GenerationResult`s (or dicts with the same keys): tokens/s and the time split."""
    tok = sum(int(_get(r, "num_tokens", 0)) for r in results)
    t_total = sum(float(_get(r, "t_total", 0.0)) for r in results)
    t_prefill = sum(float(_get(r, "t_prefill", 0.0)) for r in results)
    t_draft = sum(float(_get(r, "t_draft", 0.0)) for r in results)
    t_verify = sum(float(_get(r, "t_verify", 0.0)) for r in results)
    t_over = sum(float(_get(r, "t_overhead", 0.0)) for r in results)
    t_decode = max(t_total - t_prefill, 0.0)
    return {"requests": len(results), "generated_tokens": tok, "time_s": t_total, "prefill_s": t_prefill,
            "decode_s": t_decode, "draft_s": t_draft, "verify_s": t_verify, "overhead_s": t_over,
            "tokens_per_s": tok / t_total if t_total > 0 else float("nan"),
            # the prefill token comes from the prompt forward
            "decode_tokens_per_s": (tok - len(results)) / t_decode if t_decode > 0 else float("nan")}


def macro_average(per_benchmark: Mapping[str, Mapping[str, Any]],
                  keys: Sequence[str] = ("tau", "acceptance_rate", "speedup")) -> Dict[str, Any]:
    """Per-domain means over benchmarks (math/code/chat) and the overall mean over benchmarks."""
    out: Dict[str, Any] = {"domains": {}, "overall": {}}
    groups: Dict[str, List[str]] = {}
    for b in per_benchmark:
        groups.setdefault(domain_of(b), []).append(b)
    order = [d for d in DOMAINS if d in groups] + sorted(d for d in groups if d not in DOMAINS)
    for d in order:
        out["domains"][d] = {"benchmarks": groups[d],
                             **{k: nanmean(per_benchmark[b].get(k) for b in groups[d]) for k in keys}}
    out["overall"] = {"benchmarks": list(per_benchmark),
                      **{k: nanmean(m.get(k) for m in per_benchmark.values()) for k in keys}}
    return out


def _calibrated(conf, temperatures: Optional[Sequence[float]]) -> np.ndarray:
    """Per-position confidences clipped into (0, 1), then σ(logit(c_k) / T_k) when temperatures are given
    (positions beyond them reuse the last)."""
    c = np.clip(np.asarray(conf, dtype=np.float64), 1e-6, 1 - 1e-6)
    if temperatures:
        t = np.asarray((list(temperatures) + [temperatures[-1]] * len(c))[: len(c)], dtype=np.float64)
        c = 1.0 / (1.0 + np.exp(-(np.log(c) - np.log1p(-c)) / t))
    return c


def cumulative_confidence_points(rounds: Sequence[Any], temperatures: Optional[Sequence[float]] = None):
    """(a_k, survived_k) pairs for every observed position: ``a_k = Π_{i≤k} c_i`` (calibrated with
    per-position temperatures when given); survival at k is observed if k ≤ ℓ or the chain broke."""
    conf_all, lab_all, pos_all = [], [], []
    for r in rounds:
        c = _get(r, "confidence")
        if not c:
            continue
        c = _calibrated(c, temperatures)
        a = np.cumprod(c)
        acc = int(_get(r, "accepted"))
        ver = int(_get(r, "proposed", _get(r, "verified", len(c))))
        for k in range(1, len(c) + 1):
            if k <= ver or acc < ver:
                conf_all.append(a[k - 1])
                lab_all.append(float(acc >= k))
                pos_all.append(k)
    return np.asarray(conf_all), np.asarray(lab_all), np.asarray(pos_all)


def reliability(conf: np.ndarray, labels: np.ndarray, n_bins: int = 10) -> Dict[str, Any]:
    """Equal-width reliability bins and the expected calibration error."""
    conf = np.asarray(conf, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.float64)
    idx = np.clip((conf * n_bins).astype(np.int64), 0, n_bins - 1)
    cnt = np.bincount(idx, minlength=n_bins)
    sc = np.bincount(idx, weights=conf, minlength=n_bins)
    sy = np.bincount(idx, weights=labels, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mc = np.where(cnt > 0, sc / np.maximum(cnt, 1), np.nan)
        fr = np.where(cnt > 0, sy / np.maximum(cnt, 1), np.nan)
    ece = float(np.abs(sc - sy).sum() / conf.size) if conf.size else float("nan")
    return {"edges": np.linspace(0, 1, n_bins + 1).tolist(), "mean_confidence": mc.tolist(),
            "frequency": fr.tolist(), "count": cnt.tolist(), "ece": ece, "n": int(conf.size)}


def threshold_sweep(rounds: Sequence[Any], thresholds: Optional[Sequence[float]] = None,
                    temperatures: Optional[Sequence[float]] = None) -> Dict[str, List[float]]:
    """Replay logged rounds under a static threshold t on cumulative confidence.

    Each round would verify ℓ(t) = #{k : a_k ≥ t} draft tokens and keep min(accepted, ℓ(t))
    (exact when ℓ(t) ≤ the logged ℓ, a lower bound otherwise: log with the fixed policy)."""
    if thresholds is None:
        thresholds = np.round(np.linspace(0.0, 1.0, 21), 3).tolist()
    rows = []
    for r in rounds:
        c = _get(r, "confidence")
        if not c:
            continue
        rows.append((np.cumprod(_calibrated(c, temperatures)), int(_get(r, "accepted"))))
    out: Dict[str, List[float]] = {"threshold": [], "tau": [], "verified_per_round": [],
                                   "tokens_per_verified": [], "rounds": []}
    for th in thresholds:
        if not rows:
            break
        ell = np.array([int((a >= th).sum()) for a, _ in rows])
        acc = np.minimum(np.array([x for _, x in rows]), ell)
        tau = float((acc + 1).mean())
        ver = float((ell + 1).mean())
        out["threshold"].append(float(th))
        out["tau"].append(tau)
        out["verified_per_round"].append(ver)
        out["tokens_per_verified"].append(tau / ver)
        out["rounds"].append(len(rows))
    return out
