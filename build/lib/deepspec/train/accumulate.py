"""Per-step statistics: sums over a rank's micro-batches, then means over every rank.

`Accumulator` collects loss, tokens and each metric the drafter returns (NaN-aware: a
non-finite metric is counted as bad, not summed); `metric_keys` agrees on one key order
across ranks and `reduce_stats` averages everything with a single all-reduce.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

from .distributed import DistEnv, all_gather_object, all_reduce_


class Accumulator:
    """Per-rank sums over micro-batches: loss, tokens, and each metric (NaN-aware)."""

    def __init__(self):
        self.n = 0
        self._loss: List[torch.Tensor] = []
        self._tokens: List[torch.Tensor] = []
        self.metrics: Dict[str, tuple] = {}
        self.bad: Dict[str, int] = {}

    def add(self, out, tokens) -> None:
        self.n += 1
        self._loss.append(out["loss"].detach().float())
        self._tokens.append(torch.as_tensor(tokens))
        for k, v in (out.get("metrics") or {}).items():
            v = float(v)
            s, c = self.metrics.get(k, (0.0, 0))
            if math.isfinite(v):
                self.metrics[k] = (s + v, c + 1)
            else:
                self.metrics.setdefault(k, (s, c))
                if "/" not in k:
                    self.bad[k] = self.bad.get(k, 0) + 1

    def loss_sum(self) -> float:
        return float(torch.stack(self._loss).sum()) if self._loss else 0.0

    def token_sum(self) -> float:
        return float(torch.stack([t.cpu() for t in self._tokens]).sum()) if self._tokens else 0.0


def metric_keys(acc: Accumulator, env: DistEnv) -> List[str]:
    """The union of every rank's metric names, in the same (sorted) order on every rank."""
    keys = set()
    for ks in all_gather_object(sorted(acc.metrics), env):
        keys.update(ks)
    return sorted(keys)


def reduce_stats(acc: Accumulator, keys: List[str], env: DistEnv, stop: Optional[int]) -> Dict:
    """Means over every micro-batch of every rank (one all-reduce)."""
    vec = torch.zeros(4 + 2 * len(keys), dtype=torch.float64)
    vec[0], vec[1], vec[2], vec[3] = acc.loss_sum(), acc.n, acc.token_sum(), float(bool(stop))
    for i, k in enumerate(keys):
        s, c = acc.metrics.get(k, (0.0, 0))
        vec[4 + 2 * i], vec[5 + 2 * i] = s, c
    dev = env.device if env.backend == "nccl" else torch.device("cpu")
    vec = all_reduce_(vec.to(dev), env).cpu()
    n = max(vec[1].item(), 1.0)
    metrics = {k: (vec[4 + 2 * i].item() / vec[5 + 2 * i].item() if vec[5 + 2 * i] > 0 else math.nan)
               for i, k in enumerate(keys)}
    metrics.pop("loss", None)
    return {"loss": vec[0].item() / n, "tokens": int(vec[2].item()), "stop": vec[3].item() > 0,
            "metrics": metrics, "nonfinite": set(acc.bad)}
