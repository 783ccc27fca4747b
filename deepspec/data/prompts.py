"""Prompt files of the form ``{"turns": [str, ...]}`` per line: the benchmark prompts under
``eval.data_dir``, the regeneration's held-out prompts (``heldout.jsonl``) and any user file of
the same shape.  A malformed line is an error naming the file and line; nothing is skipped."""
from __future__ import annotations

import json
import os
from typing import List, Optional

from .conversation import DataError

__all__ = ["read_turns_file"]


def read_turns_file(path: str | os.PathLike, max_rows: Optional[int] = None) -> List[List[str]]:
    """The user turns of the first ``max_rows`` non-empty lines of ``path`` (all when None)."""
    out: List[List[str]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if max_rows is not None and len(out) >= max_rows:
                break
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"not JSON: {e}", origin=f"{path}:{lineno}", reason="invalid_json") from e
            turns = row.get("turns") if isinstance(row, dict) else None
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                raise DataError("expected {\"turns\": [str, ...]} with at least one turn", origin=f"{path}:{lineno}",
                                reason="bad_type")
            out.append(list(turns))
    return out
