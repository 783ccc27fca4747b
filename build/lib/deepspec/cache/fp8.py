"""The ``fp8`` lossy codec: float8 e4m3 with one scale per feature channel.

``scale_c = margin * max_abs_c / 448`` over the calibration sample; values beyond the calibrated
range saturate at ±448·scale (never NaN).  Bytes are stored channel-major and zstd'ed, decoded
to bf16 on read.  The shared lossy parts and the fp8 arithmetic are `lossy`.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import numpy as np
import torch

from .codecs import register_codec, zstd_compress, zstd_decompress
from .errors import CacheCorruptError, CacheError
from .lossy import (LossyCodec, channel_major_bytes, finite_f32, fp8_dequantize, fp8_quantize, fp8_scales,
                    from_channel_major)


@register_codec("fp8")
class FP8Codec(LossyCodec):
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
        return zstd_compress(channel_major_bytes(fp8_quantize(x, self.scale)), self.level)

    def _decode_features(self, blob, shape, what) -> torch.Tensor:
        t, d = shape
        if d != self.scale.numel():
            raise CacheCorruptError(f"{what}: width {d} != codec state {self.scale.numel()}")
        raw = zstd_decompress(blob, t * d, what)
        return fp8_dequantize(from_channel_major(raw, shape), self.scale).to(torch.bfloat16)

    def state_arrays(self) -> Dict[str, np.ndarray]:
        self._need_state()
        return {**self._common_state(), "scale": self.scale.numpy().astype(np.float32)}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        if not arrays:
            raise CacheCorruptError("fp8 codec: the manifest declares no codec_state (scales missing)")
        self._load_common(arrays, {"scale"})
        sc = finite_f32(arrays["scale"], "scale")
        if sc.size % self.hidden_size or (sc <= 0).any():
            raise CacheCorruptError("codec_state.arrow: bad fp8 scales")
        self.scale = torch.from_numpy(sc.copy())

    def decoder_arrays(self) -> Dict[str, Any]:
        return {"scale": self.scale}
