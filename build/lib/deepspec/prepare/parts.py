"""Crash-safe progress for long generation jobs.

Completed samples are appended, one JSON line each, to a per-rank part file and
fsync'd.  A job killed at any moment (kill -9 included) leaves at worst one torn
last line, which is ignored (and cut off before appending again) on resume.
Lines are keyed by the sample's input index, so any number of ranks, any number
of restarts and any world size can contribute; the final output is assembled in
input order from the union.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ..utils.fs import atomic_write, with_path, jsonl_line
from ..utils.signals import deferred

log = logging.getLogger(__name__)


def _scan(path: Path) -> Tuple[List[Dict[str, Any]], int, int]:
    """(entries, byte length of the valid prefix, number of bad lines) of one part file."""
    data = path.read_bytes()
    entries, good_end, bad, pos = [], 0, 0, 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:  # torn last line (no newline): the write never finished
            bad += 1
            break
        line = data[pos:nl]
        pos = nl + 1
        if not line.strip():
            good_end = pos
            continue
        try:
            e = json.loads(line)
            if not isinstance(e, dict) or not isinstance(e.get("i"), int):
                raise ValueError("not a part entry")
        except ValueError:
            bad += 1
            continue
        entries.append(e)
        good_end = pos
    return entries, good_end, bad


def merge(into: Dict[int, Dict[str, Any]], entry: Dict[str, Any]) -> None:
    """A success is final; a newer failure never hides an older success."""
    old = into.get(entry["i"])
    if old is not None and old.get("ok") and not entry.get("ok"):
        return
    into[entry["i"]] = entry


class PartStore:
    def __init__(self, directory: str | os.PathLike, rank: int = 0, fsync: bool = True):
        self.dir = Path(directory)
        self.rank = rank
        self.fsync = fsync
        self._f = None

    @property
    def own_file(self) -> Path:
        return self.dir / f"rank{self.rank:05d}.jsonl"

    def files(self) -> List[Path]:
        return sorted(self.dir.glob("rank*.jsonl")) if self.dir.is_dir() else []

    def load(self) -> Dict[int, Dict[str, Any]]:
        """Every intact entry of every rank's part file, merged by input index."""
        out: Dict[int, Dict[str, Any]] = {}
        bad_total = 0
        for f in self.files():
            try:
                entries, _, bad = _scan(f)
            except FileNotFoundError:
                continue
            bad_total += bad
            for e in entries:
                merge(out, e)
        if bad_total:
            log.info("ignored %d torn/invalid line(s) in %s", bad_total, self.dir)
        return out

    def open(self) -> None:
        """Open this rank's part file for appending, cutting off a torn last line first."""
        self.dir.mkdir(parents=True, exist_ok=True)
        f = self.own_file
        if f.exists():
            _, good_end, _ = _scan(f)
            if good_end < f.stat().st_size:
                with open(f, "r+b") as h:
                    h.truncate(good_end)
                    h.flush()
                    os.fsync(h.fileno())
        self._f = open(f, "ab", buffering=0)   # unbuffered: a failed append can be cut off exactly

    def append(self, entries: Iterable[Dict[str, Any]]) -> None:
        """Append finished samples as whole lines: SIGTERM / Ctrl-C wait for the append to finish;
        a failed write (disk full, I/O error) is cut off again, keeping every earlier line."""
        if self._f is None:
            self.open()
        buf = b"".join(jsonl_line(e).encode("utf-8", "backslashreplace") + b"\n"
                       for e in entries)
        if not buf:
            return
        with deferred():
            fd = self._f.fileno()
            start = os.fstat(fd).st_size
            try:
                view = memoryview(buf)
                while view:
                    view = view[self._f.write(view):]
                if self.fsync:
                    os.fsync(fd)
            except OSError as e:
                try:
                    os.ftruncate(fd, start)
                except OSError:
                    pass   # a torn last line is also cut off when the job resumes
                raise with_path(e, self.own_file, "appending finished samples; the earlier ones are kept, "
                                                  "re-run the same command to resume") from e

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def clear(self) -> None:
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def write_json_atomic(path: Path, obj: Dict[str, Any]) -> None:
    """temp file + fsync + os.replace (no directory fsync)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(obj, indent=1, sort_keys=True))
