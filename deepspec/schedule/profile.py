"""Target throughput profile SPS(B): target forward steps per second vs batch size in tokens.

A verification step of R requests with draft lengths ℓ_r is one target forward over
B = Σ_r (1 + ℓ_r) new tokens (the anchor/bonus slot plus the verified drafts).  On a GPU,
SPS(B) is flat while the forward is memory-bound and falls roughly as 1/B once it is
compute-bound; the scheduler trades verified tokens against that curve.

Cost table JSON (``SPSTable.save``)::

    {"device": "NVIDIA H100 80GB HBM3", "target": "qwen3_8b", "batch_tokens": [1, 2, 4, ...],
     "steps_per_second": [71.3, 71.0, 70.8, ...], "meta": {...}}

Interpolation (`SPSTable.sps`): the step time 1/SPS is interpolated piecewise linearly in B
between measured points (time is close to affine in B within each regime), after a running
maximum that makes it non-decreasing (measurement noise could otherwise create bumps the
greedy scheduler would chase).  Below the smallest measured B the first value is used (a
smaller batch is not slower, so this is conservative); above the largest, time grows
linearly with slope max(t_max/B_max, last segment slope) — at least constant tokens/s, the
compute-bound regime, conservative if the device was still memory-bound at B_max.

``convex=True`` (`SPSTable.convexified()`) replaces the step-time curve by its lower convex
hull.  With a convex non-decreasing step time and τ concave along the scheduler's admission
order, Θ = τ/t(B) is unimodal along that order, so the greedy stop of the prefix scheduler
is the optimum over all length vectors.  Raw CPU measurements under load are often
non-convex (e.g. a cache cliff); use the convexified table for decisions.
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..utils.fs import atomic_write


@dataclass
class SPSTable:
    batch_tokens: List[int]
    steps_per_second: List[float]
    device: str = "unknown"
    target: str = "unknown"
    meta: Dict[str, Any] = field(default_factory=dict)
    convex: bool = False

    def __post_init__(self):
        if len(self.batch_tokens) != len(self.steps_per_second) or not self.batch_tokens:
            raise ValueError("SPS table: batch_tokens and steps_per_second must be non-empty and equally long")
        order = np.argsort(np.asarray(self.batch_tokens, dtype=np.float64), kind="stable")
        self.batch_tokens = [int(self.batch_tokens[i]) for i in order]
        self.steps_per_second = [float(self.steps_per_second[i]) for i in order]
        if len(set(self.batch_tokens)) != len(self.batch_tokens):
            raise ValueError(f"SPS table: duplicate batch sizes in {self.batch_tokens}")
        if any(b < 1 for b in self.batch_tokens) or any(not s > 0 for s in self.steps_per_second):
            raise ValueError("SPS table: batch sizes must be ≥ 1 and steps/s > 0")
        x = np.asarray(self.batch_tokens, dtype=np.float64)
        t = np.maximum.accumulate(1.0 / np.asarray(self.steps_per_second, dtype=np.float64))
        if self.convex:
            t = _lower_hull(x, t)
        self._x, self._t = x, t
        last = (t[-1] - t[-2]) / (x[-1] - x[-2]) if x.size > 1 else 0.0
        self._slope = max(t[-1] / x[-1], last)

    # -- lookup ------------------------------------------------------------------------
    def step_time(self, batch_tokens):
        """Seconds per target forward of B tokens (scalar → float, array → array)."""
        b = np.asarray(batch_tokens, dtype=np.float64)
        x, t = self._x, self._t
        out = np.interp(b, x, t)  # clamps to t[0] below x[0]
        above = b > x[-1]
        if np.any(above):
            out = np.where(above, t[-1] + self._slope * (b - x[-1]), out)
        return float(out) if np.ndim(out) == 0 else out

    def sps(self, batch_tokens):
        """SPS at B tokens (scalar → float, array → array)."""
        t = self.step_time(batch_tokens)
        return 1.0 / t if np.ndim(t) == 0 else 1.0 / np.asarray(t)

    __call__ = sps

    def convexified(self) -> "SPSTable":
        """The same measurements read through the lower convex hull of the step time."""
        return SPSTable(list(self.batch_tokens), list(self.steps_per_second), self.device, self.target,
                        dict(self.meta), convex=True)

    def tokens_per_second(self, batch_tokens):
        return np.asarray(batch_tokens, dtype=np.float64) * self.sps(batch_tokens)

    # -- I/O ---------------------------------------------------------------------------
    def to_json(self) -> Dict[str, Any]:
        d = asdict(self)
        return {"device": d["device"], "target": d["target"], "batch_tokens": d["batch_tokens"],
                "steps_per_second": d["steps_per_second"], "convex": d["convex"], "meta": d["meta"]}

    def save(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(p, json.dumps(self.to_json(), indent=2))
        return p

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "SPSTable":
        return cls(batch_tokens=[int(b) for b in d["batch_tokens"]],
                   steps_per_second=[float(s) for s in d["steps_per_second"]],
                   device=str(d.get("device", "unknown")), target=str(d.get("target", "unknown")),
                   meta=dict(d.get("meta") or {}), convex=bool(d.get("convex", False)))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SPSTable":
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a valid SPS table: {e}") from e


def _lower_hull(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Values at x of the greatest convex minorant of the points (x, t) (monotone chain)."""
    hull: List[int] = []
    for i in range(x.size):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # drop b if it lies on or above the segment a→i
            if (t[b] - t[a]) * (x[i] - x[a]) >= (t[i] - t[a]) * (x[b] - x[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    return np.interp(x, x[hull], t[hull])


def synthetic_gpu_table(base_sps: float = 80.0, knee_tokens: float = 256.0, sharpness: float = 4.0,
                        max_tokens: int = 8192) -> SPSTable:
    """A GPU-like SPS(B): flat (memory-bound) up to a knee, then ≈ 1/B (compute-bound).

    step_time(B) = (1/base_sps) · (1 + (B/knee)^p)^(1/p).  The defaults mimic an ~8B
    target in bf16 on one H100-class GPU (≈12.5 ms per forward while memory-bound, knee
    at a few hundred tokens).  SYNTHETIC: not a measurement.
    """
    bs = sorted({int(b) for b in np.unique(np.round(np.geomspace(1, max_tokens, 40)))})
    t = (1.0 / base_sps) * (1.0 + (np.asarray(bs, dtype=np.float64) / knee_tokens) ** sharpness) ** (1.0 / sharpness)
    return SPSTable(batch_tokens=bs, steps_per_second=(1.0 / t).tolist(), device="synthetic-gpu",
                    target="synthetic", meta={"synthetic": True, "base_sps": base_sps,
                                              "knee_tokens": knee_tokens, "sharpness": sharpness})


def constant_table(sps: float = 1.0) -> SPSTable:
    """SPS independent of B (then the best policy verifies everything)."""
    return SPSTable(batch_tokens=[1, 1 << 30], steps_per_second=[sps, sps], device="constant", target="none",
                    meta={"synthetic": True})


# -- measurement -----------------------------------------------------------------------------


def device_name(device) -> str:
    import torch
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"{dev.type}:{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def _sync(device) -> None:
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def request_shape(B: int, tokens_per_request: int, requests: Optional[int]) -> Tuple[int, int]:
    """[R, t] new tokens for B batch tokens: R fixed (``requests``), or t = min(tokens per request, B)."""
    if requests:
        return int(requests), max(1, math.ceil(B / int(requests)))
    t = max(1, min(int(tokens_per_request), B))
    return math.ceil(B / t), t


def _time_steps(target, rand, shape, cache, base: int, warmup: int, repeats: int) -> List[float]:
    """Seconds of ``repeats`` timed ``target.decode`` steps of ``shape`` new tokens (after ``warmup``), the
    cache cropped back to ``base`` tokens after each."""
    dev, times = target.device, []
    for i in range(warmup + repeats):
        ids = rand(shape)
        _sync(dev)
        t0 = time.perf_counter()
        out = target.decode(ids, past_key_values=cache)
        _sync(dev)
        dt = time.perf_counter() - t0
        if cache is None:
            del out
        else:
            target.rollback(cache, base)     # the target's rollback: recurrent layers too
        if i >= warmup:
            times.append(dt)
    return times


def profile_sps(target, batch_sizes: Sequence[int], context_len: int = 256, repeats: int = 5,
                mode: str = "requests", tokens_per_request: int = 8, warmup: int = 1,
                seed: int = 0, requests: Optional[int] = None,
                on_size: Optional[Callable[[int], None]] = None) -> SPSTable:
    """Measure SPS(B) of ``target.decode`` on the target's device.

    mode="requests" (default, what serving does): B tokens as R requests × (1+ℓ) tokens,
    1+ℓ = min(tokens_per_request, B) and R = ceil(B / (1+ℓ)); a step is ``target.decode`` of
    ``[R, 1+ℓ]`` new tokens over R cached contexts of ``context_len`` tokens each (prefilled
    untimed, cropped back after every step).  Attention work is linear in B, as in a real
    verification batch; memory is R·context_len KV entries.  The table records the actual
    R·(1+ℓ) tokens.  With ``requests=R`` the concurrency is fixed instead: B tokens as
    ``[R, ceil(B/R)]`` — the table a server running R requests sees, where the per-request
    cost (R KV caches read every step) does not change with B.

    mode="flat": one sequence with ``context_len`` cached tokens and B new tokens as
    ``[1, B]``.  Cheaper (one context), but the B new tokens attend to each other causally,
    so attention grows as B² — an overestimate for large B on small models.

    SPS = 1 / median over ``repeats`` timed steps (after ``warmup`` untimed ones); the
    prefill of the context is not timed.  ``on_size(B)`` is called after each size (progress).
    """
    import torch
    if mode not in ("flat", "requests"):
        raise ValueError(f"profile mode {mode!r}: choose 'flat' or 'requests'")
    dev = target.device
    gen = torch.Generator().manual_seed(seed)
    V = int(target.vocab_size)

    def rand(shape):
        return torch.randint(0, V, shape, generator=gen).to(dev)

    measured_b, sps, times_all = [], [], []
    cache = None
    if mode == "flat" and context_len > 0:
        cache = target.decode(rand((1, context_len))).past_key_values
    for B in sorted({int(b) for b in batch_sizes}):
        if B < 1:
            raise ValueError(f"batch size {B} < 1")
        shape = (1, B) if mode == "flat" else request_shape(B, tokens_per_request, requests)
        step_cache = cache
        if mode != "flat":
            step_cache = target.decode(rand((shape[0], context_len))).past_key_values if context_len > 0 else None
        times = _time_steps(target, rand, shape, step_cache, context_len, warmup, repeats)
        med = statistics.median(times)
        measured_b.append(shape[0] * shape[1])
        sps.append(1.0 / med)
        times_all.append(times)
        if on_size is not None:
            on_size(B)
    # 'requests' may map two requested sizes to the same token count: keep the first.
    uniq: Dict[int, float] = {}
    for b, s in zip(measured_b, sps):
        uniq.setdefault(b, s)
    name = getattr(target, "name", "target")
    return SPSTable(batch_tokens=list(uniq), steps_per_second=list(uniq.values()), device=device_name(dev),
                    target=str(name),
                    meta={"mode": mode, "context_len": context_len, "repeats": repeats, "warmup": warmup,
                          "tokens_per_request": tokens_per_request if mode == "requests" and not requests else None,
                          "requests": int(requests) if mode == "requests" and requests else None,
                          "dtype": str(getattr(target, "dtype", "")),
                          "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "times_s": times_all})

