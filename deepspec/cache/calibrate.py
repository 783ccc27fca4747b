"""Fit a lossy codec's state before the build: calibrate on the first tokens, measure, store.

`prepare_codec_state` captures the first ``cache.calib_tokens`` tokens of the regen JSONL
exactly as the build does (`calibration_sample`), calibrates the codec, measures its per-layer
reconstruction error (`deepspec.cache.reconstruction`) and writes ``codec_state.arrow``
(`deepspec.cache.format.state_to_bytes`: Arrow IPC, never a pickle); on resume it reloads that
file instead.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..cache.reconstruction import reconstruction_error
from ..cache.codecs import Codec
from ..cache.errors import CacheCorruptError, CacheError
from ..cache.format import CODEC_STATE, atomic_write_bytes, sha256_bytes, state_from_bytes, state_to_bytes
from .capture import capture_batch, length_batches, pad_token_id, tokenize_records

log = logging.getLogger(__name__)


def calibration_sample(cfg, target, src: Path, calib_tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Features / last_hidden of the first records (in input order) until ``calib_tokens`` tokens."""
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
    items = tokenize_records(target, records, src, max_len, "skip", skipped)
    chosen, tot = [], 0
    for it in items:                       # input order: the first records up to calib_tokens
        if tot >= calib_tokens:
            break
        chosen.append(it)
        tot += len(it["ids"])
    if not chosen:
        raise CacheError(f"{src}: no usable record for the codec calibration")
    pad = pad_token_id(target)
    for batch in length_batches(chosen, max(1, int(cfg.cache.batch_tokens))):
        f_, l_, _ = capture_batch(target, batch, pad)
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
    reused = reload_codec_state(codec, out, old)
    if reused is not None:
        return reused
    n = int(cfg.cache.calib_tokens)
    if n <= 0:
        raise CacheError(f"cache.calib_tokens must be positive, got {n}")
    feats, lasts = calibration_sample(cfg, target, src, n)
    return fit_codec_state(codec, feats, lasts, int(target.hidden_size), list(target.layer_ids), out, rank)


def reload_codec_state(codec: Codec, out: Path, old: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """On resume: load the state recorded in the old build.json into ``codec`` and return its
    build.json entries; None when there is none to reload (a damaged file is `CacheCorruptError`)."""
    p = out / CODEC_STATE
    if not (old and isinstance(old.get("codec_state"), dict) and p.is_file()):
        return None
    data = p.read_bytes()
    if sha256_bytes(data) != old["codec_state"].get("sha256"):
        raise CacheCorruptError(f"{p}: sha256 differs from build.json; delete {out} and rebuild")
    codec.load_state_arrays(state_from_bytes(data, str(p)))
    log.info("codec %s: reusing the calibration in %s", codec.name, p)
    return {"codec_state": old["codec_state"], "codec_error": old.get("codec_error")}


def fit_codec_state(codec: Codec, feats: torch.Tensor, lasts: torch.Tensor, hidden_size: int,
                    layer_ids: List[int], out: Path, rank: int = 0) -> Dict[str, Any]:
    """Calibrate ``codec`` on these tokens, measure its reconstruction error on them and write
    ``out/codec_state.arrow``; returns the build.json entries ``codec_state`` and ``codec_error``."""
    codec.calibrate([{"features": feats, "last_hidden": lasts}], hidden_size=hidden_size)
    data = state_to_bytes(codec.state_arrays())
    err = reconstruction_error(codec, feats, lasts, hidden_size, layer_ids)
    atomic_write_bytes(out / CODEC_STATE, data, tag=f"r{rank}-")
    log.info("codec %s calibrated on %d tokens: features rel. MSE %s", codec.name, feats.shape[0],
             ", ".join(f"{e['rel_mse']:.2e}" for e in err["features"]))
    return {"codec_state": {"file": CODEC_STATE, "sha256": sha256_bytes(data), "bytes": len(data)},
            "codec_error": err}
