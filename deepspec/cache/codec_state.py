"""A lossy codec's fitted state: fit it on a calibration sample, measure its error, store it.

`prepare_codec_state` captures the first ``cache.calib_tokens`` tokens of the regen JSONL
exactly as the build does, calibrates the codec, measures the per-layer reconstruction error
through the real encode → decode path (`reconstruction_error`, kept in the manifest as
``codec_error`` and printed by `format_error_report`) and writes ``codec_state.arrow``
(`state_to_bytes`: Arrow IPC, one list column per array, never a pickle); on resume it
reloads that file instead.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch

from .codecs import Codec
from .errors import CacheCorruptError, CacheError

log = logging.getLogger(__name__)


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
