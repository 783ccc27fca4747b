"""Deterministic train / held-out split by a seeded hash of the sample id.

A sample's side depends only on (its id, ``split_seed``): the split is stable under
reordering, adding or removing other samples, and the two sides are disjoint.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable, List, Sequence, Tuple

from ..utils.fs import jsonl_line, with_path
from .conversation import Conversation


def split_score(sample_id: str, seed: int = 0) -> float:
    """Uniform in [0, 1): the first 8 bytes of sha256(seed, id)."""
    h = hashlib.sha256(f"deepspec-split\x00{seed}\x00{sample_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0 ** 64


def is_heldout(sample_id: str, fraction: float, seed: int = 0) -> bool:
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"data.heldout_fraction={fraction} must be in [0, 1]")
    return fraction > 0 and split_score(sample_id, seed) < fraction


def split_conversations(convs: Iterable[Conversation], fraction: float, seed: int = 0
                        ) -> Tuple[List[Conversation], List[Conversation]]:
    """(train, held-out), each keeping the input order."""
    train, held = [], []
    for c in convs:
        (held if is_heldout(c.id, fraction, seed) else train).append(c)
    return train, held


def heldout_record(c: Conversation) -> dict:
    rec = {"id": c.id, "turns": c.user_turns()}
    sys = c.system_prompt()
    if sys:
        rec["system"] = sys
    return rec


def write_jsonl_atomic(path: str | os.PathLike, records: Iterable[dict], fsync: bool = True) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        # backslashreplace: a lone surrogate (e.g. from a server's JSON) is written as its JSON escape
        with open(tmp, "w", encoding="utf-8", errors="backslashreplace") as f:
            for r in records:
                f.write(jsonl_line(r) + "\n")
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:   # never leave a half file behind (it may be what filled the disk)
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise with_path(e, path, "writing") from e
        raise
    return path


def write_heldout(convs: Sequence[Conversation], path: str | os.PathLike) -> Path:
    """Held-out prompts as ``{"id", "turns": [user turns], "system"?}`` JSONL (eval-ready)."""
    return write_jsonl_atomic(path, (heldout_record(c) for c in convs))
