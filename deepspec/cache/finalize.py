"""Finish a cache: merge the shard sidecars into ``index.arrow`` + ``manifest.json``.

Whoever finds every shard committed (the last rank to finish, a waiting rank, or
``finalize_cache``) writes the index and then the manifest; ``wait_for_manifest`` is the
loop a rank runs until that has happened.
"""
from __future__ import annotations

import logging
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, Optional

import pyarrow as pa
import torch
import transformers

from .. import __version__
from ..cache.errors import CacheCorruptError, CacheError, CacheMismatchError
from ..cache.format import (BUILD_INFO, FORMAT_NAME, FORMAT_VERSION, INDEX, MANIFEST, TMP_PREFIX, atomic_write_json,
                            read_json, shard_name, sidecar_name, write_index)
from ..cache.manifest import check_manifest
from .buildinfo import build_key

log = logging.getLogger(__name__)
_MAX_SKIP_EXAMPLES = 20


def finalize_cache(directory, strict: bool = False) -> bool:
    """Merge the shard sidecars into ``index.arrow`` + ``manifest.json``.

    Returns True when the manifest is written (or already there), False when some
    shard is still missing (``strict=True`` raises `CacheError` naming them)."""
    out = Path(directory)
    if (out / MANIFEST).is_file():
        return True
    bpath = out / BUILD_INFO
    if not bpath.is_file():
        raise CacheError(f"{out}: no {BUILD_INFO}; nothing was built here")
    info = read_json(bpath)
    if not isinstance(info, dict) or info.get("build_key") != build_key(info):
        raise CacheCorruptError(f"{bpath}: damaged (build key does not match its content)")
    n_shards = int(info["num_shards"])
    names = set(os.listdir(out))
    missing = [k for k in range(n_shards) if sidecar_name(k) not in names or shard_name(k) not in names]
    if missing:
        if strict:
            raise CacheError(f"{out}: {len(missing)} of {n_shards} shards not built yet "
                             f"(first: {shard_name(missing[0])}); run the build again to resume")
        return False
    merged = _merge_sidecars(out, info)
    manifest = _manifest(info, merged)
    check_manifest(manifest, str(out / MANIFEST))   # damaged sidecar values never make a "finished" cache
    atomic_write_json(out / MANIFEST, manifest, tag="final-")
    _remove_stale_temps(out)
    return True


def _merge_sidecars(out: Path, info: Dict) -> Dict:
    """Every shard's sidecar read, checked and merged: shard entries, index rows (written to
    ``index.arrow``), skipped samples and stored bytes per column."""
    n_shards, S, N = int(info["num_shards"]), int(info["shard_samples"]), int(info["num_records"])
    m = {"shards": [], "skipped": [], "n_skipped": 0, "float_bytes": 0,
         "column_bytes": {"features": 0, "last_hidden": 0, "target_lse": 0}}
    rows, rows_done, k = [], False, None
    try:   # sidecars are ours, but may be damaged on disk: anything malformed is a CacheCorruptError
        for k in range(n_shards):
            sc = read_json(out / sidecar_name(k))
            what = str(out / sidecar_name(k))
            if not isinstance(sc, dict) or sc.get("build_key") != info["build_key"]:
                raise CacheMismatchError(f"{what}: written by a different build")
            size = (out / shard_name(k)).stat().st_size
            if size != sc.get("bytes"):
                raise CacheCorruptError(f"{shard_name(k)}: {size} bytes on disk, sidecar says {sc.get('bytes')}")
            lo, hi = k * S, min((k + 1) * S, N)
            for r, row in enumerate(sc["rows"]):
                if not lo <= int(row["sample_index"]) < hi:
                    raise CacheCorruptError(f"{what}: sample {row['sample_index']} outside the shard's range")
                rows.append({**row, "shard": k, "row": r})
            m["n_skipped"] += len(sc.get("skipped", []))
            m["skipped"].extend(sc.get("skipped", [])[: max(0, _MAX_SKIP_EXAMPLES - len(m["skipped"]))])
            fb = sc.get("blob_bytes", {})
            m["float_bytes"] += int(fb.get("features", 0)) + int(fb.get("last_hidden", 0))
            for c in m["column_bytes"]:
                m["column_bytes"][c] += int(fb.get(c, 0))
            m["shards"].append({"file": shard_name(k), "range": [lo, hi], "samples": int(sc["samples"]),
                                "tokens": int(sc["tokens"]), "loss_tokens": int(sc["loss_tokens"]),
                                "bytes": int(sc["bytes"]), "sha256": sc["sha256"]})
        rows_done = True
        rows.sort(key=lambda r: r["sample_index"])
        for a, b in zip(rows, rows[1:]):
            if a["sample_index"] == b["sample_index"]:
                raise CacheCorruptError(f"{out}: sample {a['sample_index']} appears in two shards")
        m["index"] = write_index(out / INDEX, rows, tag="final-")
    except CacheError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, pa.ArrowException) as e:
        where = out / sidecar_name(k) if k is not None and k < n_shards and not rows_done else out
        raise CacheCorruptError(f"{where}: damaged shard sidecar ({type(e).__name__}: {str(e)[:200]}); delete "
                                f"the damaged shard-*.json to rebuild that shard") from None
    m["num_samples"] = len(rows)
    return m


