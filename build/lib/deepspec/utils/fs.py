"""File-system helpers: errors that name the file (disk full, permission denied), directory fsync,
atomic file and directory replacement."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Union


def with_path(e: OSError, path: Union[str, os.PathLike], doing: str) -> OSError:
    """``e`` if it already names a file, else the same error (same errno and class) naming ``path``.

    Python reports a failed ``write``/``fsync`` as ``[Errno 28] No space left on device``
    with no file name; the stages re-raise it with this so the message says where."""
    if getattr(e, "filename", None):
        return e
    err = OSError(e.errno, f"{e.strerror or e} ({doing})", str(path))
    err.__cause__ = e
    return err


def fsync_dir(path: Union[str, os.PathLike]) -> None:
    """Persist a directory entry (after a rename); best effort where the OS refuses."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Union[str, os.PathLike], data: Union[bytes, str], *,
                 tmp: Optional[Union[str, os.PathLike]] = None, fsync: bool = True,
                 sync_dir: bool = False) -> None:
    """Replace ``path`` with ``data`` atomically: readers see the old file or the new one, never half.

    ``data`` goes to ``tmp`` (default ``.{name}.tmp.{pid}`` beside ``path``; ``str`` is written in
    text mode, ``bytes`` as is), is fsynced when ``fsync``, then ``os.replace``d onto ``path``;
    ``sync_dir`` also fsyncs the directory so the rename itself survives a crash.  On any failure
    the temp file is removed and an `OSError` names ``path`` (see `with_path`)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}") if tmp is None else Path(tmp)
    try:
        with open(tmp, "w" if isinstance(data, str) else "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise with_path(e, path, "writing") from e
        raise
    if sync_dir:
        fsync_dir(path.parent)


@contextmanager
def atomic_dir(out: Union[str, os.PathLike], prefix: Optional[str] = None) -> Iterator[Path]:
    """Yield a new temporary directory beside ``out`` (named ``prefix``…, default ``.{name}.``…); when
    the block succeeds it replaces ``out`` (an existing ``out`` is removed first), otherwise it is removed."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix or f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# Characters str.splitlines() breaks on that json.dumps(ensure_ascii=False) leaves raw.
_LINE_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def jsonl_line(obj, **kwargs) -> str:
    """One JSONL record (no newline): UTF-8 kept readable, but NEL/LS/PS escaped so that any
    line splitter (``str.splitlines`` included) sees exactly one record per line."""
    s = json.dumps(obj, ensure_ascii=False, **kwargs)
    for ch, esc in _LINE_BREAKS.items():
        s = s.replace(ch, esc)
    return s
