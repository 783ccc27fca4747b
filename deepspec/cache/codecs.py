"""Codecs for the cached float tensors (``features [T, L*H]`` and ``last_hidden [T, H]``).

A codec turns one sample's 2-D tensor into one opaque blob and back.  The codec
name and its parameters are written into the manifest and into every shard's
schema metadata; the reader refuses a shard whose codec differs from the
manifest's (no mixed caches).

``bf16`` (default) is lossless: the bf16 bits are rearranged and compressed with
zstd.  Layouts (measured by ``bench/cache_bench.py codecs``, see ``docs/cache.md``):

- ``plain``: the little-endian bf16 bytes, token-major, straight into zstd;
- ``planes``: the high bytes (sign + 7 exponent bits) of all values, then the low
  bytes (1 exponent bit + mantissa) — the exponent plane compresses ~2.5:1, the
  mantissa plane barely at all;
- ``planes_cm``: the tensor is first transposed to channel-major ``[D, T]`` so the
  exponent plane holds each channel's values over time side by side (channels
  keep their scale across tokens), then split into planes.  Best measured ratio.

Lossy codecs (``fp8``, ``lowrank``) plug in through the same interface:
``register_codec`` a subclass, set ``lossless = False``, map its ``cache.*`` keys in
``config_params``, and if it needs fitted state (a projection basis, per-channel scales)
implement ``calibrate`` and ``state_arrays`` / ``load_state_arrays``; the builder stores
those arrays in ``codec_state.arrow`` (checksummed by the manifest), never with pickle.
The package imports every codec module, so each is registered before a name is looked up.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, ClassVar, Dict, Iterable, Mapping, Optional, Tuple, Type, Union

import numpy as np
import torch
import zstandard as zstd

from .errors import CacheCorruptError, CacheError

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("deepspec.cache assumes a little-endian host")

CODECS: Dict[str, Type["Codec"]] = {}
_tls = threading.local()


def register_codec(name: str):
    """Class decorator: make a `Codec` subclass available under ``name``."""
    def deco(cls):
        if name in CODECS and CODECS[name] is not cls:
            raise ValueError(f"codec {name!r} is already registered by {CODECS[name].__name__}")
        cls.name = name
        CODECS[name] = cls
        return cls
    return deco


def available_codecs():
    return sorted(CODECS)


# -- zstd helpers (one compressor per thread: zstandard objects are not thread-safe) ------------
def _compressor(level: int) -> "zstd.ZstdCompressor":
    cache = getattr(_tls, "cctx", None)
    if cache is None:
        cache = _tls.cctx = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstd.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    return c


def _decompressor() -> "zstd.ZstdDecompressor":
    d = getattr(_tls, "dctx", None)
    if d is None:
        d = _tls.dctx = zstd.ZstdDecompressor()
    return d


def zstd_compress(data, level: int = 3) -> bytes:
    return _compressor(level).compress(data)


def zstd_decompress(blob, expected_size: int, what: str = "blob") -> bytes:
    """Decompress one frame of exactly ``expected_size`` bytes (checksum verified by zstd)."""
    if blob is None:
        raise CacheCorruptError(f"{what}: missing value")
    try:
        size = zstd.frame_content_size(blob)
    except zstd.ZstdError as e:
        raise CacheCorruptError(f"{what}: not a zstd frame ({e})") from None
    if size != expected_size:
        raise CacheCorruptError(f"{what}: frame holds {size} bytes, expected {expected_size}")
    try:
        out = _decompressor().decompress(blob, max_output_size=expected_size)
    except zstd.ZstdError as e:
        raise CacheCorruptError(f"{what}: {e}") from None
    if len(out) != expected_size:
        raise CacheCorruptError(f"{what}: decoded {len(out)} bytes, expected {expected_size}")
    return out


def encode_array(a: np.ndarray, level: int = 3) -> bytes:
    """Integer payloads (token ids, loss mask): little-endian bytes in a checksummed frame."""
    return zstd_compress(np.ascontiguousarray(a).tobytes(), level)


def decode_array(blob, dtype, n: int, what: str = "blob") -> np.ndarray:
    dt = np.dtype(dtype)
    raw = zstd_decompress(blob, n * dt.itemsize, what)
    return np.frombuffer(raw, dtype=dt).copy()


# -- codec interface ------------------------------------------------------------------------------
class Codec:
    """Encode one sample's ``[T, D]`` float tensor to bytes and back (to bf16)."""

    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = True
    needs_calibration: ClassVar[bool] = False

    @classmethod
    def config_params(cls, cache_cfg) -> Dict[str, Any]:
        """Constructor parameters taken from a `CacheConfig` (its ``cache.*`` keys)."""
        return {}

    def params(self) -> Dict[str, Any]:
        """JSON-serialisable parameters; together with the name they identify the format."""
        return {}

    def spec(self) -> Dict[str, Any]:
        return {"name": self.name, "params": self.params()}

    def encode(self, x: torch.Tensor, column: str = "features") -> bytes:
        raise NotImplementedError

    def decode(self, blob, shape: Tuple[int, int], column: str = "features") -> torch.Tensor:
        raise NotImplementedError

    @property
    def last_hidden_lossless(self) -> bool:
        """Whether ``last_hidden`` reads back bit-exact (as bf16): it defines the target distribution."""
        return True

    def stored_last_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The ``last_hidden`` the reader will return for ``x`` (bf16): what ``target_lse`` is computed from,
        so that ``exp(logits - target_lse)`` is a distribution over the vocabulary."""
        return x.to(torch.bfloat16)

    # lossy codecs with fitted state ---------------------------------------------------------
    def calibrate(self, samples: Iterable[Dict[str, torch.Tensor]]) -> None:
        """Fit codec state on a few samples (called once before the build when
        ``needs_calibration``)."""

    def state_arrays(self) -> Dict[str, np.ndarray]:
        return {}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        if arrays:
            raise CacheError(f"codec {self.name!r} has no state, got {sorted(arrays)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params()})"


@register_codec("bf16")
class BF16Codec(Codec):
    """Lossless bf16: byte-plane (optionally channel-major) layout + zstd."""

    LAYOUTS = ("plain", "planes", "planes_cm")
    lossless = True

    def __init__(self, layout: str = "planes_cm", level: int = 1):
        if layout not in self.LAYOUTS:
            raise CacheError(f"bf16 codec: layout {layout!r} is not one of {self.LAYOUTS}")
        if not isinstance(level, int) or not -7 <= level <= 22:
            raise CacheError(f"bf16 codec: zstd level {level!r} must be an int in [-7, 22]")
        self.layout = layout
        self.level = int(level)

    @classmethod
    def config_params(cls, cache_cfg) -> Dict[str, Any]:
        return {"layout": cache_cfg.layout, "level": int(cache_cfg.zstd_level)}

    def params(self) -> Dict[str, Any]:
        return {"layout": self.layout, "level": self.level}

    def to_bytes(self, x: torch.Tensor) -> np.ndarray:
        """The rearranged (uncompressed) bytes of ``x`` as uint8."""
        if x.dim() != 2:
            raise ValueError(f"bf16 codec encodes [T, D] tensors, got shape {tuple(x.shape)}")
        u = x.detach().to(torch.bfloat16)
        on_device = u.device.type != "cpu" and self.layout == "planes_cm"
        if on_device:
            u = u.t()  # transpose on the accelerator, before the copy
        a = u.contiguous().cpu().view(torch.int16).numpy().view(np.uint16)
        if self.layout == "planes_cm" and not on_device:
            a = np.ascontiguousarray(a.T)
        a = a.reshape(-1)
        if self.layout == "plain":
            return a.view(np.uint8)
        n = a.size
        b = a.view(np.uint8).reshape(n, 2)  # little-endian: [:, 0] low byte, [:, 1] high byte
        out = np.empty(2 * n, dtype=np.uint8)
        out[:n] = b[:, 1]
        out[n:] = b[:, 0]
        return out

    def encode(self, x: torch.Tensor, column: str = "features") -> bytes:
        return zstd_compress(self.to_bytes(x), self.level)

    def from_bytes(self, raw, shape: Tuple[int, int]) -> torch.Tensor:
        t, d = shape
        a = np.frombuffer(raw, dtype=np.uint8)
        n = t * d
        if self.layout == "plain":
            u = a.view("<u2").reshape(t, d).copy()
        else:
            u = np.empty(n, dtype=np.uint16)
            np.left_shift(a[:n], 8, out=u, dtype=np.uint16)
            u |= a[n:]
            u = np.ascontiguousarray(u.reshape(d, t).T) if self.layout == "planes_cm" else u.reshape(t, d)
        return torch.from_numpy(u.view(np.int16)).view(torch.bfloat16)

    def decode(self, blob, shape: Tuple[int, int], column: str = "features") -> torch.Tensor:
        t, d = shape
        raw = zstd_decompress(blob, t * d * 2, column)
        return self.from_bytes(raw, (t, d))


def get_codec(spec: Union[str, Mapping[str, Any], Codec], **params) -> Codec:
    """A codec from its name (+params), a manifest spec ``{"name", "params"}`` or an instance."""
    if isinstance(spec, Codec):
        return spec
    if isinstance(spec, Mapping):
        name, base = spec.get("name"), spec.get("params") or {}
        if not isinstance(base, Mapping):
            raise CacheError(f"codec {name!r}: params must be a mapping, got {type(base).__name__}")
        params = {**base, **params}
    else:
        name = spec
    if not isinstance(name, str) or name not in CODECS:
        raise CacheError(f"unknown cache codec {name!r}; available: {', '.join(available_codecs())}")
    if not all(isinstance(k, str) for k in params):
        raise CacheError(f"codec {name!r}: parameter names must be strings")
    try:
        return CODECS[name](**params)
    except TypeError as e:
        raise CacheError(f"codec {name!r}: bad parameters {dict(params)}: {e}") from None


def codec_from_config(cache_cfg) -> Codec:
    """The codec a `CacheConfig` asks for (``cache.codec``, its parameters from `Codec.config_params`)."""
    name = cache_cfg.codec
    cls = CODECS.get(name)
    return get_codec(name, **(cls.config_params(cache_cfg) if cls is not None else {}))


def same_spec(a: Optional[Mapping[str, Any]], b: Optional[Mapping[str, Any]]) -> bool:
    return (a or {}).get("name") == (b or {}).get("name") and \
        dict((a or {}).get("params") or {}) == dict((b or {}).get("params") or {})
