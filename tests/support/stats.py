"""Goodness-of-fit helpers for the losslessness checks (no scipy needed)."""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

__all__ = ["chi_square_gof", "total_variation"]


def chi_square_gof(observed: Sequence[float], probs: Sequence[float], min_expected: float = 5.0
                   ) -> Tuple[float, int, float]:
    """Pearson χ² goodness of fit of counts ``observed`` against probabilities ``probs``.

    Cells whose expected count is below ``min_expected`` are pooled into one cell
    (so sparse tails do not dominate).  Returns ``(statistic, degrees of freedom, p-value)``;
    the p-value is the χ² survival function ``Q(df/2, stat/2)``."""
    obs = torch.as_tensor(observed, dtype=torch.float64).reshape(-1)
    p = torch.as_tensor(probs, dtype=torch.float64).reshape(-1)
    if obs.shape != p.shape:
        raise ValueError(f"observed {tuple(obs.shape)} and probs {tuple(p.shape)} differ in shape")
    n = obs.sum()
    p = p / p.sum()
    if bool((obs[p <= 0] > 0).any()):
        return float("inf"), int((p > 0).sum()) - 1, 0.0   # an outcome the model says is impossible
    exp = n * p
    big = exp >= min_expected
    o_cells = list(obs[big].tolist())
    e_cells = list(exp[big].tolist())
    if (~big).any():
        o_cells.append(float(obs[~big].sum()))
        e_cells.append(float(exp[~big].sum()))
    o = torch.tensor(o_cells, dtype=torch.float64)
    e = torch.tensor(e_cells, dtype=torch.float64)
    keep = e > 0
    o, e = o[keep], e[keep]
    stat = float(((o - e) ** 2 / e).sum())
    df = int(o.numel()) - 1
    if df <= 0:
        return stat, df, 1.0
    pval = float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))
    return stat, df, pval


def total_variation(observed: Sequence[float], probs: Sequence[float]) -> float:
    """TV distance between the empirical distribution of ``observed`` counts and ``probs``."""
    obs = torch.as_tensor(observed, dtype=torch.float64).reshape(-1)
    p = torch.as_tensor(probs, dtype=torch.float64).reshape(-1)
    return float(0.5 * (obs / obs.sum() - p / p.sum()).abs().sum())
