"""Confidence calibration: Sequential Temperature Scaling (STS) and calibration metrics.

The drafter's head outputs c_k ≈ P(draft token k survives | tokens 1..k−1 survived).
What the scheduler consumes is the *cumulative* survival a_k = Π_{i≤k} c̃_i, so STS
calibrates the cumulative product, left to right: for k = 1..γ, with T_1..T_{k−1} fixed,

    T_k = argmin_{T ∈ grid} ECE( Π_{i<k} c̃_i · σ(logit(c_k)/T) ,  1[accepted ≥ k] )

where the grid is log-spaced in [temperature_grid_min, temperature_grid_max] and always
contains T = 1 (so calibration never increases the fitted ECE).  A temperature is a
monotone transform of each c_k, so per-position rankings (AUROC of c_k) are unchanged.

All functions take numpy arrays (torch tensors are accepted by `apply_temperatures`).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ..utils.fs import atomic_write
from .rollouts import observed_mask, prefix_survival

CALIBRATION_FILENAME = "calibration.json"
_EPS = 1e-6


# -- transforms ----------------------------------------------------------------------------


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, _EPS, 1.0 - _EPS)
    return np.log(p) - np.log1p(-p)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def apply_temperature(conf, temperature: float):
    """σ(logit(c)/T) (numpy or torch, same type out)."""
    return apply_temperatures(conf, [temperature])


def apply_temperatures(conf, temps: Sequence[float]):
    """Apply per-position temperatures to raw confidences ``conf[..., γ]`` in logit space.

    Positions beyond ``len(temps)`` reuse the last temperature.  Returns the same type
    (numpy array or torch tensor, dtype preserved for floating tensors).
    """
    temps = [float(t) for t in temps]
    if not temps:
        return conf
    if any(t <= 0 for t in temps):
        raise ValueError(f"temperatures must be positive, got {temps}")
    torch = sys.modules.get("torch")  # a tensor input implies torch is imported; never import it here
    if torch is not None:
        if isinstance(conf, torch.Tensor):
            g = conf.shape[-1]
            tt = torch.tensor(_expand(temps, g), dtype=torch.float32, device=conf.device)
            c = conf.float().clamp(_EPS, 1 - _EPS)
            out = torch.sigmoid(torch.logit(c) / tt)
            return out.to(conf.dtype) if conf.is_floating_point() else out
    c = np.asarray(conf, dtype=np.float64)
    g = c.shape[-1]
    return _sigmoid(_logit(c) / np.asarray(_expand(temps, g)))


def _expand(temps: List[float], g: int) -> List[float]:
    return (temps + [temps[-1]] * g)[:g]


def cumulative(conf) -> np.ndarray:
    """Cumulative survival a_k = Π_{i≤k} c_i along the last axis (numpy)."""
    return np.cumprod(np.clip(np.asarray(conf, dtype=np.float64), 0.0, 1.0), axis=-1)


def temperature_grid(tmin: float = 0.25, tmax: float = 4.0, size: int = 64) -> np.ndarray:
    """Log-spaced grid in [tmin, tmax] with T = 1 added (sorted, unique)."""
    if not (0 < tmin <= tmax) or size < 1:
        raise ValueError(f"bad temperature grid min={tmin} max={tmax} size={size}")
    g = np.geomspace(tmin, tmax, size) if size > 1 else np.array([tmin])
    return np.unique(np.concatenate([g, [1.0]]))


# -- metrics -------------------------------------------------------------------------------


def ece(probs, labels, n_bins: int = 15, mask=None) -> float:
    """Expected calibration error, equal-width bins on [0, 1] (weighted |mean p − mean y|)."""
    return float(_ece_grid(np.asarray(probs, dtype=np.float64)[None], np.asarray(labels), n_bins,
                           None if mask is None else np.asarray(mask, bool))[0])


def _ece_grid(probs: np.ndarray, labels: np.ndarray, n_bins: int, mask=None) -> np.ndarray:
    """ECE for each row of ``probs[G, N]`` against the same labels[N] (vectorised over G)."""
    probs = probs.reshape(probs.shape[0], -1)
    y = labels.reshape(-1).astype(np.float64)
    if mask is not None:
        m = mask.reshape(-1)
        probs, y = probs[:, m], y[m]
    n = y.size
    if n == 0:
        return np.full(probs.shape[0], np.nan)
    idx = np.clip((probs * n_bins).astype(np.int64), 0, n_bins - 1)  # [G, N]
    G = probs.shape[0]
    flat = idx + (np.arange(G) * n_bins)[:, None]
    cnt = np.bincount(flat.ravel(), minlength=G * n_bins).reshape(G, n_bins)
    sp = np.bincount(flat.ravel(), weights=probs.ravel(), minlength=G * n_bins).reshape(G, n_bins)
    sy = np.bincount(flat.ravel(), weights=np.broadcast_to(y, probs.shape).ravel(),
                     minlength=G * n_bins).reshape(G, n_bins)
    return np.abs(sp - sy).sum(axis=1) / n


def auroc(scores, labels, mask=None) -> float:
    """Area under the ROC curve via ranks (Mann–Whitney U, ties get average ranks).

    NaN when only one class is present."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(labels).reshape(-1).astype(bool)
    if mask is not None:
        m = np.asarray(mask, bool).reshape(-1)
        s, y = s[m], y[m]
    n_pos = int(y.sum())
    n_neg = int(y.size - n_pos)
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ss = s[order]
    ranks = np.empty(s.size, dtype=np.float64)
    # average ranks over ties (1-based)
    boundaries = np.flatnonzero(np.diff(ss)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [ss.size]])
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def brier(probs, labels, mask=None) -> float:
    p = np.asarray(probs, dtype=np.float64).reshape(-1)
    y = np.asarray(labels).reshape(-1).astype(np.float64)
    if mask is not None:
        m = np.asarray(mask, bool).reshape(-1)
        p, y = p[m], y[m]
    return float(np.mean((p - y) ** 2)) if p.size else float("nan")


