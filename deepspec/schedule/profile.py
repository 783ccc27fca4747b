"""Target throughput profile SPS(B): target forward steps per second vs batch size in tokens.

A verification step of R requests with draft lengths ℓ_r is one target forward over
B = Σ_r (1 + ℓ_r) new tokens (the anchor/bonus slot plus the verified drafts).  On a GPU,
SPS(B) is flat while the forward is memory-bound and falls roughly as 1/B once it is
compute-bound; the scheduler trades verified tokens against that curve.

Cost table JSON (``SPSTable.save``)::

    {"device": "NVIDIA H100 80GB HBM3", "target": "qwen3_8b", "batch_tokens": [1, 2, 4, ...],
     "steps_per_second": [71.3, 71.0, 70.8, ...], "meta": {...}}

Interpolation (`SPSTable.sps`): piecewise linear in B between measured points, after a
running minimum that makes the curve non-increasing (measurement noise could otherwise
create bumps the greedy scheduler would chase).  Below the smallest measured B the first
value is used (SPS cannot be lower for a smaller batch, so this is conservative); above the
largest, constant tokens/s is assumed, SPS(B) = SPS(B_max)·B_max/B (the compute-bound
regime; conservative if the device was still memory-bound at B_max).
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
from typing import Any, Dict, List, Optional, Sequence

import numpy as np


@dataclass
class SPSTable:
    batch_tokens: List[int]
    steps_per_second: List[float]
    device: str = "unknown"
    target: str = "unknown"
    meta: Dict[str, Any] = field(default_factory=dict)

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
        self._x = np.asarray(self.batch_tokens, dtype=np.float64)
        self._y = np.minimum.accumulate(np.asarray(self.steps_per_second, dtype=np.float64))

    # -- lookup ------------------------------------------------------------------------
    def sps(self, batch_tokens):
        """SPS at B tokens (scalar → float, array → array)."""
        b = np.asarray(batch_tokens, dtype=np.float64)
        x, y = self._x, self._y
        out = np.interp(b, x, y)  # clamps to y[0] below x[0]
        above = b > x[-1]
        if np.any(above):
            out = np.where(above, y[-1] * x[-1] / np.maximum(b, 1e-9), out)
        return float(out) if out.ndim == 0 else out

    __call__ = sps

    def step_time(self, batch_tokens):
        """Seconds per target forward of B tokens (1 / SPS)."""
        s = self.sps(batch_tokens)
        return 1.0 / s

    def tokens_per_second(self, batch_tokens):
        return np.asarray(batch_tokens, dtype=np.float64) * self.sps(batch_tokens)

    # -- I/O ---------------------------------------------------------------------------
    def to_json(self) -> Dict[str, Any]:
        d = asdict(self)
        return {"device": d["device"], "target": d["target"], "batch_tokens": d["batch_tokens"],
                "steps_per_second": d["steps_per_second"], "meta": d["meta"]}

    def save(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2))
        os.replace(tmp, p)
        return p

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "SPSTable":
        return cls(batch_tokens=[int(b) for b in d["batch_tokens"]],
                   steps_per_second=[float(s) for s in d["steps_per_second"]],
                   device=str(d.get("device", "unknown")), target=str(d.get("target", "unknown")),
                   meta=dict(d.get("meta") or {}))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SPSTable":
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a valid SPS table: {e}") from e


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
    return SPSTable(batch_tokens=[1], steps_per_second=[sps], device="constant", target="none",
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


def _rollback(cache, length: int) -> None:
    """Crop a DynamicCache back to ``length`` tokens (negative crop works on old and new HF)."""
    n = int(cache.get_seq_length()) - int(length)
    if n > 0:
        cache.crop(-n)


def profile_sps(target, batch_sizes: Sequence[int], context_len: int = 256, repeats: int = 5,
                mode: str = "flat", tokens_per_request: int = 8, warmup: int = 1,
                seed: int = 0) -> SPSTable:
    """Measure SPS(B) of ``target.decode`` on the target's device.

    mode="flat" (default): one sequence with ``context_len`` cached tokens; a step is
    ``target.decode`` of B new tokens as ``[1, B]`` on top of that cache, which is then
    cropped back.  This times the cost of B new tokens (weights read once, B token rows of
    compute) and is what the scheduler's B means; attention over several requests' KV is
    approximated by one shared context.

    mode="requests": B tokens as R = ceil(B / tokens_per_request) requests × (1+ℓ) =
    ``tokens_per_request`` tokens, input ``[R, 1+ℓ]`` over R cached contexts of
    ``context_len`` each (closer to serving, costs R·context_len KV memory); the table
    records the actual R·(1+ℓ) tokens.

    SPS = 1 / median over ``repeats`` timed steps (after ``warmup`` untimed ones); the
    prefill of the context is not timed.
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
        if mode == "flat":
            shape, base = (1, B), context_len
            step_cache = cache
        else:
            t = max(1, int(tokens_per_request))
            R = math.ceil(B / t)
            shape, base = (R, t), context_len
            step_cache = target.decode(rand((R, context_len))).past_key_values if context_len > 0 else None
        times = []
        for i in range(warmup + repeats):
            ids = rand(shape)
            _sync(dev)
            t0 = time.perf_counter()
            out = target.decode(ids, past_key_values=step_cache)
            _sync(dev)
            dt = time.perf_counter() - t0
            if step_cache is None:
                del out
            else:
                _rollback(step_cache, base)
            if i >= warmup:
                times.append(dt)
        med = statistics.median(times)
        measured_b.append(shape[0] * shape[1])
        sps.append(1.0 / med)
        times_all.append(times)
    # 'requests' may map two requested sizes to the same token count: keep the first.
    uniq: Dict[int, float] = {}
    for b, s in zip(measured_b, sps):
        uniq.setdefault(b, s)
    name = getattr(target, "name", "target")
    return SPSTable(batch_tokens=list(uniq), steps_per_second=list(uniq.values()), device=device_name(dev),
                    target=str(name),
                    meta={"mode": mode, "context_len": context_len, "repeats": repeats, "warmup": warmup,
                          "tokens_per_request": tokens_per_request if mode == "requests" else None,
                          "dtype": str(getattr(target, "dtype", "")),
                          "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "times_s": times_all})


def load_sps_table(cfg, target=None) -> SPSTable:
    """``cfg.schedule.sps_table`` if set, else profile ``target`` with the configured sizes."""
    sc = cfg.schedule
    if sc.sps_table:
        return SPSTable.load(sc.sps_table)
    if target is None:
        raise ValueError("schedule.sps_table is not set and no target was given to profile")
    return profile_sps(target, sc.profile_batch_sizes, context_len=sc.profile_context_len,
                       repeats=sc.profile_repeats)
