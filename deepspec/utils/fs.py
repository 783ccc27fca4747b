"""File-system helpers: errors that name the file (disk full, permission denied), directory fsync."""
from __future__ import annotations

import os
from typing import Union


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