def reliability_bins(probs, labels, n_bins: int = 15, mask=None) -> Dict[str, List[float]]:
    """Per-bin mean confidence, observed frequency and count (for reliability diagrams)."""
    p = np.asarray(probs, dtype=np.float64).reshape(-1)
    y = np.asarray(labels).reshape(-1).astype(np.float64)
    if mask is not None:
        m = np.asarray(mask, bool).reshape(-1)
        p, y = p[m], y[m]
    idx = np.clip((p * n_bins).astype(np.int64), 0, n_bins - 1)
    cnt = np.bincount(idx, minlength=n_bins)
    sp = np.bincount(idx, weights=p, minlength=n_bins)
    sy = np.bincount(idx, weights=y, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        return {"edges": np.linspace(0, 1, n_bins + 1).tolist(),
                "mean_confidence": np.where(cnt > 0, sp / np.maximum(cnt, 1), np.nan).tolist(),
                "frequency": np.where(cnt > 0, sy / np.maximum(cnt, 1), np.nan).tolist(),
                "count": cnt.tolist()}


# -- Sequential Temperature Scaling --------------------------------------------------------


@dataclass
class Calibration:
    """Fitted per-position temperatures (stored as ``calibration.json``)."""
    temperatures: List[float]
    gamma: int
    method: str = "sequential_temperature_scaling"
    ece_bins: int = 15
    grid: Dict[str, float] = field(default_factory=dict)
    n_rounds: int = 0
    ece_before: List[float] = field(default_factory=list)   # cumulative, per position
    ece_after: List[float] = field(default_factory=list)
    meta: Dict[str, Any] = field(default_factory=dict)

    def apply(self, conf):
        """Calibrated per-position confidences c̃ (same type as input)."""
        return apply_temperatures(conf, self.temperatures)

    def survival(self, conf) -> np.ndarray:
        """Calibrated cumulative survival a_k = Π_{i≤k} c̃_i (numpy)."""
        c = self.apply(conf)
        if hasattr(c, "detach"):
            c = c.detach().float().cpu().numpy()
        return cumulative(c)

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Calibration":
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def identity(cls, gamma: int) -> "Calibration":
        return cls(temperatures=[1.0] * gamma, gamma=gamma, method="identity")

    def save(self, path: str | os.PathLike) -> Path:
        """Write JSON to ``path`` (a file, or a directory → ``path/calibration.json``)."""
        p = Path(path)
        if p.is_dir() or not p.suffix:
            p = p / CALIBRATION_FILENAME
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(p, json.dumps(self.to_json(), indent=2))
        return p

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Calibration":
        p = Path(path)
        if p.is_dir():
            p = p / CALIBRATION_FILENAME
        return cls.from_json(json.loads(p.read_text()))


def find_calibration(checkpoint_dir: str | os.PathLike | None) -> Optional[Calibration]:
    """``calibration.json`` beside a checkpoint, or None."""
    if not checkpoint_dir:
        return None
    p = Path(checkpoint_dir) / CALIBRATION_FILENAME
    return Calibration.load(p) if p.is_file() else None


def fit_sts(confidence, accepted, *, verified=None, grid: Optional[np.ndarray] = None,
            n_bins: int = 15, tmin: float = 0.25, tmax: float = 4.0, size: int = 64) -> Calibration:
    """Fit Sequential Temperature Scaling on rounds ``confidence[N, γ]``, ``accepted[N]``.

    ``verified[N]`` (default γ) marks censored positions (see `rollouts.observed_mask`).
    Ties in ECE are broken towards T = 1 (smallest |log T|).
    """
    conf = np.asarray(confidence, dtype=np.float64)
    if conf.ndim != 2:
        raise ValueError(f"confidence must be [N, γ], got shape {conf.shape}")
    N, gamma = conf.shape
    acc = np.asarray(accepted).reshape(-1)
    ver = np.full(N, gamma) if verified is None else np.asarray(verified).reshape(-1)
    if grid is None:
        grid = temperature_grid(tmin, tmax, size)
    grid = np.asarray(grid, dtype=np.float64)
    surv = prefix_survival(acc, gamma)
    obs = observed_mask(acc, ver, gamma)
    logits = _logit(conf)
    prev = np.ones(N)                      # Π_{i<k} c̃_i with earlier temperatures fixed
    prev_raw = np.ones(N)
    temps, before, after = [], [], []
    tie = np.abs(np.log(grid))
    for k in range(gamma):
        cand = prev[None, :] * _sigmoid(logits[None, :, k] / grid[:, None])     # [G, N]
        e = _ece_grid(cand, surv[:, k], n_bins, obs[:, k])
        if np.all(np.isnan(e)):
            j = int(np.argmin(tie))        # nothing observed: keep T = 1
        else:
            e = np.where(np.isnan(e), np.inf, e)
            best = e.min()
            j = int(np.flatnonzero(e <= best + 1e-12)[np.argmin(tie[e <= best + 1e-12])])
        T = float(grid[j])
        temps.append(T)
        prev = cand[j]
        prev_raw = prev_raw * conf[:, k]
        before.append(ece(prev_raw, surv[:, k], n_bins, obs[:, k]))
        after.append(ece(prev, surv[:, k], n_bins, obs[:, k]))
    return Calibration(temperatures=temps, gamma=gamma, ece_bins=n_bins,
                       grid={"min": float(grid.min()), "max": float(grid.max()), "size": int(grid.size)},
                       n_rounds=int(N), ece_before=before, ece_after=after,
                       meta={"fitted_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")})


