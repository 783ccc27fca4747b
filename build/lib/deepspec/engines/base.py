"""The engine interface: ``Engine.generate(list of message-lists, SamplingParams)``.

Each result is a `Completion` (a ``str`` carrying ``num_tokens``/``finish_reason``)
or a `GenerationError` (never raised for a single bad sample: the batch goes on).
"""
from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

from ..errors import DeepSpecError

Messages = List[Dict[str, str]]
# Per-sample seed key: a string (hashed with params.seed), an int (used as the seed
# itself, e.g. a request's own seed) or None (params.seed).
SeedKey = Union[str, int, None]
_SEED_MASK = (1 << 63) - 1


class EngineError(DeepSpecError, RuntimeError):
    """An engine that cannot run at all (no live server, bad settings)."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0          # 0 = off
    min_p: float = 0.0      # 0 = off
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_config(cls, engine_cfg, default_seed: int = 0) -> "SamplingParams":
        seed = engine_cfg.seed if engine_cfg.seed is not None else default_seed
        return cls(max_new_tokens=int(engine_cfg.max_new_tokens), temperature=float(engine_cfg.temperature),
                   top_p=float(engine_cfg.top_p), top_k=int(engine_cfg.top_k), min_p=float(engine_cfg.min_p),
                   seed=int(seed))


class Completion(str):
    """Generated text (a ``str``) plus ``num_tokens``, ``finish_reason`` and ``prompt_tokens``."""

    num_tokens: int
    finish_reason: str
    prompt_tokens: int

    def __new__(cls, text: str, num_tokens: int = 0, finish_reason: str = "stop", prompt_tokens: int = 0):
        obj = super().__new__(cls, text)
        obj.num_tokens = int(num_tokens)
        obj.finish_reason = finish_reason
        obj.prompt_tokens = int(prompt_tokens)
        return obj

    @property
    def text(self) -> str:
        return str.__str__(self)

    def __reduce__(self):
        return (Completion, (self.text, self.num_tokens, self.finish_reason, self.prompt_tokens))


class GenerationError(Exception):
    """A sample that could not be generated.

    ``code``: prompt_too_long | bad_request | http_error | timeout | connection | oom | exception.
    ``retryable``: whether trying again later may help (5xx, timeouts, connection errors).
    """

    def __init__(self, message: str, code: str = "exception", retryable: bool = False, attempts: int = 1):
        super().__init__(message)
        self.message = message
        self.code = code
        self.retryable = retryable
        self.attempts = attempts

    def to_dict(self) -> Dict[str, Any]:
        return {"error": self.message, "code": self.code, "attempts": self.attempts}

    def __repr__(self) -> str:
        return f"GenerationError({self.code}: {self.message})"


Result = Union[Completion, GenerationError]


def sample_seed(seed: int, key: SeedKey) -> int:
    """The 63-bit seed of one sample: independent of batch composition and order."""
    if key is None:
        return int(seed) & _SEED_MASK
    if isinstance(key, int) and not isinstance(key, bool):
        return int(key) & _SEED_MASK
    h = hashlib.sha256(f"{int(seed)}\x00{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") & _SEED_MASK


class Engine(ABC):
    """Generates one assistant answer per message list."""

    name: str = "engine"

    @abstractmethod
    def generate(self, prompts: Sequence[Messages], params: SamplingParams,
                 keys: Optional[Sequence[SeedKey]] = None) -> List[Result]:
        """One result per prompt, in order.  ``keys`` give per-sample seeds (see `sample_seed`)."""

    def describe(self) -> Dict[str, Any]:
        return {"engine": self.name}

    def healthy(self) -> bool:
        """False once the engine cannot serve anything more (e.g. every server is gone)."""
        return True

    @property
    def parallelism(self) -> int:
        """How many prompts it is worth handing over at once."""
        return 1

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
