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

The parts: `fp8` (fp8 arithmetic, the shared `_LossyBase`, `FP8Codec`), `lowrank`
(`LowRankCodec`), `codec_state` (calibration, error measurement, ``codec_state.arrow``);
importing this module registers both codecs, and every name stays importable from here.
"""
from __future__ import annotations

from typing import Any, Dict

from .codec_state import (format_error_report, prepare_codec_state, reconstruction_error,  # noqa: F401
                          state_from_bytes, state_to_bytes)
from .fp8 import FP8_MAX, LAST_HIDDEN_MODES, FP8Codec, fp8_dequantize, fp8_quantize, fp8_scales  # noqa: F401
from .lowrank import LowRankCodec  # noqa: F401


def params_from_config(name: str, cache_cfg) -> Dict[str, Any]:
    p: Dict[str, Any] = {"level": int(cache_cfg.zstd_level), "layout": str(cache_cfg.layout),
                         "last_hidden": str(getattr(cache_cfg, "last_hidden_codec", "bf16")),
                         "margin": float(getattr(cache_cfg, "fp8_margin", 1.25))}
    if name == "lowrank":
        p["rank"] = int(cache_cfg.rank)
        p["coef"] = str(getattr(cache_cfg, "lowrank_coef", "bf16"))
    return p
