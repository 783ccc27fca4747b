"""Random access to a finished cache (memory-mapped Arrow IPC shards)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import torch

from .codecs import Codec, decode_array, get_codec, same_spec
from .errors import CacheCorruptError, CacheError
from .format import (ARROW_ERRORS, CODEC_STATE, INDEX, INDEX_FIELDS, MANIFEST, open_ipc, shard_fields,
                     raw_bytes_per_token, read_json, schema_meta, sha256_bytes, sha256_file, state_from_bytes)
from .manifest import check_manifest, compare



class _Shard:
    def __init__(self, mm, reader, batches, starts):
        self.mm, self.reader, self.batches, self.starts = mm, reader, batches, starts


def check_index(i, n: int, what: str) -> int:
    """Sample ``i`` (an int, negative counts from the end) of ``what`` holding ``n`` samples, as 0..n-1."""
    if not isinstance(i, (int, np.integer)):
        raise TypeError(f"cache index must be an int, got {type(i).__name__}")
    i = int(i)
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"sample {i} out of range for {what} of {n} samples")
    return i


class CacheReader:
    """``reader[i]`` → ``{"input_ids", "loss_mask", "features", "last_hidden"[, "target_lse"]}`` of sample ``i``
    (``target_lse`` [T] fp32 from format version 2 on; ``has_target_lse`` says whether it is there).

    Samples are in input order (the regen JSONL's order, skipped records left out).
    Opening reads the manifest and the index (checksummed); shards are memory-mapped
    lazily and each sample is decompressed on access.  ``verify()`` hashes every shard.
    """

    def __init__(self, path, check_files: bool = True):
        self.path = Path(path)
        mpath = self.path / MANIFEST
        if not mpath.is_file():
            hint = " (the build has not finished: run it again to resume)" if (self.path / "build.json").is_file() else ""
            raise CacheError(f"{self.path}: no {MANIFEST}, not a finished cache{hint}")
        self.manifest: Dict[str, Any] = check_manifest(read_json(mpath), str(mpath))
        m = self.manifest
        self.hidden_size = int(m["hidden_size"])
        self.feature_dim = int(m["feature_dim"])
        self.layer_ids = list(m["layer_ids"])
        self.format_version = int(m["format_version"])
        self.has_target_lse = self.format_version >= 2
        self.codec: Codec = get_codec(m["codec"])
        self._load_codec_state()
        self._shard_files = [s["file"] for s in m["shards"]]
        if check_files:
            for s in m["shards"]:
                p = self.path / s["file"]
                try:
                    size = p.stat().st_size
                except FileNotFoundError:
                    raise CacheCorruptError(f"{s['file']}: shard file is missing from {self.path}") from None
                if size != s["bytes"]:
                    raise CacheCorruptError(f"{s['file']}: {size} bytes on disk, manifest says {s['bytes']} "
                                            "(truncated or replaced)")
        self._load_index()
        self._shards: Dict[int, _Shard] = {}
        self._pid = os.getpid()

    # -- index ---------------------------------------------------------------------------------
    def _load_index(self) -> None:
        ipath = self.path / INDEX
        what = f"{self.path.name}/{INDEX}"
        try:
            data = ipath.read_bytes()
        except FileNotFoundError:
            raise CacheCorruptError(f"{what}: index file is missing") from None
        if sha256_bytes(data) != self.manifest["index"]["sha256"]:
            raise CacheCorruptError(f"{what}: sha256 does not match the manifest")
        try:
            reader = pa.ipc.open_file(pa.py_buffer(data))
            if [(f.name, f.type) for f in reader.schema] != [(f.name, f.type) for f in INDEX_FIELDS]:
                raise CacheCorruptError(f"{what}: unexpected schema")
            table = reader.read_all()
            table.validate(full=True)
        except CacheCorruptError:
            raise
        except ARROW_ERRORS as e:
            raise CacheCorruptError(f"{what}: {e}") from None
        n = self.manifest["num_samples"]
        if table.num_rows != n:
            raise CacheCorruptError(f"{what}: {table.num_rows} rows, manifest says {n} samples")
        try:
            col = lambda k: table.column(k).to_numpy()  # noqa: E731
            self.sample_indices = col("sample_index").astype(np.int64)
            self._shard_of = col("shard").astype(np.int64)
            self._row_of = col("row").astype(np.int64)
            self.lengths = col("num_tokens").astype(np.int64)
            self.loss_lengths = col("num_loss_tokens").astype(np.int64)
            self.ids: List[str] = table.column("id").to_pylist()
        except ARROW_ERRORS as e:
            raise CacheCorruptError(f"{what}: {e}") from None
        if n and (self._shard_of.min() < 0 or self._shard_of.max() >= len(self._shard_files)):
            raise CacheCorruptError(f"{what}: shard numbers out of range")
        if n and (np.any(np.diff(self.sample_indices) <= 0) or self.lengths.min() <= 0):
            raise CacheCorruptError(f"{what}: sample indices not increasing or empty samples")
        if int(self.lengths.sum()) != self.manifest["num_tokens"]:
            raise CacheCorruptError(f"{what}: token total differs from the manifest")

    def _load_codec_state(self) -> None:
        st = self.manifest.get("codec_state")
        if not st:
            self.codec.load_state_arrays({})
            return
        if not isinstance(st, dict) or st.get("file") != CODEC_STATE or not isinstance(st.get("sha256"), str):
            raise CacheCorruptError(f"{MANIFEST}: bad codec_state entry")
        p = self.path / CODEC_STATE
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            raise CacheCorruptError(f"{CODEC_STATE}: missing") from None
        if sha256_bytes(data) != st["sha256"]:
            raise CacheCorruptError(f"{CODEC_STATE}: sha256 does not match the manifest")
        self.codec.load_state_arrays(state_from_bytes(data, CODEC_STATE))

    # -- shards ----------------------------------------------------------------------------------
    def _shard(self, k: int) -> _Shard:
        if self._pid != os.getpid():  # forked DataLoader worker: reopen our own maps
            self._shards, self._pid = {}, os.getpid()
        sh = self._shards.get(k)
        if sh is None:
            sh = self._open_shard(k)
            self._shards[k] = sh
        return sh

    def _open_shard(self, k: int) -> _Shard:
        name = self._shard_files[k]
        mm, reader = open_ipc(self.path / name, shard_fields(self.format_version), name)
        try:
            meta = schema_meta(reader.schema, name)
            if not same_spec(meta.get("codec"), self.manifest["codec"]):
                raise CacheCorruptError(
                    f"{name}: written with codec {meta.get('codec')}, but the manifest declares "
                    f"{self.manifest['codec']}; a cache never mixes codecs")
            st = self.manifest.get("codec_state")
            if (meta.get("codec_state_sha256") or None) != (st.get("sha256") if isinstance(st, dict) else None):
                raise CacheCorruptError(f"{name}: encoded with another fitted codec state than the manifest's "
                                        f"{CODEC_STATE}; a cache never mixes codecs")
            if meta.get("feature_dim") != self.feature_dim or meta.get("hidden_size") != self.hidden_size:
                raise CacheCorruptError(f"{name}: feature_dim/hidden_size in the shard differ from the manifest")
            batches, starts, n = [], [], 0
            for j in range(reader.num_record_batches):
                b = reader.get_batch(j)
                b.validate(full=True)  # offsets/lengths in bounds before any value is touched
                batches.append(b)
                starts.append(n)
                n += b.num_rows
        except CacheCorruptError:
            mm.close()
            raise
        except ARROW_ERRORS as e:
            mm.close()
            raise CacheCorruptError(f"{name}: {type(e).__name__}: {e}") from None
        expect = self.manifest["shards"][k]["samples"]
        if n != expect:
            mm.close()
            raise CacheCorruptError(f"{name}: {n} rows, manifest says {expect}")
        return _Shard(mm, reader, batches, np.asarray(starts, dtype=np.int64))

    def _row(self, k: int, row: int) -> Tuple[str, Any]:
        sh = self._shard(k)
        j = int(np.searchsorted(sh.starts, row, side="right") - 1)
        if j < 0 or j >= len(sh.batches):
            raise CacheCorruptError(f"{self._shard_files[k]}: row {row} out of range")
        return self._shard_files[k], (sh.batches[j], row - int(sh.starts[j]))

    # -- public API --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.manifest["num_samples"])

    def num_tokens(self, i: int) -> int:
        return int(self.lengths[self._check(i)])

    def sample_id(self, i: int) -> str:
        return self.ids[self._check(i)]

    def _check(self, i: int) -> int:
        return check_index(i, len(self), "a cache")

    def _read(self, i: int, columns: Tuple[str, ...]) -> Tuple[str, int, Dict[str, Any]]:
        """(where, num_tokens, {column: buffer}) of sample i, checked against the index."""
        i = self._check(i)
        k, row = int(self._shard_of[i]), int(self._row_of[i])
        name, (batch, r) = self._row(k, row)
        what = f"{name} row {row}"
        try:
            get = lambda c: batch.column(c)[r]  # noqa: E731
            sidx = get("sample_index").as_py()
            t = get("num_tokens").as_py()
            blobs = {c: get(c).as_buffer() for c in columns}
        except ARROW_ERRORS + (AttributeError,) as e:
            raise CacheCorruptError(f"{what}: {type(e).__name__}: {e}") from None
        if sidx != int(self.sample_indices[i]) or t != int(self.lengths[i]):
            raise CacheCorruptError(f"{what}: holds sample {sidx} with {t} tokens, index expects "
                                    f"{int(self.sample_indices[i])} with {int(self.lengths[i])}")
        return what, t, blobs

    def _tokens(self, what: str, t: int, blobs) -> Dict[str, torch.Tensor]:
        ids = decode_array(blobs["input_ids"], "<i4", t, f"{what} input_ids")
        mask = decode_array(blobs["loss_mask"], np.uint8, t, f"{what} loss_mask")
        if mask.size and mask.max() > 1:
            raise CacheCorruptError(f"{what} loss_mask: values other than 0/1")
        return {"input_ids": torch.from_numpy(ids.astype(np.int64)),
                "loss_mask": torch.from_numpy(mask.astype(np.bool_))}

    def tokens(self, i: int) -> Dict[str, torch.Tensor]:
        """input_ids and loss_mask of sample i, without decoding its features."""
        return self._tokens(*self._read(i, ("input_ids", "loss_mask")))

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        cols = ("input_ids", "loss_mask", "features", "last_hidden") + (("target_lse",) if self.has_target_lse else ())
        what, t, blobs = self._read(i, cols)
        out = self._tokens(what, t, blobs)
        out["features"] = self.codec.decode(blobs["features"], (t, self.feature_dim), f"{what} features")
        out["last_hidden"] = self.codec.decode(blobs["last_hidden"], (t, self.hidden_size), f"{what} last_hidden")
        if self.has_target_lse:
            lse = decode_array(blobs["target_lse"], "<f4", t, f"{what} target_lse")
            if not np.isfinite(lse).all():
                raise CacheCorruptError(f"{what} target_lse: values that are not finite")
            out["target_lse"] = torch.from_numpy(lse.astype(np.float32))
        return out

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def validate(self, expected, layer_subset: bool = False) -> "CacheReader":
        """Refuse (`CacheMismatchError`) a cache built for another target / layers / hidden size.

        ``expected`` is a `TargetAdapter` or a dict with any of ``weights_sha256``,
        ``tokenizer_sha256``, ``chat_template_sha256``, ``layer_ids``, ``hidden_size``,
        ``feature_dim``, ``index_convention``, ``num_layers``, ``codec`` (flat, or the
        hashes under ``"target"``)."""
        compare(self.manifest, expected, where=f"cache {self.path}", layer_subset=layer_subset)
        return self

    def codec_info(self) -> Dict[str, Any]:
        """Codec name/params, whether it is lossless, the build-time reconstruction error and the
        decoder arrays of a lossy codec (``lowrank``: ``W`` [L, H, r], ``mu`` [L, H]; features of
        layer l = ``z_l @ W[l].T + mu[l]``, see docs/cache.md for absorbing it into a drafter)."""
        c = self.codec
        dec = getattr(c, "decoder_arrays", None)
        return {"name": c.name, "params": c.params(), "lossless": bool(c.lossless),
                "error": self.manifest.get("codec_error"), "decoder": dec() if callable(dec) else {}}

    # -- integrity ---------------------------------------------------------------------------------
    def verify(self, decode: bool = False, on_shard: Optional[Callable[[str, Optional[str]], None]] = None
               ) -> List[str]:
        """Hash every shard and check its schema (and optionally decode every sample).

        Returns a list of error messages, each naming its shard (empty = all good)."""
        errors: List[str] = []
        by_shard: Dict[int, List[int]] = {}
        if decode:
            for i, k in enumerate(self._shard_of.tolist()):
                by_shard.setdefault(k, []).append(i)
        for k, s in enumerate(self.manifest["shards"]):
            name, err = s["file"], None
            try:
                p = self.path / name
                if not p.is_file():
                    raise CacheCorruptError(f"{name}: shard file is missing")
                digest = sha256_file(p)
                if digest != s["sha256"]:
                    raise CacheCorruptError(f"{name}: sha256 mismatch (manifest {s['sha256'][:12]}…, "
                                            f"file {digest[:12]}…)")
                self._shards.pop(k, None)
                self._shard(k)
                for i in by_shard.get(k, []):
                    self[i]
            except CacheError as e:
                err = str(e)
                errors.append(err)
            if on_shard is not None:
                on_shard(name, err)
        return errors

    # -- stats -------------------------------------------------------------------------------------
    def stats(self) -> Dict[str, Any]:
        m = self.manifest
        tokens = int(m["num_tokens"])
        stored = sum(int(s["bytes"]) for s in m["shards"])
        raw_tok = raw_bytes_per_token(self.hidden_size, len(self.layer_ids))
        raw_float = 2 * self.hidden_size * (len(self.layer_ids) + 1)
        fb = int(m.get("stored_float_bytes") or 0)
        return {"samples": len(self), "tokens": tokens, "loss_tokens": int(self.loss_lengths.sum()),
                "shards": len(m["shards"]), "stored_bytes": stored,
                "bytes_per_token": stored / tokens if tokens else 0.0,
                "raw_bytes_per_token": raw_tok,
                "ratio_vs_raw": (raw_tok * tokens / stored) if stored else 0.0,
                "float_ratio_vs_bf16": (raw_float * tokens / fb) if fb else 0.0}

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        for sh in self._shards.values():
            try:
                sh.mm.close()
            except Exception:
                pass
        self._shards = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __getstate__(self):
        st = dict(self.__dict__)
        st["_shards"] = {}
        return st

    def __setstate__(self, st):
        self.__dict__.update(st)
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return (f"CacheReader({str(self.path)!r}, samples={len(self)}, tokens={self.manifest['num_tokens']}, "
                f"codec={self.manifest['codec']['name']})")
