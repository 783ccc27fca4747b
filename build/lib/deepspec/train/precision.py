"""Whether a run computes in bf16 (autocast; parameters and optimizer state stay fp32)."""
from __future__ import annotations

from typing import Optional

import torch


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX tiles: bf16 matmuls run ~4x faster than fp32 (measured on a Xeon with AMX:
    [448 x 576] @ [576 x 49152] 0.21 s fp32 vs 0.056 s bf16 on one thread); without them bf16 is slower."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool((probe and probe()) or (amx and amx()))


def use_bf16(flag: Optional[bool], device: torch.device) -> bool:
    """``train.bf16``: true / false, or null = auto (bf16 where the device computes it natively)."""
    if device.type == "cuda":
        return flag is not False and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return cpu_has_native_bf16() if flag is None else bool(flag)
    return bool(flag)
