"""The ``fp8`` lossy codec, the fp8 arithmetic it shares, and `_LossyBase` (what both lossy codecs share).

``fp8``: float8 e4m3 (``torch.float8_e4m3fn``, max 448) with one scale per feature channel,
``scale_c = margin * max_abs_c / 448`` over the calibration sample; values beyond the calibrated
range saturate at ±448·scale (never NaN).  Bytes are stored channel-major and zstd'ed, decoded
to bf16 on read.  `_LossyBase` holds the lossless (bf16) or fp8 ``last_hidden`` column, the
calibration entry point and the checks on a loaded ``codec_state.arrow``.  Overview: `lossy`.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

import numpy as np
import torch

from .codecs import BF16Codec, Codec, register_codec, zstd_compress, zstd_decompress
from .errors import CacheCorruptError, CacheError

FP8_MAX = 448.0                      # largest finite float8_e4m3fn
_FP8 = torch.float8_e4m3fn
LAST_HIDDEN_MODES = ("bf16", "fp8")


# -- fp8 helpers ----------------------------------------------------------------------------------
def fp8_scales(max_abs: torch.Tensor, margin: float) -> torch.Tensor:
    """Per-channel scales (float32): ``margin * max_abs / 448``; dead channels get scale 1."""
    s = max_abs.float() * float(margin) / FP8_MAX
    return torch.where(s > 0, s, torch.ones_like(s))


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` → e4m3 (saturating), returned as uint8 bits."""
    y = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX)
    return y.to(_FP8).view(torch.uint8)