def fit_sts_from_config(arrays, schedule_cfg) -> Calibration:
    return fit_sts(arrays.confidence, arrays.accepted, verified=arrays.verified,
                   n_bins=schedule_cfg.ece_bins, tmin=schedule_cfg.temperature_grid_min,
                   tmax=schedule_cfg.temperature_grid_max, size=schedule_cfg.temperature_grid_size)


# -- reports -------------------------------------------------------------------------------


def calibration_metrics(confidence, accepted, calibration: Calibration, *, verified=None,
                        n_bins: Optional[int] = None) -> List[Dict[str, float]]:
    """Per-position metrics of the *cumulative* survival before/after calibration.

    For each k: base rate P(accepted ≥ k), ECE / Brier / AUROC of Π_{i≤k} c_i (raw) and
    Π_{i≤k} c̃_i (calibrated), and the AUROC of the per-position c_k on rounds where
    1..k−1 survived (the head's own conditional ranking quality).
    """
    conf = np.asarray(confidence, dtype=np.float64)
    N, gamma = conf.shape
    n_bins = n_bins or calibration.ece_bins
    acc = np.asarray(accepted).reshape(-1)
    ver = np.full(N, gamma) if verified is None else np.asarray(verified).reshape(-1)
    surv = prefix_survival(acc, gamma)
    obs = observed_mask(acc, ver, gamma)
    raw = cumulative(conf)
    cal = calibration.survival(conf)
    out = []
    for k in range(gamma):
        m = obs[:, k]
        cond = m & (acc >= k)  # reached position k+1 (1-based): earlier tokens survived
        out.append({
            "position": k + 1, "n": int(m.sum()), "survival_rate": float(surv[m, k].mean()) if m.any() else float("nan"),
            "temperature": float(calibration.temperatures[k]) if k < len(calibration.temperatures) else 1.0,
            "mean_conf_before": float(raw[m, k].mean()) if m.any() else float("nan"),
            "mean_conf_after": float(cal[m, k].mean()) if m.any() else float("nan"),
            "ece_before": ece(raw[:, k], surv[:, k], n_bins, m),
            "ece_after": ece(cal[:, k], surv[:, k], n_bins, m),
            "brier_before": brier(raw[:, k], surv[:, k], m),
            "brier_after": brier(cal[:, k], surv[:, k], m),
            "auroc_before": auroc(raw[:, k], surv[:, k], m),
            "auroc_after": auroc(cal[:, k], surv[:, k], m),
            "auroc_conditional": auroc(conf[:, k], surv[:, k], cond),
        })
    return out


