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
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import numpy as np
import torch

from .codecs import BF16Codec, Codec, register_codec, zstd_compress, zstd_decompress
from .errors import CacheCorruptError, CacheError

log = logging.getLogger(__name__)

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


@register_codec("lowrank")
class LowRankCodec(_LossyBase):
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
            return zstd_compress(_cm_bytes(fp8_quantize(z, self.coef_scale)), self.level)
        return self.bf16.encode(z.to(torch.bfloat16), "features")

    def decode_coefficients(self, blob, t: int, what: str = "features") -> torch.Tensor:
        """The stored coefficients ``z`` [T, L*r] (float32) without reconstruction."""
        L, _, r = self.basis.shape
        if self.coef == "fp8":
            raw = zstd_decompress(blob, t * L * r, what)
            return fp8_dequantize(_from_cm(raw, (t, L * r)), self.coef_scale)
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
        basis = _finite_f32(arrays["basis"], "basis")
        mean = _finite_f32(arrays["mean"], "mean")
        if basis.size != L * h * r or mean.size != L * h:
            raise CacheCorruptError("codec_state.arrow: basis/mean sizes do not match their shape")
        self.basis = torch.from_numpy(basis.copy()).reshape(L, h, r)
        self.mean = torch.from_numpy(mean.copy()).reshape(L, h)
        if self.coef == "fp8":
            cs = _finite_f32(arrays["coef_scale"], "coef_scale")
            if cs.size != L * r or (cs <= 0).any():
                raise CacheCorruptError("codec_state.arrow: bad coef_scale")
            self.coef_scale = torch.from_numpy(cs.copy())

    def decoder_arrays(self) -> Dict[str, Any]:
        """``W`` [L, H, r] (orthonormal columns) and ``mu`` [L, H]: layer l's features are
        ``z[:, l*r:(l+1)*r] @ W[l].T + mu[l]``."""
        return {"W": self.basis, "mu": self.mean, "rank": self.rank, "num_layers": self.num_layers,
                "hidden_size": self.hidden_size}


# -- config, error measurement, state file ----------------------------------------------------------
def params_from_config(name: str, cache_cfg) -> Dict[str, Any]:
    p: Dict[str, Any] = {"level": int(cache_cfg.zstd_level), "layout": str(cache_cfg.layout),
                         "last_hidden": str(getattr(cache_cfg, "last_hidden_codec", "bf16")),
                         "margin": float(getattr(cache_cfg, "fp8_margin", 1.25))}
    if name == "lowrank":
        p["rank"] = int(cache_cfg.rank)
        p["coef"] = str(getattr(cache_cfg, "lowrank_coef", "bf16"))
    return p


def reconstruction_error(codec: Codec, feats: torch.Tensor, last: Optional[torch.Tensor],
                         hidden_size: int, layer_ids: Optional[List[int]] = None,
                         chunk: int = 1024) -> Dict[str, Any]:
    """Per-layer relative MSE and mean token cosine of encode → decode on ``feats`` [N, L*H]."""
    L = feats.shape[1] // hidden_size
    se = torch.zeros(L, dtype=torch.float64)
    energy = torch.zeros(L, dtype=torch.float64)
    cos_sum = torch.zeros(L, dtype=torch.float64)
    lh = {"se": 0.0, "energy": 0.0, "cos": 0.0}
    n = feats.shape[0]
    for a in range(0, n, chunk):
        x = feats[a:a + chunk]
        y = codec.decode(codec.encode(x, "features"), tuple(x.shape), "features").float()
        xr = x.float().reshape(-1, L, hidden_size)
        yr = y.reshape(-1, L, hidden_size)
        se += ((xr - yr).double() ** 2).sum((0, 2))
        energy += (xr.double() ** 2).sum((0, 2))
        cos_sum += torch.nn.functional.cosine_similarity(xr, yr, dim=-1, eps=1e-12).double().sum(0)
        if last is not None:
            xl = last[a:a + chunk]
            yl = codec.decode(codec.encode(xl, "last_hidden"), tuple(xl.shape), "last_hidden").float()
            xl = xl.float()
            lh["se"] += float(((xl - yl).double() ** 2).sum())
            lh["energy"] += float((xl.double() ** 2).sum())
            lh["cos"] += float(torch.nn.functional.cosine_similarity(xl, yl, dim=-1, eps=1e-12).double().sum())
    ids = list(layer_ids) if layer_ids else list(range(L))
    layers = [{"layer_id": int(ids[l]), "rel_mse": float(se[l] / energy[l].clamp_min(1e-30)),
               "cosine": float(cos_sum[l] / max(n, 1))} for l in range(L)]
    out: Dict[str, Any] = {"measured_on": "calibration sample (bf16 capture → encode → decode)",
                           "tokens": int(n), "features": layers}
    tails = getattr(codec, "tail_energy", None)
    if tails:
        for l, t in enumerate(tails):
            layers[l]["svd_tail_energy"] = float(t)
    if last is not None:
        out["last_hidden"] = {"rel_mse": lh["se"] / max(lh["energy"], 1e-30), "cosine": lh["cos"] / max(n, 1)}
    return out


