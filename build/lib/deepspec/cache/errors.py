"""Error types of the hidden-state cache (every message names the file or shard)."""
from __future__ import annotations

from ..errors import DeepSpecError


class CacheError(DeepSpecError):
    """Base class: anything wrong with building, opening or reading a cache."""


class CacheMismatchError(CacheError):
    """The cache was built for another target, layer set, codec or source file."""


class CacheCorruptError(CacheError):
    """A manifest, index or shard is unreadable, truncated, or fails its checksum."""
