"""The ``lowrank`` lossy codec: per-layer centred PCA of the features, coefficients bf16 or fp8.

Per layer ``l`` (each ``H``-wide slice of ``features``): ``x ≈ W_l z + μ_l`` with ``W_l``
``[H, r]`` orthonormal, fitted on the calibration sample; `decoder_arrays()` exposes ``W`` and
``μ`` so a drafter's input projection can absorb the decoder.  Overview and shared parts: `lossy`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

import numpy as np
import torch

from .codecs import register_codec, zstd_compress, zstd_decompress
from .errors import CacheCorruptError, CacheError
from .lossy import (LossyCodec, channel_major_bytes, finite_f32, fp8_dequantize, fp8_quantize, fp8_scales,
                    from_channel_major)


@register_codec("lowrank")
class LowRankCodec(LossyCodec):
    """Per-layer centred PCA to ``rank`` components; coefficients bf16 (or fp8) + zstd."""

    COEFS = ("bf16", "fp8")

    def __init__(self, rank: int = 256, coef: str = "bf16", **kw):
        super().__init__(**kw)
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            raise CacheError(f"lowrank codec: rank {rank!r} must be a positive int")
        if coef not in self.COEFS:
            raise CacheError(f"lowrank codec: coef {coef!r} is not one of {self.COEFS}")
        self.rank = int(rank)
        self.coef = coef
        self.basis: Optional[torch.Tensor] = None   # [L, H, r] float32, orthonormal columns
        self.mean: Optional[torch.Tensor] = None    # [L, H] float32
        self.coef_scale: Optional[torch.Tensor] = None  # [L*r] (coef=fp8)
        self.tail_energy: Optional[List[float]] = None  # per layer: Σ_{i>r} σ_i² / Σ‖x‖² (calibration)

    @classmethod
    def config_params(cls, cache_cfg) -> Dict[str, Any]:
        return {**super().config_params(cache_cfg), "rank": int(cache_cfg.rank),
                "coef": str(getattr(cache_cfg, "lowrank_coef", "bf16"))}

    def params(self) -> Dict[str, Any]:
        return {"rank": self.rank, "coef": self.coef, **self._base_params()}

    @property
    def num_layers(self) -> int:
        return int(self.basis.shape[0])

    def _fit(self, x: torch.Tensor) -> None:
        h = self.hidden_size
        L = x.shape[1] // h
        if self.rank > h:
            raise CacheError(f"lowrank codec: rank {self.rank} exceeds the hidden size {h}")
        if x.shape[0] < self.rank:
            raise CacheError(f"lowrank codec: {x.shape[0]} calibration tokens < rank {self.rank}; "
                             f"raise cache.calib_tokens or lower cache.rank")
        bases, means, tails = [], [], []
        for l in range(L):
            xl = x[:, l * h:(l + 1) * h].double()
            mu = xl.mean(0)
            # eigen-decomposition of the centred Gram matrix (H × H): same basis as the SVD
            c = xl - mu
            gram = c.T @ c
            evals, evecs = torch.linalg.eigh(gram)
            order = torch.argsort(evals, descending=True)
            evals, evecs = evals[order].clamp_min(0), evecs[:, order]
            bases.append(evecs[:, : self.rank].float())
            means.append(mu.float())
            tails.append(float(evals[self.rank:].sum() / (xl * xl).sum().clamp_min(1e-30)))
        self.basis = torch.stack(bases)
        self.mean = torch.stack(means)
        self.tail_energy = tails
        if self.coef == "fp8":
            z = self._project(x)
            self.coef_scale = fp8_scales(z.abs().amax(0), self.margin)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """[T, L*H] → coefficients [T, L*r] (float32)."""
        t = x.shape[0]
        L, h, r = self.basis.shape
        if x.shape[1] != L * h:
            raise ValueError(f"lowrank codec: width {x.shape[1]} != calibrated {L * h}")
        xl = x.float().reshape(t, L, h) - self.mean
        return torch.einsum("tlh,lhr->tlr", xl, self.basis).reshape(t, L * r)

    def reconstruct(self, z: torch.Tensor) -> torch.Tensor:
        """Coefficients [T, L*r] → features [T, L*H] (float32)."""
        t = z.shape[0]
        L, h, r = self.basis.shape
        return (torch.einsum("tlr,lhr->tlh", z.float().reshape(t, L, r), self.basis) + self.mean).reshape(t, L * h)

    def _encode_features(self, x: torch.Tensor) -> bytes:
        z = self._project(x)
        if self.coef == "fp8":
            return zstd_compress(channel_major_bytes(fp8_quantize(z, self.coef_scale)), self.level)
        return self.bf16.encode(z.to(torch.bfloat16), "features")

    def decode_coefficients(self, blob, t: int, what: str = "features") -> torch.Tensor:
        """The stored coefficients ``z`` [T, L*r] (float32) without reconstruction."""
        L, _, r = self.basis.shape
        if self.coef == "fp8":
            raw = zstd_decompress(blob, t * L * r, what)
            return fp8_dequantize(from_channel_major(raw, (t, L * r)), self.coef_scale)
        return self.bf16.decode(blob, (t, L * r), what).float()

    def _decode_features(self, blob, shape, what) -> torch.Tensor:
        t, d = shape
        L, h, _ = self.basis.shape
        if d != L * h:
            raise CacheCorruptError(f"{what}: width {d} != codec state {L * h}")
        return self.reconstruct(self.decode_coefficients(blob, t, what)).to(torch.bfloat16)

    def state_arrays(self) -> Dict[str, np.ndarray]:
        self._need_state()
        L, h, r = self.basis.shape
        out = {**self._common_state(), "basis": self.basis.numpy().astype(np.float32).reshape(-1),
               "mean": self.mean.numpy().astype(np.float32).reshape(-1),
               "shape": np.asarray([L, h, r], dtype=np.int64)}
        if self.coef == "fp8":
            out["coef_scale"] = self.coef_scale.numpy().astype(np.float32)
        return out

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        if not arrays:
            raise CacheCorruptError("lowrank codec: the manifest declares no codec_state (basis missing)")
        self._load_common(arrays, {"basis", "mean", "shape"} | ({"coef_scale"} if self.coef == "fp8" else set()))
        shp = np.asarray(arrays["shape"]).reshape(-1)
        if shp.size != 3:
            raise CacheCorruptError("codec_state.arrow: bad lowrank shape")
        L, h, r = (int(v) for v in shp)
        if L <= 0 or h != self.hidden_size or r != self.rank:
            raise CacheCorruptError(f"codec_state.arrow: basis shape {(L, h, r)} does not fit rank {self.rank} "
                                    f"/ hidden {self.hidden_size}")
        basis = finite_f32(arrays["basis"], "basis")
        mean = finite_f32(arrays["mean"], "mean")
        if basis.size != L * h * r or mean.size != L * h:
            raise CacheCorruptError("codec_state.arrow: basis/mean sizes do not match their shape")
        self.basis = torch.from_numpy(basis.copy()).reshape(L, h, r)
        self.mean = torch.from_numpy(mean.copy()).reshape(L, h)
        if self.coef == "fp8":
            cs = finite_f32(arrays["coef_scale"], "coef_scale")
            if cs.size != L * r or (cs <= 0).any():
                raise CacheCorruptError("codec_state.arrow: bad coef_scale")
            self.coef_scale = torch.from_numpy(cs.copy())

    def decoder_arrays(self) -> Dict[str, Any]:
        """``W`` [L, H, r] (orthonormal columns) and ``mu`` [L, H]: layer l's features are
        ``z[:, l*r:(l+1)*r] @ W[l].T + mu[l]``."""
        return {"W": self.basis, "mu": self.mean, "rank": self.rank, "num_layers": self.num_layers,
                "hidden_size": self.hidden_size}