def state_to_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """Arrow IPC file: one single-row list column per array (what `CacheReader` loads)."""
    import pyarrow as pa
    names = sorted(arrays)
    cols = []
    for k in names:
        a = np.ascontiguousarray(np.asarray(arrays[k]).reshape(-1))
        cols.append(pa.array([a], type=pa.list_(pa.from_numpy_dtype(a.dtype))))
    table = pa.table(cols, names=names)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def state_from_bytes(data: bytes, what: str) -> Dict[str, np.ndarray]:
    import pyarrow as pa
    try:
        table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
        return {k: np.asarray(table.column(k).combine_chunks().flatten().to_numpy(zero_copy_only=False))
                for k in table.column_names}
    except (pa.ArrowException, OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise CacheCorruptError(f"{what}: {e}") from None


def _calibration_sample(cfg, target, src: Path, calib_tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Features / last_hidden of the first records (in input order) until ``calib_tokens`` tokens."""
    from .samples import _batches, _capture, _pad_id, _tokenize
    max_len = int(cfg.data.max_length)
    feats, lasts, got = [], [], 0
    records: List[Tuple[int, bytes]] = []
    with open(src, "rb") as f:
        for i, line in enumerate(f):
            if line.strip():
                records.append((i, line))
            if len(records) * max_len >= 4 * calib_tokens + max_len or len(records) >= 4096:
                break
    skipped: List[Dict[str, Any]] = []
    items = _tokenize(target, records, src, max_len, "skip", skipped)
    chosen, tot = [], 0
    for it in items:                       # input order: the first records up to calib_tokens
        if tot >= calib_tokens:
            break
        chosen.append(it)
        tot += len(it["ids"])
    if not chosen:
        raise CacheError(f"{src}: no usable record for the codec calibration")
    pad = _pad_id(target)
    for batch in _batches(chosen, max(1, int(cfg.cache.batch_tokens))):
        f_, l_ = _capture(target, batch, pad)
        for b, it in enumerate(batch):
            t = len(it["ids"])
            feats.append(f_[b, :t])
            lasts.append(l_[b, :t])
            got += t
    return torch.cat(feats)[:calib_tokens], torch.cat(lasts)[:calib_tokens]


def prepare_codec_state(cfg, target, codec: Codec, src: Path, out: Path, old: Optional[Dict[str, Any]],
                        rank: int = 0) -> Dict[str, Any]:
    """Fit (or, on resume, reload) a lossy codec's state; writes ``codec_state.arrow``.

    Returns the build.json entries ``codec_state`` (file + sha256) and ``codec_error``."""
    from .format import CODEC_STATE, atomic_write_bytes, sha256_bytes
    p = out / CODEC_STATE
    if old and isinstance(old.get("codec_state"), dict) and p.is_file():
        data = p.read_bytes()
        if sha256_bytes(data) == old["codec_state"].get("sha256"):
            codec.load_state_arrays(state_from_bytes(data, str(p)))
            log.info("codec %s: reusing the calibration in %s", codec.name, p)
            return {"codec_state": old["codec_state"], "codec_error": old.get("codec_error")}
        raise CacheCorruptError(f"{p}: sha256 differs from build.json; delete {out} and rebuild")
    n = int(cfg.cache.calib_tokens)
    if n <= 0:
        raise CacheError(f"cache.calib_tokens must be positive, got {n}")
    feats, lasts = _calibration_sample(cfg, target, src, n)
    codec.calibrate([{"features": feats, "last_hidden": lasts}], hidden_size=int(target.hidden_size))
    data = state_to_bytes(codec.state_arrays())
    err = reconstruction_error(codec, feats, lasts, int(target.hidden_size), list(target.layer_ids))
    atomic_write_bytes(p, data, tag=f"r{rank}-")
    log.info("codec %s calibrated on %d tokens: features rel. MSE %s", codec.name, feats.shape[0],
             ", ".join(f"{e['rel_mse']:.2e}" for e in err["features"]))
    return {"codec_state": {"file": CODEC_STATE, "sha256": sha256_bytes(data), "bytes": len(data)},
            "codec_error": err}


def format_error_report(m: Mapping[str, Any]) -> List[str]:
    """Lines for ``deepspec cache info``."""
    err = m.get("codec_error")
    if not isinstance(err, dict) or not isinstance(err.get("features"), list):
        return []
    lines = [f"reconstruction   measured at build time on {err.get('tokens')} calibration tokens"]
    for e in err["features"]:
        if not isinstance(e, dict):
            continue
        tail = f"  (SVD tail energy {e['svd_tail_energy']:.3e})" if "svd_tail_energy" in e else ""
        lines.append(f"  layer {e.get('layer_id')!s:>4}   rel. MSE {float(e.get('rel_mse', float('nan'))):.3e}   "
                     f"cosine {float(e.get('cosine', float('nan'))):.5f}{tail}")
    lh = err.get("last_hidden")
    if isinstance(lh, dict):
        lines.append(f"  last_hidden  rel. MSE {float(lh.get('rel_mse', float('nan'))):.3e}   "
                     f"cosine {float(lh.get('cosine', float('nan'))):.5f}")
    return lines
