"""``build.json``: what is being built, the key that identifies the build, and the refusal to mix builds.

The key hashes every field that must agree for a resume (everything but the source path);
shard sidecars, ``build.json`` and the manifest all carry it, so a directory never holds
shards of two different builds.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, Optional

from ..targets.adapter import INDEX_CONVENTION
from ..cache.codecs import Codec
from ..cache.errors import CacheCorruptError, CacheError, CacheMismatchError
from ..cache.format import BUILD_INFO, FORMAT_NAME, FORMAT_VERSION, MANIFEST, read_json

# fields of build.json that must agree for a resume (everything but the source path)
_KEY_FIELDS = ("format", "format_version", "target", "layer_ids", "index_convention", "hidden_size",
               "feature_dim", "dtype", "codec", "max_length", "chat_template_kwargs", "source_sha256",
               "num_records", "shard_samples", "num_shards")


def build_info(cfg, target, codec: Codec, source: Path, source_sha: str, num_records: int) -> Dict[str, Any]:
    fp = target.fingerprint()
    S = int(cfg.cache.shard_samples)
    if S <= 0:
        raise CacheError(f"cache.shard_samples must be positive, got {S}")
    info = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
        "target": {"name": target.name, "model_type": getattr(target.config, "model_type", None),
                   "num_layers": int(target.num_layers), **fp},
        "layer_ids": [int(i) for i in target.layer_ids], "index_convention": INDEX_CONVENTION,
        "hidden_size": int(target.hidden_size), "feature_dim": int(target.feature_dim), "dtype": "bfloat16",
        "codec": codec.spec(), "max_length": int(cfg.data.max_length),
        "chat_template_kwargs": dict(getattr(target, "chat_template_kwargs", {}) or {}),
        "source_sha256": source_sha, "num_records": int(num_records), "shard_samples": S,
        "num_shards": (num_records + S - 1) // S,
    }
    info["build_key"] = build_key(info)
    info["source"] = str(source)
    return info


def build_key(info: Dict[str, Any]) -> str:
    sub = {k: info.get(k) for k in _KEY_FIELDS}
    return hashlib.sha256(json.dumps(sub, sort_keys=True, default=str).encode()).hexdigest()


def _diff(a: Dict[str, Any], b: Dict[str, Any]) -> str:
    out = []
    for k in _KEY_FIELDS:
        if a.get(k) != b.get(k):
            out.append(f"{k}: existing {json.dumps(a.get(k), default=str)[:120]} vs now "
                       f"{json.dumps(b.get(k), default=str)[:120]}")
    return "; ".join(out) or "build key differs"


def check_existing(out: Path, info: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Refuse to mix builds; returns the old build.json (or None)."""
    for name in (MANIFEST, BUILD_INFO):
        p = out / name
        if p.is_file():
            old = read_json(p)
            if not isinstance(old, dict):
                raise CacheCorruptError(f"{p}: not a JSON object")
            if old.get("build_key") != info["build_key"]:
                raise CacheMismatchError(
                    f"{out} already holds a cache of a different build ({_diff(old, info)}). "
                    f"Delete the directory or set cache.dir to build a new cache.")
            return old
    return None
