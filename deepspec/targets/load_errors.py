"""One line for a target that cannot be loaded: what was asked, where it was looked for, and the fix.

transformers and huggingface_hub raise a dozen error types (and 20-line tracebacks) for a model that
is not on this machine, gated, misspelt or a local path that does not exist; the user of an offline
cluster meets them first.  `explain` maps them to a `TargetLoadError`.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import DeepSpecError

__all__ = ["TargetLoadError", "explain"]


class TargetLoadError(DeepSpecError, OSError):
    """A target (model or tokenizer) that cannot be loaded as configured."""


def _hub_cache() -> str:
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
        return str(HF_HUB_CACHE)
    except ImportError:   # pragma: no cover - huggingface_hub comes with transformers
        return "the Hugging Face cache"


def _chain(e: BaseException):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def _looks_local(path: str) -> bool:
    """A filesystem path rather than a hub id (``org/name``: one slash, no leading ``/ . ~``)."""
    return path.startswith(("/", ".", "~")) or path.count("/") > 1 or (os.sep != "/" and os.sep in path)


def explain(e: BaseException, path: str, what: str, key: str = "target.path") -> TargetLoadError:
    """A `TargetLoadError` for loading ``what`` ("model", "tokenizer") from ``path`` (the config's ``key``)."""
    names = {type(x).__name__ for x in _chain(e)}
    text = " ".join(str(x) for x in _chain(e)).lower()
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    head = f"{key}={path!r}: the {what} cannot be loaded"
    if _looks_local(path) and not Path(path).expanduser().exists():
        return TargetLoadError(f"{head}: no such file or directory {Path(path).expanduser()} (set {key} to the "
                               "directory holding the model's config.json and weights)")
    if "GatedRepoError" in names or "gated repo" in text:
        return TargetLoadError(f"{head}: {path} is gated on the Hugging Face hub; accept its license on its hub page "
                               "and log in (`hf auth login`, or HF_TOKEN), or set "
                               f"{key} to a local copy")
    if "RepositoryNotFoundError" in names or "is not a valid model identifier" in text or "repository not found" in text:
        return TargetLoadError(f"{head}: no local directory of that name and no such repository on the hub "
                               f"(check the id, or set {key} to a local directory)")
    if ("LocalEntryNotFoundError" in names or "OfflineModeIsEnabled" in names or "couldn't connect" in text
            or "offline" in text or "connection" in text):
        where = "HF_HUB_OFFLINE=1 is set" if offline else "the hub is unreachable"
        return TargetLoadError(f"{head}: not in the local cache {_hub_cache()} and {where}; download it once where "
                               f"there is network (`hf download {path}`) and run with HF_HUB_OFFLINE=1, or set "
                               f"{key} to a local directory")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return TargetLoadError(f"{head}: {type(e).__name__}: {first}")
