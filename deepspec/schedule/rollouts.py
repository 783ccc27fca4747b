"""Draft rollout records: what the eval loop logs per verification round (JSONL).

One JSON object per line, one line per verification round of one request::

    {"request_id": "gsm8k/17", "round": 3, "confidence": [0.97, 0.91, 0.55, 0.40],
     "accepted": 2, "verified": 4, "draft_tokens": [312, 11, 980, 7]}

- ``confidence[γ]``: the drafter's *raw* confidence head outputs c_k (k = 1..γ), each the
  predicted probability that draft token k survives verification given that all earlier
  draft tokens survived.  Not calibrated, not cumulative.
- ``accepted``: number of draft tokens the target accepted in this round (0..verified).
  The target also emits one more token (correction or bonus) each round, so the round
  produced ``accepted + 1`` tokens.
- ``verified`` (optional, default γ): how many draft tokens were sent to verification.
  Rounds verified with a truncated draft (``verified < γ``) and fully accepted
  (``accepted == verified``) are *censored*: survival beyond ``verified`` was not observed.
  Calibration masks those positions out; the simulator needs full-length (``verified = γ``)
  logs, so log rollouts with the fixed-length policy.
- ``draft_tokens`` (optional): the γ proposed token ids.
- ``request_id``, ``round`` (0-based round index within the request).
- ``meta`` (optional): free-form dict (benchmark name, temperature, ...).

Prefix survival at position k (1-based) is ``accepted >= k``.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..paths import eval_dir

ROLLOUTS_FILENAME = "rollouts.jsonl"


@dataclass
class RolloutRecord:
    request_id: str
    round: int
    confidence: Optional[List[float]]
    accepted: int
    verified: Optional[int] = None
    draft_tokens: Optional[List[int]] = None
    meta: Optional[Dict[str, Any]] = None

    @property
    def gamma(self) -> int:
        if self.confidence is not None:
            return len(self.confidence)
        if self.draft_tokens is not None:
            return len(self.draft_tokens)
        raise ValueError(f"rollout {self.request_id}#{self.round}: neither confidence nor draft_tokens")

    @property
    def verified_len(self) -> int:
        return self.gamma if self.verified is None else int(self.verified)

    def validate(self) -> "RolloutRecord":
        g = self.gamma
        v = self.verified_len
        if not 0 <= v <= g:
            raise ValueError(f"rollout {self.request_id}#{self.round}: verified={v} outside 0..{g}")
        if not 0 <= int(self.accepted) <= v:
            raise ValueError(f"rollout {self.request_id}#{self.round}: accepted={self.accepted} outside 0..{v}")
        if self.draft_tokens is not None and len(self.draft_tokens) != g:
            raise ValueError(f"rollout {self.request_id}#{self.round}: {len(self.draft_tokens)} draft_tokens "
                             f"but γ={g}")
        return self

    def to_json(self) -> Dict[str, Any]:
        d = asdict(self)
        return {k: v for k, v in d.items() if v is not None or k == "confidence"}

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "RolloutRecord":
        if (d.get("meta") or {}).get("tree") is not None:
            raise ValueError("a draft-tree round: calibration and the scheduler read chain rollouts "
                             "(run deepspec eval with eval.decoding=chain)")
        known = {"request_id", "round", "confidence", "accepted", "verified", "draft_tokens", "meta"}
        extra = {k: v for k, v in d.items() if k not in known}
        meta = dict(d.get("meta") or {})
        meta.update(extra)  # unknown keys are kept, not lost
        conf = d.get("confidence")
        return cls(request_id=str(d["request_id"]), round=int(d.get("round", 0)),
                   confidence=None if conf is None else [float(x) for x in conf],
                   accepted=int(d["accepted"]),
                   verified=None if d.get("verified") is None else int(d["verified"]),
                   draft_tokens=None if d.get("draft_tokens") is None else [int(x) for x in d["draft_tokens"]],
                   meta=meta or None).validate()


def _to_list(x) -> Optional[list]:
    if x is None:
        return None
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy() if x.is_floating_point() else x.detach().cpu().numpy()
    return np.asarray(x).tolist()


def make_record(request_id, round: int, confidence, accepted: int, verified: Optional[int] = None,
                draft_tokens=None, meta: Optional[Dict[str, Any]] = None) -> RolloutRecord:
    """Build a record from tensors/arrays/lists (what the eval loop has in hand)."""
    conf = _to_list(confidence)
    toks = _to_list(draft_tokens)
    return RolloutRecord(request_id=str(request_id), round=int(round),
                         confidence=None if conf is None else [float(c) for c in conf],
                         accepted=int(accepted), verified=None if verified is None else int(verified),
                         draft_tokens=None if toks is None else [int(t) for t in toks],
                         meta=meta).validate()


class RolloutWriter:
    """Append rollout records to a JSONL file (one line per round), flushed per write.

    >>> with RolloutWriter(path) as w:
    ...     w.write(make_record("req0", 0, proposal.confidence, accepted=n_acc))
    """

    def __init__(self, path: str | os.PathLike, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a" if append else "w", encoding="utf-8")

    def write(self, record: RolloutRecord) -> None:
        self._f.write(json.dumps(record.validate().to_json(), separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def write_rollouts(path: str | os.PathLike, records: Iterable[RolloutRecord]) -> Path:
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r.validate().to_json(), separators=(",", ":")) + "\n")
    os.replace(tmp, path)
    return path


def iter_rollout_lines(path: str | os.PathLike) -> Iterator[Tuple[int, RolloutRecord]]:
    """(1-based line number, record) for each non-blank line; bad lines raise naming path:line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield lineno, RolloutRecord.from_json(json.loads(line))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: bad rollout record: {e}") from e


