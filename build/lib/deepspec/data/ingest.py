"""Prompt ingestion: any source → `Conversation`s, bad records handled per ``data.on_error``.

``on_error=error`` stops at the first bad record with a `DataError` naming file and
line; ``on_error=skip`` writes each bad record to an error file (JSONL) and counts
it.  Records with unknown roles and the ShareGPT corpus's cut-off last record are
always counted skips.  Nothing is dropped without being counted and written down.
"""
from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from .conversation import Conversation, DataError, UnknownRoleError, fallback_id, record_to_conversation
from .sources import column_mapping, iter_source
from ..utils.fs import jsonl_line

log = logging.getLogger(__name__)
ON_ERROR = ("error", "skip")


@dataclass
class IngestStats:
    source: str = ""
    records: int = 0              # records read (good + bad)
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)   # reason -> count
    renamed_duplicates: int = 0   # repeated ids made unique with a '#k' suffix
    passed_over: int = 0          # good conversations before data.start_sample (not kept, not errors)
    errors_path: Optional[str] = None

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        s = f"ingest [{self.source}]: {self.records} records, {self.kept} kept, {self.num_skipped} skipped"
        if self.skipped:
            s += " (" + ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) + ")"
        if self.renamed_duplicates:
            s += f", {self.renamed_duplicates} duplicate ids renamed"
        if self.passed_over:
            s += f", {self.passed_over} passed over before data.start_sample"
        if self.num_skipped and self.errors_path:
            s += f"; details in {self.errors_path}"
        return s

    def to_dict(self) -> Dict[str, Any]:
        return {"source": self.source, "records": self.records, "kept": self.kept,
                "skipped": dict(self.skipped), "renamed_duplicates": self.renamed_duplicates,
                "passed_over": self.passed_over}


class ErrorFile:
    """Append-only JSONL of skipped records, written to a temp file and moved in place on close."""

    def __init__(self, path: Optional[str | os.PathLike]):
        self.path = Path(path) if path else None
        self._f = None
        self._tmp = None

    def write(self, entry: Dict[str, Any]) -> None:
        if self.path is None:
            return
        if self._f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._tmp = self.path.with_name(f".{self.path.name}.tmp.{os.getpid()}")
            # backslashreplace: a lone surrogate in a bad record is written as the JSON escape \\udXXX
            self._f = open(self._tmp, "w", encoding="utf-8", errors="backslashreplace")
        self._f.write(jsonl_line(entry, default=str) + "\n")

    def close(self) -> None:
        if self.path is None:
            return
        if self._f is None:  # no errors: leave an empty file so a stale one never lingers
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._tmp = self.path.with_name(f".{self.path.name}.tmp.{os.getpid()}")
            self._f = open(self._tmp, "w", encoding="utf-8")
        self._f.close()
        os.replace(self._tmp, self.path)
        self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()
        elif self._f is not None:
            self._f.close()
            try:
                os.unlink(self._tmp)
            except OSError:
                pass


def _raw_snippet(raw: Any, limit: int = 2000) -> Any:
    if raw is None:
        return None
    try:
        text = raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False, default=str)
    except Exception:
        text = repr(raw)
    return text if len(text) <= limit else text[:limit] + "…"


def load_conversations(data_cfg, errors_path: Optional[str | os.PathLike] = None,
                       on_error: Optional[str] = None) -> tuple[List[Conversation], IngestStats]:
    """Read ``data_cfg``'s source into conversations (input order, unique ids).

    Passes over the first ``data.start_sample`` good conversations (their ids still count for
    duplicate renaming, so a conversation gets the same id whatever the start), then stops after
    ``data.max_samples`` kept ones.  Returns the conversations and an `IngestStats`; skipped
    records go to ``errors_path`` (JSONL).
    """
    mode = on_error or data_cfg.on_error
    if mode not in ON_ERROR:
        raise DataError(f"data.on_error={mode!r}: choose from {', '.join(ON_ERROR)}", reason="source")
    columns = column_mapping(data_cfg)
    stats = IngestStats(source=data_cfg.source, errors_path=str(errors_path) if errors_path else None)
    out: List[Conversation] = []
    seen: Dict[str, int] = {}
    limit = data_cfg.max_samples
    start = getattr(data_cfg, "start_sample", 0) or 0
    if start < 0:
        raise DataError(f"data.start_sample={start}: must be >= 0", reason="source")
    with ErrorFile(errors_path) as errf:
        def skip(err: DataError) -> None:
            stats.skipped[err.reason] += 1
            errf.write({"stage": "ingest", "origin": err.origin, "reason": err.reason,
                        "error": err.problem, "raw": _raw_snippet(err.raw)})

        for rec in iter_source(data_cfg):
            if limit is not None and len(out) >= limit:
                break
            stats.records += 1
            err = rec.error
            conv = None
            if err is None:
                try:
                    conv = record_to_conversation(rec.value, origin=rec.origin,
                                                  default_id=fallback_id(rec.source_key, rec.line),
                                                  columns=columns)
                except DataError as e:
                    err = e
            if err is not None:
                always_skip = isinstance(err, UnknownRoleError) or err.reason == "truncated" and \
                    data_cfg.source == "sharegpt_package"
                if mode == "error" and not always_skip:
                    raise err
                skip(err)
                continue
            n = seen.get(conv.id, 0)
            seen[conv.id] = n + 1
            if n:
                base = conv.id
                while conv.id in seen:
                    conv.id = f"{base}#{n}"
                    n += 1
                seen[conv.id] = 1
                stats.renamed_duplicates += 1
            if stats.passed_over < start:
                stats.passed_over += 1
                continue
            out.append(conv)
    stats.kept = len(out)
    return out, stats
