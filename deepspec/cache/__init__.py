"""Target hidden-state cache: sharded Arrow IPC, zstd-compressed, checksummed, resumable.

See ``docs/cache.md``.  Public API::

    build_cache(cfg, regen_path=None, target=None, *, rank=None, world_size=None, wait=True) -> Path
    finalize_cache(directory, strict=False) -> bool
    CacheReader(directory)  # len, reader[i], .manifest, .validate(target_or_dict), .lengths, .verify()
"""
from .codecs import BF16Codec, Codec, available_codecs, get_codec, register_codec
from . import lossy as _lossy  # noqa: F401  (registers the fp8 and lowrank codecs)
from .errors import CacheCorruptError, CacheError, CacheMismatchError
from .reader import CacheReader


def build_cache(cfg, regen_path=None, target=None, **kw):
    from .build import build_cache as _build
    return _build(cfg, regen_path=regen_path, target=target, **kw)


def finalize_cache(directory, strict: bool = False) -> bool:
    from .build import finalize_cache as _fin
    return _fin(directory, strict=strict)


__all__ = ["CacheReader", "CacheError", "CacheMismatchError", "CacheCorruptError", "Codec", "BF16Codec",
           "register_codec", "get_codec", "available_codecs", "build_cache", "finalize_cache"]