def iter_rollouts(path: str | os.PathLike) -> Iterator[RolloutRecord]:
    for _, rec in iter_rollout_lines(path):
        yield rec


def read_rollouts(path: str | os.PathLike) -> List[RolloutRecord]:
    return list(iter_rollouts(path))


def default_rollouts_path(cfg) -> Path:
    """``cfg.schedule.rollouts`` or ``{eval_dir}/rollouts.jsonl`` (where eval should log)."""
    if cfg.schedule.rollouts:
        return Path(cfg.schedule.rollouts)
    return eval_dir(cfg) / ROLLOUTS_FILENAME


# -- arrays --------------------------------------------------------------------------------


@dataclass
class RolloutArrays:
    """Rounds stacked into arrays (one row per verification round)."""
    confidence: np.ndarray   # [N, γ] float64 raw confidences
    accepted: np.ndarray     # [N] int
    verified: np.ndarray     # [N] int
    request_ids: List[str] = field(default_factory=list)
    rounds: Optional[np.ndarray] = None

    @property
    def gamma(self) -> int:
        return int(self.confidence.shape[1])

    def __len__(self) -> int:
        return int(self.confidence.shape[0])

    def survival(self) -> np.ndarray:
        """[N, γ] bool: prefix survival, ``accepted >= k`` for k = 1..γ."""
        return prefix_survival(self.accepted, self.gamma)

    def observed(self) -> np.ndarray:
        """[N, γ] bool: whether survival at k was observed (not censored by a truncated verify)."""
        return observed_mask(self.accepted, self.verified, self.gamma)


def prefix_survival(accepted, gamma: int) -> np.ndarray:
    acc = np.asarray(accepted).reshape(-1, 1)
    return acc >= np.arange(1, gamma + 1)[None, :]


def observed_mask(accepted, verified, gamma: int) -> np.ndarray:
    """Survival at k is known if k ≤ verified, or if the chain already broke (accepted < verified)."""
    acc = np.asarray(accepted).reshape(-1, 1)
    ver = np.asarray(verified).reshape(-1, 1)
    k = np.arange(1, gamma + 1)[None, :]
    return (k <= ver) | (acc < ver)


