"""Calibration plots (matplotlib, Agg backend) and the markdown report."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from .calibration import Calibration, cumulative, reliability_bins
from .rollouts import prefix_survival


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_reliability(confidence, accepted, calibration: Calibration, path, *, observed=None,
                     n_bins: Optional[int] = None, title: str = "") -> Path:
    """Per-position reliability diagrams of cumulative survival, raw vs calibrated."""
    plt = _plt()
    conf = np.asarray(confidence, dtype=np.float64)
    N, g = conf.shape
    n_bins = n_bins or calibration.ece_bins
    surv = prefix_survival(accepted, g)
    raw, cal = cumulative(conf), calibration.survival(conf)
    cols = min(4, g)
    rows = math.ceil(g / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.0 * cols, 3.0 * rows), squeeze=False)
    for k in range(g):
        ax = axes[k // cols][k % cols]
        m = None if observed is None else observed[:, k]
        for vals, lab, st in ((raw, "raw", "o--"), (cal, "STS", "s-")):
            rb = reliability_bins(vals[:, k], surv[:, k], n_bins, m)
            x = np.asarray(rb["mean_confidence"], dtype=float)
            y = np.asarray(rb["frequency"], dtype=float)
            ok = ~np.isnan(x)
            ax.plot(x[ok], y[ok], st, ms=3, label=lab)
        ax.plot([0, 1], [0, 1], color="gray", lw=0.8)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(f"k={k + 1}  T={calibration.temperatures[k]:.2f}", fontsize=9)
        if k % cols == 0:
            ax.set_ylabel("P(accepted ≥ k)")
        if k // cols == rows - 1:
            ax.set_xlabel("Π c_i (i ≤ k)")
        if k == 0:
            ax.legend(fontsize=7)
    for k in range(g, rows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.suptitle(title or "Reliability of cumulative confidence", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_threshold_sweep(sweep_cal: Dict[str, List[float]], path, sweep_raw: Optional[Dict[str, List[float]]] = None,
                         gamma: Optional[int] = None, title: str = "") -> Path:
    """The paper's Fig. 5: verified / accepted / rejected tokens and acceptance rate vs threshold."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    t = sweep_cal["threshold"]
    ax1.plot(t, sweep_cal["verified"], "-", label="verified drafts / step")
    ax1.plot(t, sweep_cal["accepted"], "-", label="accepted (verified) / step")
    ax1.plot(t, sweep_cal["rejected"], "-", label="rejected (verified) / step")
    ax1.plot(t, sweep_cal["tokens_per_step"], ":", label="tokens / step (incl. bonus)")
    if gamma:
        ax1.axhline(gamma, color="gray", lw=0.6)
    ax1.set_xlabel("threshold on calibrated cumulative confidence")
    ax1.set_ylabel("tokens per request-step")
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    ax2.plot(t, sweep_cal["acceptance_rate"], "-", label="acceptance rate (STS)")
    if sweep_raw is not None:
        ax2.plot(sweep_raw["threshold"], sweep_raw["acceptance_rate"], "--", label="acceptance rate (raw)")
    ax2.plot(t, sweep_cal["tokens_per_verified"], ":", label="tokens / target token (STS)")
    ax2.set_xlabel("threshold")
    ax2.set_ylim(0, 1.02)
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3)
    fig.suptitle(title or "Static threshold sweep", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.4f}" if isinstance(x, float) else str(x)


def markdown_report(calibration: Calibration, metrics: Sequence[Dict], *, source: str, synthetic: bool,
                    n_requests: int, heldout: Optional[Sequence[Dict]] = None,
                    sweep: Optional[Dict[str, List[float]]] = None, images: Sequence[str] = ()) -> str:
    lines = ["# Confidence calibration report (Sequential Temperature Scaling)", ""]
    if synthetic:
        lines += ["**SYNTHETIC ROLLOUTS** — these numbers do not describe a trained drafter.", ""]
    lines += [f"- rollouts: `{source}` ({calibration.n_rounds} rounds, {n_requests} requests, γ={calibration.gamma})",
              f"- grid: T ∈ [{calibration.grid.get('min')}, {calibration.grid.get('max')}], "
              f"{calibration.grid.get('size')} values (log-spaced, T=1 included); ECE bins: {calibration.ece_bins}",
              f"- fitted: {calibration.meta.get('fitted_at', '')}", "",
              "## Per position (cumulative survival Π_{i≤k} c_i vs 1[accepted ≥ k], fit set)", "",
              "| k | n | P(acc≥k) | T_k | mean conf raw | mean conf STS | ECE raw | ECE STS | Brier raw | Brier STS "
              "| AUROC raw | AUROC STS | AUROC c_k (cond.) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in metrics:
        lines.append("| " + " | ".join(_fmt(m[k]) for k in (
            "position", "n", "survival_rate", "temperature", "mean_conf_before", "mean_conf_after", "ece_before",
            "ece_after", "brier_before", "brier_after", "auroc_before", "auroc_after", "auroc_conditional")) + " |")
    if heldout:
        lines += ["", "## Held-out requests (fit on the others)", "",
                  "| k | n | ECE raw | ECE STS | Brier raw | Brier STS |", "|---|---|---|---|---|---|"]
        for m in heldout:
            lines.append("| " + " | ".join(_fmt(m[k]) for k in (
                "position", "n", "ece_before", "ece_after", "brier_before", "brier_after")) + " |")
    if sweep:
        lines += ["", "## Static threshold sweep (calibrated cumulative confidence)", "",
                  "| threshold | verified/step | accepted/step | rejected/step | acceptance rate | tokens/step |",
                  "|---|---|---|---|---|---|"]
        for i, t in enumerate(sweep["threshold"]):
            if i % 4 == 0 or i == len(sweep["threshold"]) - 1:
                lines.append(f"| {t:.3f} | {sweep['verified'][i]:.3f} | {sweep['accepted'][i]:.3f} | "
                             f"{sweep['rejected'][i]:.3f} | {_fmt(sweep['acceptance_rate'][i])} | "
                             f"{sweep['tokens_per_step'][i]:.3f} |")
    for img in images:
        lines += ["", f"![{Path(img).stem}]({Path(img).name})"]
    return "\n".join(lines) + "\n"