def _manifest(info: Dict, m: Dict) -> Dict:
    shards = m["shards"]
    tokens = sum(s["tokens"] for s in shards)
    L, H = len(info["layer_ids"]), int(info["hidden_size"])
    manifest = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "target": info["target"], "layer_ids": info["layer_ids"], "index_convention": info["index_convention"],
        "hidden_size": H, "feature_dim": info["feature_dim"], "dtype": info["dtype"], "codec": info["codec"],
        "max_length": info["max_length"], "chat_template_kwargs": info["chat_template_kwargs"],
        "source": {"path": info.get("source"), "sha256": info["source_sha256"],
                   "num_records": info["num_records"]},
        "shard_samples": int(info["shard_samples"]), "num_samples": m["num_samples"], "num_tokens": tokens,
        "num_loss_tokens": sum(s["loss_tokens"] for s in shards),
        "stored_bytes": sum(s["bytes"] for s in shards), "stored_float_bytes": m["float_bytes"],
        "raw_float_bytes": tokens * 2 * H * (L + 1),
        "skipped": {"count": m["n_skipped"], "examples": m["skipped"]},
        "index": m["index"], "shards": shards, "build_key": info["build_key"],
        "software": _software(),
        "stored_column_bytes": m["column_bytes"],
    }
    for k in ("codec_state", "codec_error", "transcoded_from"):  # lossy codecs (calibrate.py), transcode.py
        if info.get(k) is not None:
            manifest[k] = info[k]
    return manifest


def _remove_stale_temps(out: Path) -> None:
    """Every shard is committed, so shard temps left here belong to killed processes; temps of a killed
    finalize are removed once old enough not to be a concurrent finalizer's."""
    now = time.time()
    for p in out.glob(f"{TMP_PREFIX}*"):
        try:
            if "shard-" in p.name or now - p.stat().st_mtime > 600:
                p.unlink()
        except FileNotFoundError:
            pass


def _software() -> Dict[str, str]:
    return {"deepspec": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "pyarrow": pa.__version__}


def wait_for_manifest(out: Path, rank: int, poll_s: float, wait_timeout_s: Optional[float]) -> None:
    """Finalize ``out`` as soon as the other ranks have committed their shards; ``wait_timeout_s``
    bounds the wait, then `CacheError` names the missing shards."""
    t0 = time.monotonic()
    last_log = t0
    while not finalize_cache(out):
        if wait_timeout_s is not None and time.monotonic() - t0 > wait_timeout_s:
            finalize_cache(out, strict=True)  # raises, naming the missing shards
        time.sleep(poll_s)
        if time.monotonic() - last_log > 60:
            last_log = time.monotonic()
            log.info("rank %d: waiting for other ranks to finish their shards (%.0f s)", rank,
                     last_log - t0)
