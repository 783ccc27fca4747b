"""SPS(R, B): one step-time table per concurrency R, for targets whose cost is not a function of B alone.

Paper Alg. 1 prices a verification step by its batch in tokens, B = Σ_r (1 + ℓ_r).  That holds
on a GPU while the forward is memory-bound on the weights.  It does not hold where the R
requests' KV caches dominate (long contexts, CPUs): 16 tokens as [2 × 8] and as [8 × 2] cost
different amounts.  An `SPSGrid` holds one `SPSTable` per measured R, each profiled at that
fixed concurrency (`profile_sps(target, sizes, requests=R)`), and prices a step of R requests
with the table for R.

Between two measured concurrencies R₀ < R < R₁ the step time is interpolated linearly in
log R:  t_R(B) = (1 − w)·t_{R₀}(B) + w·t_{R₁}(B),  w = log(R/R₀) / log(R₁/R₀).  Outside the
measured range the nearest table is used, which is optimistic above the largest R (more KV
caches than were timed): profile the concurrencies you serve.

Grid JSON (``SPSGrid.save``)::

    {"kind": "sps_grid", "device": "...", "target": "...",
     "tables": [<SPSTable JSON with meta.requests = R>, ...]}

`load_cost_model` reads either a single table or a grid; every scheduler entry point
(`PrefixSchedulerPolicy`, `simulate`, `schedule.sps_table`) accepts both.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Union

import numpy as np

from ..utils.fs import atomic_write
from .profile import SPSTable, profile_sps

log = logging.getLogger(__name__)


@dataclass
class _Blend:
    """The step-time curve at one concurrency R, blended from the two bracketing tables."""
    lo: SPSTable
    hi: SPSTable
    w: float

    def step_time(self, batch_tokens):
        t = (1.0 - self.w) * np.asarray(self.lo.step_time(batch_tokens), dtype=np.float64) \
            + self.w * np.asarray(self.hi.step_time(batch_tokens), dtype=np.float64)
        return float(t) if np.ndim(t) == 0 else t

    def sps(self, batch_tokens):
        t = self.step_time(batch_tokens)
        return 1.0 / t if np.ndim(t) == 0 else 1.0 / np.asarray(t)


@dataclass
class SPSGrid:
    tables: Dict[int, SPSTable]
    device: str = "unknown"
    target: str = "unknown"
    meta: Dict[str, Any] = field(default_factory=dict)
    _warned: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.tables:
            raise ValueError("SPS grid: no tables")
        bad = [r for r in self.tables if int(r) < 1]
        if bad:
            raise ValueError(f"SPS grid: concurrencies must be ≥ 1, got {bad}")
        self.tables = {int(r): self.tables[r] for r in sorted(self.tables, key=int)}

    @property
    def requests(self) -> list:
        return list(self.tables)

    def at_requests(self, requests: int):
        """The cost curve (an object with ``step_time(B)`` and ``sps(B)``) for R concurrent requests."""
        R = int(requests)
        rs = self.requests
        if R in self.tables:
            return self.tables[R]
        if R < rs[0] or R > rs[-1]:
            if R > rs[-1] and not self._warned:
                log.warning("SPS grid: R=%d is above the largest profiled concurrency %d; using its table "
                            "(optimistic: more KV caches than were timed)", R, rs[-1])
                self._warned = True
            return self.tables[rs[0] if R < rs[0] else rs[-1]]
        i = int(np.searchsorted(rs, R))
        r0, r1 = rs[i - 1], rs[i]
        return _Blend(self.tables[r0], self.tables[r1], math.log(R / r0) / math.log(r1 / r0))

    def convexified(self) -> "SPSGrid":
        return SPSGrid({r: t.convexified() for r, t in self.tables.items()}, self.device, self.target, dict(self.meta))

    # -- I/O ---------------------------------------------------------------------------
    def to_json(self) -> Dict[str, Any]:
        tables = []
        for r, t in self.tables.items():
            d = t.to_json()
            d["meta"] = {**d["meta"], "requests": r}
            tables.append(d)
        return {"kind": "sps_grid", "device": self.device, "target": self.target, "meta": self.meta,
                "tables": tables}

    def save(self, path: Union[str, os.PathLike]) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(p, json.dumps(self.to_json(), indent=2))
        return p

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "SPSGrid":
        tables: Dict[int, SPSTable] = {}
        for i, td in enumerate(d["tables"]):
            r = (td.get("meta") or {}).get("requests")
            if r is None:
                raise ValueError(f"tables[{i}]: meta.requests (the concurrency it was profiled at) is missing")
            if int(r) in tables:
                raise ValueError(f"tables[{i}]: concurrency {r} appears twice")
            tables[int(r)] = SPSTable.from_json(td)
        return cls(tables, device=str(d.get("device", "unknown")), target=str(d.get("target", "unknown")),
                   meta=dict(d.get("meta") or {}))


CostModel = Union[SPSTable, SPSGrid]


def load_cost_model(path: Union[str, os.PathLike]) -> CostModel:
    """An SPS table or an SPS grid from JSON (a grid has ``"tables"``)."""
    try:
        d = json.loads(Path(path).read_text())
        return SPSGrid.from_json(d) if isinstance(d, dict) and "tables" in d else SPSTable.from_json(d)
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: not a valid SPS table or grid: {e}") from e


def cost_at(cost: Any, requests: int):
    """The step-time curve for R requests: a grid's slice, or the object itself (a table, a callable)."""
    return cost.at_requests(requests) if isinstance(cost, SPSGrid) else cost


def profile_sps_grid(target, requests: Sequence[int], tokens_per_request: int, context_len: int = 256,
                     repeats: int = 5, warmup: int = 1, seed: int = 0,
                     on_size: Optional[Callable[[int], None]] = None) -> SPSGrid:
    """Profile one fixed-concurrency table per R, each over B = R·t for t = 1..tokens_per_request
    (every verification batch R requests can form when each verifies 0..γ drafts, 1+γ = tokens_per_request)."""
    rs = sorted({int(r) for r in requests})
    if not rs or rs[0] < 1:
        raise ValueError(f"profile requests must be ≥ 1, got {list(requests)}")
    tables = {}
    for R in rs:
        tables[R] = profile_sps(target, [R * t for t in range(1, int(tokens_per_request) + 1)],
                                context_len=context_len, repeats=repeats, warmup=warmup, seed=seed, requests=R,
                                on_size=on_size)
    first = tables[rs[0]]
    return SPSGrid(tables, device=first.device, target=first.target,
                   meta={"context_len": context_len, "repeats": repeats, "tokens_per_request": tokens_per_request})