def threshold_sweep(survival, accepted, thresholds: Optional[Sequence[float]] = None) -> Dict[str, List[float]]:
    """Static thresholds on cumulative confidence (the paper's Fig. 5).

    For each threshold t, every round verifies ℓ = max{j : a_j ≥ t} draft tokens (a prefix)
    and keeps min(accepted, ℓ) of them.  Per round averages: ``verified`` draft tokens,
    ``accepted`` (verified and accepted), ``rejected`` (verified but rejected),
    ``acceptance_rate`` = accepted / verified, ``tokens_per_step`` = 1 + accepted
    (the target's correction/bonus token included) and ``tokens_per_verified`` =
    tokens_per_step / (1 + verified) (goodput per token of target batch).
    """
    a = np.asarray(survival, dtype=np.float64)
    acc = np.asarray(accepted).reshape(-1)
    if thresholds is None:
        thresholds = np.linspace(0.0, 1.0, 41)
    res: Dict[str, List[float]] = {k: [] for k in ("threshold", "verified", "accepted", "rejected",
                                                   "acceptance_rate", "tokens_per_step",
                                                   "tokens_per_verified")}
    for t in thresholds:
        ell = threshold_lengths(a, float(t))
        ok = np.minimum(acc, ell)
        v = float(ell.mean())
        res["threshold"].append(float(t))
        res["verified"].append(v)
        res["accepted"].append(float(ok.mean()))
        res["rejected"].append(float((ell - ok).mean()))
        res["acceptance_rate"].append(float(ok.sum() / ell.sum()) if ell.sum() else float("nan"))
        res["tokens_per_step"].append(float(1 + ok.mean()))
        res["tokens_per_verified"].append(float((1 + ok).sum() / (1 + ell).sum()))
    return res


def threshold_lengths(survival, threshold: float) -> np.ndarray:
    """ℓ_r = max{j : a_{r,j} ≥ t} (0 if none); a is non-increasing so this is a prefix."""
    a = np.asarray(survival, dtype=np.float64)
    ok = a >= threshold
    # prefix length: first False position (a is non-increasing, but be safe)
    return np.where(ok.all(axis=-1), a.shape[-1], np.argmin(ok, axis=-1)).astype(np.int64)
