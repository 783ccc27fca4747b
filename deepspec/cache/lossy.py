"""Lossy codecs for the cached ``features`` tensor: ``fp8`` and ``lowrank``.

Both are fitted on a calibration sample (the first ``cache.calib_tokens`` tokens of the
regen JSONL, captured exactly as the build captures them) and store their fitted state in
``codec_state.arrow`` (Arrow IPC, one list column per array, sha256 in the manifest; never a
pickle).  ``last_hidden`` (it defines the target distribution of the TV/CE losses) stays
lossless bf16 by default (`BF16Codec`, ``planes_cm`` + zstd); ``last_hidden=fp8`` compresses
it too, with its own per-channel scales.

``fp8``
    float8 e4m3 (``torch.float8_e4m3fn``, max 448) with one scale per feature channel:
    ``scale_c = margin * max_abs_c / 448`` over the calibration sample; values beyond the
    calibrated range saturate at ±448·scale (never NaN).  Bytes are stored channel-major
    (each channel over time side by side) and zstd'ed.  Decoded to bf16 on read.

``lowrank``
    Per layer ``l`` (each ``H``-wide slice of ``features``) a centred PCA fitted on the
    calibration sample: ``x ≈ W_l z + μ_l`` with ``W_l`` ``[H, r]`` orthonormal (top ``r``
    right singular vectors of ``X_l − μ_l``) and ``z = W_lᵀ (x − μ_l)``.  Coefficients ``z``
    are stored in bf16 (``planes_cm`` + zstd) or fp8 with per-coefficient scales
    (``coef=fp8``).  The reader reconstructs ``W_l z + μ_l`` by default; `decoder_arrays()`
    exposes ``W`` and ``μ`` so a drafter's input projection can absorb the decoder:
    ``fc(W z + μ) = (fc·W) z + fc·μ`` (see docs/cache.md).

Reconstruction error per layer (relative MSE ``Σ(x−x̂)²/Σx²`` and mean per-token cosine
similarity), measured at build time on the calibration sample through the real
encode → decode path, is written into the manifest (``codec_error``) and printed by
``deepspec cache info``.

This module holds what both lossy codecs share: the fp8 arithmetic and `LossyCodec` (the
lossless or fp8 ``last_hidden`` column, calibration, checks on a loaded ``codec_state.arrow``).
The codecs themselves are `fp8.FP8Codec` and `lowrank.LowRankCodec`; calibration at build time
is `deepspec.cache.calibrate`, the error measurement `codec_error`.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

import numpy as np
import torch

from .codecs import BF16Codec, Codec, zstd_compress, zstd_decompress
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


def channel_major_bytes(u8: torch.Tensor) -> bytes:
    """[T, D] uint8 → channel-major bytes."""
    return np.ascontiguousarray(u8.cpu().numpy().T).tobytes()


def from_channel_major(raw, shape: Tuple[int, int]) -> torch.Tensor:
    t, d = shape
    a = np.frombuffer(raw, dtype=np.uint8).reshape(d, t)
    return torch.from_numpy(np.ascontiguousarray(a.T))


class LossyCodec(Codec):
    """Shared parts: lossless (or fp8) ``last_hidden``, calibration bookkeeping, state checks."""

    lossless = False
    needs_calibration = True

    @classmethod
    def config_params(cls, cache_cfg) -> Dict[str, Any]:
        return {"level": int(cache_cfg.zstd_level), "layout": str(cache_cfg.layout),
                "last_hidden": str(getattr(cache_cfg, "last_hidden_codec", "bf16")),
                "margin": float(getattr(cache_cfg, "fp8_margin", 1.25))}

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
        return zstd_compress(channel_major_bytes(fp8_quantize(x.cpu(), self.lh_scale)), self.level)

    def _decode_last(self, blob, shape, what) -> torch.Tensor:
        if self.last_hidden_mode == "bf16":
            return self.bf16.decode(blob, shape, what)
        self._need_state()
        t, d = shape
        if d != self.lh_scale.numel():
            raise CacheCorruptError(f"{what}: width {d} != codec state {self.lh_scale.numel()}")
        raw = zstd_decompress(blob, t * d, what)
        return fp8_dequantize(from_channel_major(raw, shape), self.lh_scale).to(torch.bfloat16)

    @property
    def last_hidden_lossless(self) -> bool:
        return self.last_hidden_mode == "bf16"

    def stored_last_hidden(self, x: torch.Tensor) -> torch.Tensor:
        if self.last_hidden_mode == "bf16":
            return super().stored_last_hidden(x)
        self._need_state()
        # back on x's device: the target computes its lse there
        return fp8_dequantize(fp8_quantize(x.cpu(), self.lh_scale), self.lh_scale).to(x.device, torch.bfloat16)

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
            sc = finite_f32(arrays["last_hidden_scale"], "last_hidden_scale")
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


def finite_f32(a, what: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.float32:
        raise CacheCorruptError(f"codec_state.arrow: {what} must be float32, got {a.dtype}")
    if not np.isfinite(a).all():
        raise CacheCorruptError(f"codec_state.arrow: {what} holds non-finite values")
    return a
