"""The manifest: what a finished cache holds and which target it belongs to.

Every field is checked on load (types, names, totals) so a garbage or hostile
``manifest.json`` fails with `CacheCorruptError` instead of a stray ``KeyError``.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping

from ..targets.adapter import INDEX_CONVENTION
from .errors import CacheCorruptError, CacheError, CacheMismatchError
from .format import FORMAT_NAME, INDEX, READABLE_VERSIONS, SHARD_RE, check_name

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# keys `validate` compares, and where they live in the manifest
TARGET_KEYS = ("weights_sha256", "tokenizer_sha256", "chat_template_sha256")
TOP_KEYS = ("layer_ids", "hidden_size", "feature_dim", "index_convention", "num_layers")


def _need(obj: Mapping, key: str, typ, what: str):
    if key not in obj:
        raise CacheCorruptError(f"{what}: missing field {key!r}")
    v = obj[key]
    if typ is int:
        ok = isinstance(v, int) and not isinstance(v, bool)
    else:
        ok = isinstance(v, typ)
    if not ok:
        raise CacheCorruptError(f"{what}: field {key!r} must be {getattr(typ, '__name__', typ)}, "
                                f"got {type(v).__name__}")
    return v


def _nonneg(obj: Mapping, key: str, what: str) -> int:
    v = _need(obj, key, int, what)
    if v < 0:
        raise CacheCorruptError(f"{what}: field {key!r} is negative")
    return v


def _hex(obj: Mapping, key: str, what: str) -> str:
    v = _need(obj, key, str, what)
    if not _HEX64.match(v):
        raise CacheCorruptError(f"{what}: field {key!r} is not a sha256 hex digest")
    return v


def check_manifest(m: Any, what: str = "manifest.json") -> Dict[str, Any]:
    """Validate the structure of a parsed manifest; returns it unchanged."""
    if not isinstance(m, dict):
        raise CacheCorruptError(f"{what}: top level must be an object")
    if m.get("format") != FORMAT_NAME:
        raise CacheCorruptError(f"{what}: not a deepspec cache manifest (format={m.get('format')!r})")
    version = _need(m, "format_version", int, what)
    if version not in READABLE_VERSIONS:
        raise CacheCorruptError(f"{what}: format_version {version} is not supported "
                                f"(this deepspec reads versions {', '.join(map(str, READABLE_VERSIONS))})")
    target = _need(m, "target", dict, what)
    for k in TARGET_KEYS:
        _hex(target, k, f"{what} target")
    layer_ids = _need(m, "layer_ids", list, what)
    if not layer_ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layer_ids):
        raise CacheCorruptError(f"{what}: layer_ids must be a non-empty list of non-negative ints")
    hidden = _nonneg(m, "hidden_size", what)
    fdim = _nonneg(m, "feature_dim", what)
    if hidden == 0 or fdim != len(layer_ids) * hidden:
        raise CacheCorruptError(f"{what}: feature_dim {fdim} != len(layer_ids) * hidden_size "
                                f"({len(layer_ids)} * {hidden})")
    _need(m, "index_convention", str, what)
    if m.get("dtype") != "bfloat16":
        raise CacheCorruptError(f"{what}: dtype must be 'bfloat16', got {m.get('dtype')!r}")
    codec = _need(m, "codec", dict, what)
    _need(codec, "name", str, f"{what} codec")
    _need(codec, "params", dict, f"{what} codec")
    index = _need(m, "index", dict, what)
    if index.get("file") != INDEX:
        raise CacheCorruptError(f"{what}: index file must be {INDEX!r}")
    _nonneg(index, "bytes", f"{what} index")
    _hex(index, "sha256", f"{what} index")
    shards = _need(m, "shards", list, what)
    seen = set()
    total_s = total_t = 0
    for j, s in enumerate(shards):
        sw = f"{what} shards[{j}]"
        if not isinstance(s, dict):
            raise CacheCorruptError(f"{sw}: must be an object")
        name = check_name(s.get("file"), SHARD_RE, sw)
        if name in seen:
            raise CacheCorruptError(f"{sw}: {name} listed twice")
        seen.add(name)
        total_s += _nonneg(s, "samples", sw)
        total_t += _nonneg(s, "tokens", sw)
        _nonneg(s, "bytes", sw)
        _hex(s, "sha256", sw)
    if _nonneg(m, "num_samples", what) != total_s:
        raise CacheCorruptError(f"{what}: num_samples {m['num_samples']} != sum over shards {total_s}")
    if _nonneg(m, "num_tokens", what) != total_t:
        raise CacheCorruptError(f"{what}: num_tokens {m['num_tokens']} != sum over shards {total_t}")
    return m


def expected_from_target(target) -> Dict[str, Any]:
    """What a cache must match to be used with ``target`` (a `TargetAdapter`)."""
    return {**target.fingerprint(), "layer_ids": [int(i) for i in target.layer_ids],
            "hidden_size": int(target.hidden_size), "feature_dim": int(target.feature_dim),
            "index_convention": INDEX_CONVENTION, "num_layers": int(target.num_layers)}


def _is_subset(want, have) -> bool:
    if not want or not have:
        return False
    want, have = [int(i) for i in want], [int(i) for i in have]
    return want == sorted(set(want)) and set(want) <= set(have)


def layer_positions(cache_layer_ids, layer_ids) -> List[int]:
    """Where each of ``layer_ids`` sits among a cache's layers (its features are concatenated in that order)."""
    have = [int(i) for i in cache_layer_ids]
    return [have.index(int(i)) for i in layer_ids]


