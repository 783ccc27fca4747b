"""Re-encode a finished cache with another codec, without running the target again.

    deepspec cache transcode SRC DST [cache overrides…]      e.g. cache=fp8, or
                                                             cache.codec=lowrank cache.rank=64

The new cache holds the same samples, shards and token data as ``SRC``; only the ``features`` /
``last_hidden`` blobs are decoded and re-encoded (``input_ids``, ``loss_mask`` and ``target_lse``
are carried over as their values, so ``last_hidden`` must stay lossless: ``target_lse`` normalises its
logits, and a lossy ``last_hidden`` is refused).  A lossy codec is calibrated on the first ``cache.calib_tokens``
tokens of ``SRC`` in input order, as a build calibrates on the first regenerated records; its
reconstruction error goes into the manifest as usual.  Transcoding a lossless cache to ``fp8`` or
``lowrank`` therefore gives the cache a direct build would give, up to the bf16 rounding of the
calibration tokens, at a fraction of the cost (no target forward).

``DST`` is an ordinary cache (its manifest also records ``transcoded_from``); it resumes like a
build: committed shards are kept, a killed run's leftovers are redone, and a directory holding
another build is refused.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import torch
from tqdm.auto import tqdm

from ..cache.codecs import Codec, codec_from_config, encode_array
from ..cache.errors import CacheError
from ..cache.format import (BUILD_INFO, FORMAT_NAME, FORMAT_VERSION, MANIFEST, ShardWriter, atomic_write_json,
                            read_json, sidecar_name)
from .buildinfo import build_key, check_existing
from .calibrate import fit_codec_state, reload_codec_state
from .finalize import finalize_cache
from .reader import CacheReader
from .writer import cleanup_rank, remaining_shards, shard_meta

log = logging.getLogger(__name__)

_CARRIED = ("target", "layer_ids", "index_convention", "hidden_size", "feature_dim", "dtype", "max_length",
            "chat_template_kwargs", "shard_samples")


def transcode_info(src: CacheReader, codec: Codec) -> Dict[str, Any]:
    """build.json of the transcoded cache: the source's build with the new codec (and its own key)."""
    m = src.manifest
    info = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **{k: m[k] for k in _CARRIED},
            "codec": codec.spec(), "source_sha256": m["source"]["sha256"],
            "num_records": int(m["source"]["num_records"]), "num_shards": len(m["shards"])}
    info["build_key"] = build_key(info)
    info["source"] = m["source"].get("path")
    info["transcoded_from"] = {"path": str(src.path), "build_key": m["build_key"], "codec": m["codec"]}
    return info


def _calibration_tokens(src: CacheReader, n: int):
    """Features / last_hidden of the first samples (input order) until ``n`` tokens."""
    feats: List[torch.Tensor] = []
    lasts: List[torch.Tensor] = []
    got = 0
    for i in range(len(src)):
        if got >= n:
            break
        s = src[i]
        feats.append(s["features"])
        lasts.append(s["last_hidden"])
        got += s["features"].shape[0]
    if not feats:
        raise CacheError(f"{src.path}: no sample to calibrate the codec on")
    return torch.cat(feats)[:n], torch.cat(lasts)[:n]