def to_arrays(records: Sequence[RolloutRecord], gamma: Optional[int] = None) -> RolloutArrays:
    """Stack records; all must share γ (or pass ``gamma`` to keep only records with that γ)."""
    recs = [r for r in records if r.confidence is not None]
    if len(recs) < len(records):
        if not recs:
            raise ValueError("no rollout record carries confidences (the drafter has no confidence head?)")
    gammas = sorted({r.gamma for r in recs})
    if gamma is None:
        if len(gammas) > 1:
            raise ValueError(f"rollouts mix draft lengths γ={gammas}; pass gamma= to pick one")
        gamma = gammas[0] if gammas else 0
    recs = [r for r in recs if r.gamma == gamma]
    if not recs:
        raise ValueError(f"no rollout record with γ={gamma}")
    conf = np.array([r.confidence for r in recs], dtype=np.float64)
    return RolloutArrays(confidence=conf,
                         accepted=np.array([r.accepted for r in recs], dtype=np.int64),
                         verified=np.array([r.verified_len for r in recs], dtype=np.int64),
                         request_ids=[r.request_id for r in recs],
                         rounds=np.array([r.round for r in recs], dtype=np.int64))


@dataclass
class RequestTrace:
    """The logged rounds of one request, in order (input of the serving simulator)."""
    request_id: str
    confidence: np.ndarray   # [n_rounds, γ]
    accepted: np.ndarray     # [n_rounds]
    verified: np.ndarray     # [n_rounds]

    def __len__(self) -> int:
        return int(self.accepted.shape[0])


def group_by_request(records: Sequence[RolloutRecord], gamma: Optional[int] = None) -> List[RequestTrace]:
    arr = to_arrays(records, gamma)
    order: Dict[str, List[int]] = {}
    for i, rid in enumerate(arr.request_ids):
        order.setdefault(rid, []).append(i)
    traces = []
    for rid, idx in order.items():
        idx = sorted(idx, key=lambda i: int(arr.rounds[i]))
        traces.append(RequestTrace(rid, arr.confidence[idx], arr.accepted[idx], arr.verified[idx]))
    return traces


# -- synthetic rollouts (benchmarks and tests only; clearly labelled) ------------------------


def synthetic_rollouts(n_requests: int = 64, rounds_per_request: int = 32, gamma: int = 7,
                       seed: int = 0, overconfidence: float = 2.0, noise: float = 0.5,
                       mean_logit: float = 2.0, request_spread: float = 1.0,
                       round_spread: float = 1.0, decay: float = 0.35) -> List[RolloutRecord]:
    """Synthetic draft rollouts with an *overconfident* confidence head.

    Per request a difficulty ``μ_r ~ N(mean_logit, request_spread)``, per round
    ``z ~ N(μ_r, round_spread)``; the true conditional acceptance at position k is
    ``p_k = σ(z − decay·(k−1))``, acceptance is sampled left to right, and the head reports
    ``c_k = σ(overconfidence·(logit p_k + ε))`` with ``ε ~ N(0, noise)``.  Every record
    carries ``meta={"synthetic": True}``.
    """
    rng = np.random.default_rng(seed)
    recs: List[RolloutRecord] = []
    k = np.arange(gamma)
    for r in range(n_requests):
        mu = rng.normal(mean_logit, request_spread)
        for t in range(rounds_per_request):
            z = rng.normal(mu, round_spread)
            true_logit = z - decay * k
            p = 1.0 / (1.0 + np.exp(-true_logit))
            ok = rng.random(gamma) < p
            accepted = int(gamma if ok.all() else np.argmin(ok))
            head_logit = overconfidence * (true_logit + rng.normal(0.0, noise, gamma))
            conf = 1.0 / (1.0 + np.exp(-head_logit))
            recs.append(RolloutRecord(request_id=f"synthetic/{r}", round=t,
                                      confidence=[float(c) for c in conf], accepted=accepted,
                                      meta={"synthetic": True}))
    return recs


def is_synthetic(records: Sequence[RolloutRecord]) -> bool:
    return any((r.meta or {}).get("synthetic") for r in records)