def manifest_view(m: Mapping[str, Any]) -> Dict[str, Any]:
    """The manifest's comparable identity, flat (same keys as `expected_from_target`)."""
    t = m.get("target", {})
    view = {k: t.get(k) for k in TARGET_KEYS}
    for k in TOP_KEYS:
        view[k] = t.get(k) if k == "num_layers" else m.get(k)
    view["codec"] = m.get("codec")
    return view


def _flatten_expected(expected: Mapping[str, Any]) -> Dict[str, Any]:
    flat: Dict[str, Any] = {}
    nested = expected.get("target")
    if isinstance(nested, Mapping):
        for k in TARGET_KEYS + ("num_layers",):
            if k in nested:
                flat[k] = nested[k]
    for k in TARGET_KEYS + TOP_KEYS + ("codec",):
        if k in expected:
            flat[k] = expected[k]
    return flat


def _short(v: Any) -> str:
    s = repr(v)
    if isinstance(v, str) and _HEX64.match(v):
        s = v[:12] + "…"
    return s


def compare(manifest: Mapping[str, Any], expected: Any, where: str = "cache", layer_subset: bool = False) -> None:
    """Raise `CacheMismatchError` listing every field that differs.  With ``layer_subset`` the expected
    layer ids may be any increasing subset of the cache's (a reader then picks those layers' features)."""
    if hasattr(expected, "fingerprint") and hasattr(expected, "layer_ids"):
        exp = expected_from_target(expected)
    elif isinstance(expected, Mapping):
        exp = _flatten_expected(expected)
        if not exp:
            raise CacheError(f"validate({where}): nothing to compare in {sorted(expected)}; give a "
                             f"TargetAdapter or a dict with some of {list(TARGET_KEYS + TOP_KEYS)}")
    else:
        raise TypeError(f"validate() takes a TargetAdapter or a dict, got {type(expected).__name__}")
    have = manifest_view(manifest)
    if layer_subset and _is_subset(exp.get("layer_ids"), have.get("layer_ids")):
        exp = {k: v for k, v in exp.items() if k not in ("layer_ids", "feature_dim")}
    bad: List[str] = []
    for k, v in exp.items():
        hv = have.get(k)
        if k == "layer_ids" and v is not None:
            v = [int(i) for i in v]
        if k == "codec" and isinstance(v, str):
            hv = (hv or {}).get("name")
        if hv != v:
            bad.append(f"{k}: cache has {_short(hv)}, expected {_short(v)}")
    if bad:
        tname = manifest.get("target", {}).get("name", "?")
        raise CacheMismatchError(
            f"{where} was built for a different target/configuration (cache target {tname!r}):\n  - "
            + "\n  - ".join(bad)
            + "\nRebuild the cache for this target (delete it or set cache.dir) or point target.* at "
              "the model, layer ids and chat template it was built with.")