def _rows(src: CacheReader, k: int, codec: Codec) -> Dict[str, Any]:
    """The source shard's sidecar and its samples re-encoded with ``codec``, in the source's row order."""
    sc = read_json(src.path / sidecar_name(k))
    if not isinstance(sc, dict) or not isinstance(sc.get("rows"), list):
        raise CacheError(f"{src.path / sidecar_name(k)}: not a shard sidecar (needed to transcode shard {k})")
    rows = []
    for r in sc["rows"]:
        i = int(np.searchsorted(src.sample_indices, int(r["sample_index"])))
        if i >= len(src) or int(src.sample_indices[i]) != int(r["sample_index"]):
            raise CacheError(f"{src.path / sidecar_name(k)}: sample {r['sample_index']} is not in the index")
        s = src[i]
        rows.append({"sample_index": int(src.sample_indices[i]), "id": src.sample_id(i),
                     "num_tokens": int(s["input_ids"].shape[0]), "num_loss_tokens": int(s["loss_mask"].sum()),
                     "input_ids": encode_array(s["input_ids"].numpy().astype("<i4")),
                     "loss_mask": encode_array(s["loss_mask"].numpy().astype(np.uint8)),
                     "features": codec.encode(s["features"], "features"),
                     "last_hidden": codec.encode(s["last_hidden"], "last_hidden"),
                     "target_lse": encode_array(s["target_lse"].numpy().astype("<f4"))})
    return {"sidecar": sc, "rows": rows}


def transcode_cache(src_dir, dst_dir, cache_cfg, progress: bool = True) -> Path:
    """Write ``dst_dir``: the cache in ``src_dir`` re-encoded with the codec of ``cache_cfg`` (a
    `CacheConfig`: codec and its parameters, ``calib_tokens``).  Returns ``dst_dir``."""
    src = CacheReader(src_dir)
    if not src.has_target_lse:
        raise CacheError(f"{src.path}: format version {src.format_version} stores no target_lse; rebuild it "
                         "with this deepspec before transcoding")
    out = Path(dst_dir)
    if out.resolve() == src.path.resolve():
        raise CacheError(f"{out}: the destination must be another directory than the source")
    codec = codec_from_config(cache_cfg)
    if not codec.last_hidden_lossless:
        raise CacheError(f"{out}: cache.last_hidden_codec={cache_cfg.last_hidden_codec} changes last_hidden, and "
                         f"target_lse (carried over from {src.path}) would no longer normalise its logits; build "
                         "this cache with `deepspec prepare` (it computes target_lse from the stored values), or "
                         "transcode with cache.last_hidden_codec=bf16")
    info = transcode_info(src, codec)
    out.mkdir(parents=True, exist_ok=True)
    old = check_existing(out, info)
    if (out / MANIFEST).is_file():
        log.info("cache %s is already complete", out)
        return out
    if codec.needs_calibration:
        info.update(_codec_state(src, codec, out, old, int(cache_cfg.calib_tokens)))
    if old is None or (codec.needs_calibration and "codec_state" not in old):
        atomic_write_json(out / BUILD_INFO, info, tag="r0-")
    cleanup_rank(out, 0)
    todo = remaining_shards(out, info, 0, 1)
    total = sum(src.manifest["shards"][k]["samples"] for k in todo)
    with tqdm(total=total, desc=f"transcode → {codec.name}", unit="sample", disable=not progress,
              dynamic_ncols=True) as bar:
        for k in todo:
            got = _rows(src, k, codec)
            writer = ShardWriter(out, k, shard_meta(info, k), tag="r0-")
            try:
                writer.write_rows(got["rows"])
                writer.commit({"format_version": FORMAT_VERSION, "build_key": info["build_key"],
                               "range": got["sidecar"].get("range"), "codec": info["codec"],
                               "skipped": got["sidecar"].get("skipped", [])})
            except BaseException:
                writer.abort()
                raise
            bar.update(len(got["rows"]))
    finalize_cache(out, strict=True)
    return out


def _codec_state(src: CacheReader, codec: Codec, out: Path, old, calib_tokens: int) -> Dict[str, Any]:
    """Reload the fitted state of a resumed transcode, or fit it on the source's first tokens."""
    reused = reload_codec_state(codec, out, old)
    if reused is not None:
        return reused
    if calib_tokens <= 0:
        raise CacheError(f"cache.calib_tokens must be positive, got {calib_tokens}")
    feats, lasts = _calibration_tokens(src, calib_tokens)
    return fit_codec_state(codec, feats, lasts, src.hidden_size, list(src.layer_ids), out)
