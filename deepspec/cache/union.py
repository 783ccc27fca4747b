"""Several finished caches of one target read as one dataset (``cache.dir`` + ``cache.extra_dirs``).

A second ``deepspec prepare`` (for instance with ``data.start_sample``) writes its own cache; the
union lets training read both without rebuilding the first.  Sample ``i`` of the union is sample
``i - offset[k]`` of cache ``k``, caches in the order given.  Every cache must be built for the same
target (weights, tokenizer, chat template), layers, hidden size, codec and format version, and no
sample id may appear in two caches; each cache keeps decoding with its own codec state.
"""
from __future__ import annotations

import bisect
from typing import Any, Dict, List, Sequence

import numpy as np
import torch

from .errors import CacheError, CacheMismatchError
from .manifest import TARGET_KEYS, compare
from .reader import CacheReader, check_index


def _identity(reader: CacheReader) -> Dict[str, Any]:
    """What another cache of the union must share with ``reader`` (in `compare`'s vocabulary)."""
    m = reader.manifest
    ident: Dict[str, Any] = {k: m["target"][k] for k in TARGET_KEYS if k in m.get("target", {})}
    ident.update(layer_ids=list(m["layer_ids"]), hidden_size=int(m["hidden_size"]),
                 feature_dim=int(m["feature_dim"]), index_convention=m.get("index_convention"),
                 codec=m["codec"]["name"])
    return ident


class CacheUnion:
    """The samples of ``readers`` back to back, with the `CacheReader` API training uses."""

    def __init__(self, readers: Sequence[CacheReader]):
        if not readers:
            raise CacheError("a cache union needs at least one cache")
        self.readers: List[CacheReader] = list(readers)
        first = self.readers[0]
        ident = _identity(first)
        for r in self.readers[1:]:
            try:
                compare(r.manifest, ident, where=f"cache {r.path}")
            except CacheMismatchError as e:
                raise CacheMismatchError(f"{e}\n(cache.extra_dirs must match cache.dir {first.path})") from None
            if r.format_version != first.format_version:
                raise CacheMismatchError(f"cache {r.path} has format version {r.format_version}, cache {first.path} "
                                         f"{first.format_version}: rebuild one of them so the union reads alike")
        seen: Dict[str, str] = {}
        for r in self.readers:
            for sid in r.ids:
                if sid in seen:
                    raise CacheMismatchError(f"sample id {sid!r} is in both {seen[sid]} and {r.path}: a union "
                                             "needs disjoint caches (a second prepare takes data.start_sample)")
                seen[sid] = str(r.path)
        self.offsets = np.cumsum([0] + [len(r) for r in self.readers])
        self.lengths = np.concatenate([r.lengths for r in self.readers])
        self.loss_lengths = np.concatenate([r.loss_lengths for r in self.readers])
        self.ids: List[str] = [sid for r in self.readers for sid in r.ids]
        self.layer_ids, self.hidden_size, self.feature_dim = first.layer_ids, first.hidden_size, first.feature_dim
        self.has_target_lse = first.has_target_lse
        self.manifest = {**first.manifest, "num_samples": int(self.offsets[-1]),
                         "num_tokens": int(self.lengths.sum()),
                         "union": [str(r.path) for r in self.readers]}
        self.manifest.pop("shards", None)

    def _locate(self, i: int):
        i = check_index(i, len(self), "a union")
        k = bisect.bisect_right(self.offsets, i) - 1
        return self.readers[k], i - int(self.offsets[k])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        r, j = self._locate(i)
        return r[j]

    def tokens(self, i: int) -> Dict[str, torch.Tensor]:
        r, j = self._locate(i)
        return r.tokens(j)

    def num_tokens(self, i: int) -> int:
        r, j = self._locate(i)
        return r.num_tokens(j)

    def sample_id(self, i: int) -> str:
        r, j = self._locate(i)
        return r.sample_id(j)

    def stats(self) -> Dict[str, Any]:
        """Samples, tokens and loss tokens of the union; ``caches``: each cache's own `CacheReader.stats`."""
        parts = [r.stats() for r in self.readers]
        return {"samples": len(self), "tokens": sum(p["tokens"] for p in parts),
                "loss_tokens": sum(p["loss_tokens"] for p in parts),
                "stored_bytes": sum(p["stored_bytes"] for p in parts), "caches": parts}

    def validate(self, expected, layer_subset: bool = False) -> "CacheUnion":
        for r in self.readers:
            r.validate(expected, layer_subset)
        return self

    def close(self) -> None:
        for r in self.readers:
            r.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"CacheUnion({[str(r.path) for r in self.readers]}, samples={len(self)})"


def open_caches(dirs: Sequence) -> "CacheReader | CacheUnion":
    """One `CacheReader` for one directory, a `CacheUnion` of them for several."""
    readers = [CacheReader(d) for d in dirs]
    return readers[0] if len(readers) == 1 else CacheUnion(readers)