def fp8_dequantize(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return bits.view(_FP8).float() * scale


def _cm_bytes(u8: torch.Tensor) -> bytes:
    """[T, D] uint8 → channel-major bytes."""
    return np.ascontiguousarray(u8.cpu().numpy().T).tobytes()


def _from_cm(raw, shape: Tuple[int, int]) -> torch.Tensor:
    t, d = shape
    a = np.frombuffer(raw, dtype=np.uint8).reshape(d, t)
    return torch.from_numpy(np.ascontiguousarray(a.T))


class _LossyBase(Codec):
    """Shared parts: lossless (or fp8) ``last_hidden``, calibration bookkeeping, state checks."""

    lossless = False
    needs_calibration = True

    def __init__(self, last_hidden: str = "bf16", level: int = 1, layout: str = "planes_cm",
                 margin: float = 1.25):
        if last_hidden not in LAST_HIDDEN_MODES:
            raise CacheError(f"{self.name} codec: last_hidden={last_hidden!r} is not one of {LAST_HIDDEN_MODES}")
        if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not 1.0 <= margin <= 16.0:
            raise CacheError(f"{self.name} codec: margin {margin!r} must be a number in [1, 16]")
        self.last_hidden_mode = last_hidden
        self.margin = float(margin)
        self.bf16 = BF16Codec(layout=layout, level=level)   # validates layout + level
        self.level = self.bf16.level
        self.layout = self.bf16.layout
        self.hidden_size: Optional[int] = None
        self.lh_scale: Optional[torch.Tensor] = None
        self._state_checked = False

    def _base_params(self) -> Dict[str, Any]:
        return {"last_hidden": self.last_hidden_mode, "level": self.level, "layout": self.layout,
                "margin": self.margin}

    @property
    def calibrated(self) -> bool:
        return self.hidden_size is not None

    def _need_state(self) -> None:
        if not self.calibrated:
            raise CacheError(f"codec {self.name!r} has no fitted state: calibrate it (build) or load "
                             f"codec_state.arrow (reader)")

    # last_hidden ------------------------------------------------------------------------------
    def _encode_last(self, x: torch.Tensor) -> bytes:
        if self.last_hidden_mode == "bf16":
            return self.bf16.encode(x, "last_hidden")
        self._need_state()
        return zstd_compress(_cm_bytes(fp8_quantize(x.cpu(), self.lh_scale)), self.level)

    def _decode_last(self, blob, shape, what) -> torch.Tensor:
        if self.last_hidden_mode == "bf16":
            return self.bf16.decode(blob, shape, what)
        self._need_state()
        t, d = shape
        if d != self.lh_scale.numel():
            raise CacheCorruptError(f"{what}: width {d} != codec state {self.lh_scale.numel()}")
        raw = zstd_decompress(blob, t * d, what)
        return fp8_dequantize(_from_cm(raw, shape), self.lh_scale).to(torch.bfloat16)

    def encode(self, x: torch.Tensor, column: str = "features") -> bytes:
        if x.dim() != 2:
            raise ValueError(f"{self.name} codec encodes [T, D] tensors, got shape {tuple(x.shape)}")
        if column == "last_hidden":
            return self._encode_last(x)
        self._need_state()
        return self._encode_features(x.detach().cpu())

    def decode(self, blob, shape: Tuple[int, int], column: str = "features") -> torch.Tensor:
        if "last_hidden" in column:
            return self._decode_last(blob, shape, column)
        self._need_state()
        return self._decode_features(blob, shape, column)

    # calibration --------------------------------------------------------------------------------
    def calibrate(self, samples: Iterable[Dict[str, torch.Tensor]], hidden_size: Optional[int] = None) -> None:
        feats, lasts = [], []
        for s in samples:
            feats.append(s["features"].float().cpu())
            if s.get("last_hidden") is not None:
                lasts.append(s["last_hidden"].float().cpu())
        if not feats:
            raise CacheError(f"codec {self.name!r}: empty calibration sample")
        x = torch.cat(feats)
        h = int(hidden_size or (lasts[0].shape[1] if lasts else 0))
        if h <= 0 or x.shape[1] % h:
            raise CacheError(f"codec {self.name!r}: feature dim {x.shape[1]} is not a multiple of "
                             f"hidden size {h}")
        self.hidden_size = h
        if self.last_hidden_mode == "fp8":
            if not lasts:
                raise CacheError(f"codec {self.name!r}: last_hidden=fp8 needs last_hidden in the calibration")
            self.lh_scale = fp8_scales(torch.cat(lasts).abs().amax(0), self.margin)
        self._fit(x)

    def _common_state(self) -> Dict[str, np.ndarray]:
        out = {"hidden_size": np.asarray([self.hidden_size], dtype=np.int64)}
        if self.lh_scale is not None:
            out["last_hidden_scale"] = self.lh_scale.numpy().astype(np.float32)
        return out

    def _load_common(self, arrays: Mapping[str, np.ndarray], allowed: set) -> None:
        need = set(allowed) | {"hidden_size"} | ({"last_hidden_scale"} if self.last_hidden_mode == "fp8" else set())
        got = set(arrays)
        if got != need:
            raise CacheCorruptError(f"codec_state.arrow: codec {self.name!r} expects arrays {sorted(need)}, "
                                    f"found {sorted(got)}")
        hs = np.asarray(arrays["hidden_size"]).reshape(-1)
        if hs.size != 1 or int(hs[0]) <= 0:
            raise CacheCorruptError("codec_state.arrow: bad hidden_size")
        self.hidden_size = int(hs[0])
        if self.last_hidden_mode == "fp8":
            sc = _finite_f32(arrays["last_hidden_scale"], "last_hidden_scale")
            if sc.size != self.hidden_size or (sc <= 0).any():
                raise CacheCorruptError("codec_state.arrow: bad last_hidden_scale")
            self.lh_scale = torch.from_numpy(sc.copy())

    # subclass hooks -------------------------------------------------------------------------------
    def _fit(self, x: torch.Tensor) -> None:
        raise NotImplementedError

    def _encode_features(self, x: torch.Tensor) -> bytes:
        raise NotImplementedError

    def _decode_features(self, blob, shape, what) -> torch.Tensor:
        raise NotImplementedError

    def decoder_arrays(self) -> Dict[str, Any]:
        return {}


def _finite_f32(a, what: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.float32:
        raise CacheCorruptError(f"codec_state.arrow: {what} must be float32, got {a.dtype}")
    if not np.isfinite(a).all():
        raise CacheCorruptError(f"codec_state.arrow: {what} holds non-finite values")
    return a


@register_codec("fp8")
class FP8Codec(_LossyBase):
    """float8 e4m3 with per-feature-channel scales (max-abs/448 × margin), channel-major + zstd."""

    def __init__(self, format: str = "e4m3fn", **kw):
        super().__init__(**kw)
        if format != "e4m3fn":
            raise CacheError(f"fp8 codec: format {format!r} is not supported (only 'e4m3fn')")
        self.scale: Optional[torch.Tensor] = None

    def params(self) -> Dict[str, Any]:
        return {"format": "e4m3fn", **self._base_params()}

    def _fit(self, x: torch.Tensor) -> None:
        self.scale = fp8_scales(x.abs().amax(0), self.margin)

    def _encode_features(self, x: torch.Tensor) -> bytes:
        if x.shape[1] != self.scale.numel():
            raise ValueError(f"fp8 codec: width {x.shape[1]} != calibrated {self.scale.numel()}")
        return zstd_compress(_cm_bytes(fp8_quantize(x, self.scale)), self.level)

    def _decode_features(self, blob, shape, what) -> torch.Tensor:
        t, d = shape
        if d != self.scale.numel():
            raise CacheCorruptError(f"{what}: width {d} != codec state {self.scale.numel()}")
        raw = zstd_decompress(blob, t * d, what)
        return fp8_dequantize(_from_cm(raw, shape), self.scale).to(torch.bfloat16)

    def state_arrays(self) -> Dict[str, np.ndarray]:
        self._need_state()
        return {**self._common_state(), "scale": self.scale.numpy().astype(np.float32)}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        if not arrays:
            raise CacheCorruptError("fp8 codec: the manifest declares no codec_state (scales missing)")
        self._load_common(arrays, {"scale"})
        sc = _finite_f32(arrays["scale"], "scale")
        if sc.size % self.hidden_size or (sc <= 0).any():
            raise CacheCorruptError("codec_state.arrow: bad fp8 scales")
        self.scale = torch.from_numpy(sc.copy())

    def decoder_arrays(self) -> Dict[str, Any]:
        return {"scale": self.scale}
