"""Target hidden-state cache: the on-disk format, the codecs and the reader.

See ``docs/cache.md``.  Public API::

    CacheReader(directory)  # len, reader[i], .manifest, .validate(target_or_dict), .lengths, .verify()
    get_codec(spec), register_codec(name), available_codecs()

Building a cache is `deepspec.prepare.build_cache`.
"""
from . import fp8, lowrank  # noqa: F401  (registers the lossy codecs)
from .codecs import BF16Codec, Codec, available_codecs, get_codec, register_codec
from .errors import CacheCorruptError, CacheError, CacheMismatchError
from .reader import CacheReader

__all__ = ["CacheReader", "CacheError", "CacheMismatchError", "CacheCorruptError", "Codec", "BF16Codec",
           "register_codec", "get_codec", "available_codecs"]
