"""On-disk format: Arrow IPC shards, JSON sidecars, the index and the manifest.

Layout of a cache directory::

    build.json                  what is being built (target, codec, source, shard size)
    shard-000000.arrow          Arrow IPC file, one row per sample (blobs, see below)
    shard-000000.json           sidecar: sha256, bytes, rows; its presence commits the shard
    ...
    index.arrow                 sample_index -> (shard, row, num_tokens), in input order
    manifest.json               written last: the cache is complete

Shard rows: ``sample_index`` int64 (line number in the regen JSONL), ``id`` utf8,
``num_tokens`` int32, and five ``large_binary`` blobs, each one zstd frame with a
content checksum: ``input_ids`` (int32 LE), ``loss_mask`` (uint8 0/1), ``features``
and ``last_hidden`` (codec blobs), and ``target_lse`` (float32 LE: the log-normaliser
logsumexp_v of the target's logits at each position, computed in fp32 from the stored
``last_hidden``; it lets a draft-vocabulary loss score only the draft's N tokens).
Version 1 caches (no ``target_lse``) stay readable; training then computes it.  Shards are plain Arrow IPC files (no IPC-level
compression) so the reader memory-maps them and decompresses only the sample it is
asked for.  Nothing is ever pickled.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import numpy as np
import pyarrow as pa

from ..utils.fs import atomic_write, fsync_dir, with_path
from .errors import CacheCorruptError

FORMAT_NAME = "deepspec-cache"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
BUILD_INFO = "build.json"
INDEX = "index.arrow"
CODEC_STATE = "codec_state.arrow"
SCHEMA_META_KEY = b"deepspec.cache"
TMP_PREFIX = ".tmp-"
SHARD_RE = re.compile(r"^shard-(\d{6,9})\.arrow$")
SIDECAR_RE = re.compile(r"^shard-(\d{6,9})\.json$")
# DeepSpec's raw per-token layout: int32 id + int16 mask + bf16 (L layers + last hidden).
RAW_ID_BYTES = 6

SHARD_FIELDS = [
    pa.field("sample_index", pa.int64(), nullable=False),
    pa.field("id", pa.utf8(), nullable=False),
    pa.field("num_tokens", pa.int32(), nullable=False),
    pa.field("input_ids", pa.large_binary(), nullable=False),
    pa.field("loss_mask", pa.large_binary(), nullable=False),
    pa.field("features", pa.large_binary(), nullable=False),
    pa.field("last_hidden", pa.large_binary(), nullable=False),
    pa.field("target_lse", pa.large_binary(), nullable=False),
]
BLOB_COLUMNS = ("input_ids", "loss_mask", "features", "last_hidden", "target_lse")
INDEX_FIELDS = [
    pa.field("sample_index", pa.int64(), nullable=False),
    pa.field("id", pa.utf8(), nullable=False),
    pa.field("shard", pa.int32(), nullable=False),
    pa.field("row", pa.int32(), nullable=False),
    pa.field("num_tokens", pa.int32(), nullable=False),
    pa.field("num_loss_tokens", pa.int32(), nullable=False),
]


def shard_fields(version: int) -> List[pa.Field]:
    """The shard schema of a format version (1: without ``target_lse``)."""
    return SHARD_FIELDS if version >= 2 else [f for f in SHARD_FIELDS if f.name != "target_lse"]


def shard_name(k: int) -> str:
    return f"shard-{k:06d}.arrow"


def sidecar_name(k: int) -> str:
    return f"shard-{k:06d}.json"


def shard_schema(meta: Dict[str, Any]) -> pa.Schema:
    return pa.schema(SHARD_FIELDS, metadata={SCHEMA_META_KEY: json.dumps(meta, sort_keys=True).encode()})


def raw_bytes_per_token(hidden_size: int, num_layers: int) -> int:
    """DeepSpec's uncompressed layout: 6 + 2·H·(L+1) bytes per token."""
    return RAW_ID_BYTES + 2 * hidden_size * (num_layers + 1)


# -- durable small files --------------------------------------------------------------------------
def atomic_write_bytes(path: Path, data: bytes, tag: str = "") -> None:
    """temp file + fsync + os.replace (+ directory fsync): never a half-written file."""
    path = Path(path)
    atomic_write(path, data, tmp=path.parent / f"{TMP_PREFIX}{tag}{os.getpid()}-{path.name}", sync_dir=True)


def atomic_write_json(path: Path, obj: Any, tag: str = "") -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode(), tag)


def read_json(path: Path, max_bytes: int = 256 << 20) -> Any:
    """Parse a JSON file we wrote; anything else raises `CacheCorruptError` naming it."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise CacheCorruptError(f"{path}: {size} bytes is too large for a cache JSON file")
        text = path.read_bytes().decode("utf-8")
        return json.loads(text)
    except FileNotFoundError:
        raise
    except CacheCorruptError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CacheCorruptError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- shard writer -----------------------------------------------------------------------------------
class _HashingFile(io.RawIOBase):
    """Write-through file that hashes and counts what passes (Arrow writes sequentially)."""

    def __init__(self, f):
        super().__init__()
        self._f = f
        self.sha = hashlib.sha256()
        self.nbytes = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.sha.update(b)
        n = self._f.write(b)
        self.nbytes += len(b) if n is None else n
        return len(b) if n is None else n

    def tell(self) -> int:
        return self.nbytes

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:  # the owner closes the real file after fsync
        super().close()


class ShardWriter:
    """Stream record batches into ``.tmp-…`` and commit: fsync, rename, then the sidecar."""

    def __init__(self, directory: Path, shard: int, meta: Dict[str, Any], tag: str = ""):
        self.dir = Path(directory)
        self.shard = shard
        self.schema = shard_schema(meta)
        self.final = self.dir / shard_name(shard)
        self.tag = tag
        self.tmp = self.dir / f"{TMP_PREFIX}{tag}{os.getpid()}-{shard_name(shard)}"
        self._file = open(self.tmp, "wb")
        try:   # the schema is written here already: a full disk can fail it
            self._hf = _HashingFile(self._file)
            self._sink = pa.PythonFile(self._hf, mode="w")
            self._writer = pa.ipc.new_file(self._sink, self.schema)
        except BaseException as e:
            self._file.close()
            self.tmp.unlink(missing_ok=True)
            if isinstance(e, OSError):
                raise with_path(e, self.tmp, f"starting {self.final.name}") from e
            raise
        self.rows: List[Dict[str, Any]] = []
        self.blob_bytes = {k: 0 for k in BLOB_COLUMNS}

    def write_rows(self, rows: List[Dict[str, Any]]) -> None:
        if not rows:
            return
        cols = []
        for f in SHARD_FIELDS:
            cols.append(pa.array([r[f.name] for r in rows], type=f.type))
        self._writer.write_batch(pa.record_batch(cols, schema=self.schema))
        for r in rows:
            for k in self.blob_bytes:
                self.blob_bytes[k] += len(r[k])
            self.rows.append({"sample_index": int(r["sample_index"]), "id": r["id"],
                              "num_tokens": int(r["num_tokens"]), "num_loss_tokens": int(r["num_loss_tokens"])})

    def commit(self, sidecar: Dict[str, Any]) -> Dict[str, Any]:
        self._writer.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        info = dict(sidecar)
        info.update({"file": self.final.name, "shard": self.shard, "bytes": self._hf.nbytes,
                     "sha256": self._hf.sha.hexdigest(), "samples": len(self.rows),
                     "tokens": sum(r["num_tokens"] for r in self.rows),
                     "loss_tokens": sum(r["num_loss_tokens"] for r in self.rows),
                     "blob_bytes": dict(self.blob_bytes), "rows": self.rows})
        os.replace(self.tmp, self.final)
        fsync_dir(self.dir)
        # the sidecar is the commit point: a shard file without one is redone
        atomic_write_json(self.dir / sidecar_name(self.shard), info, tag=self.tag)
        return info

    def abort(self) -> None:
        try:
            self._writer.close()
        except Exception:
            pass
        try:
            self._file.close()
        except Exception:
            pass
        self.tmp.unlink(missing_ok=True)


# -- reading shards and the index ------------------------------------------------------------------
# what pyarrow may raise on damaged input (UnicodeDecodeError is a ValueError)
ARROW_ERRORS = (pa.ArrowException, OSError, ValueError, KeyError, IndexError, TypeError, OverflowError)


def open_ipc(path: Path, expected_fields, what: Optional[str] = None):
    """Memory-map an Arrow IPC file and check its schema; errors name the file."""
    what = what or path.name
    try:
        mm = pa.memory_map(str(path), "r")
    except FileNotFoundError:
        raise CacheCorruptError(f"{what}: file is missing ({path})") from None
    except (OSError, pa.ArrowException) as e:
        raise CacheCorruptError(f"{what}: cannot open ({e})") from None
    try:
        reader = pa.ipc.open_file(mm)
        schema = reader.schema
        got = [(f.name, f.type) for f in schema]
    except ARROW_ERRORS as e:
        mm.close()
        raise CacheCorruptError(f"{what}: not a valid Arrow IPC file ({type(e).__name__}: {e})") from None
    want = [(f.name, f.type) for f in expected_fields]
    if got != want:
        mm.close()
        raise CacheCorruptError(f"{what}: unexpected schema {got}, expected {want}")
    return mm, reader


def schema_meta(schema: pa.Schema, what: str) -> Dict[str, Any]:
    raw = (schema.metadata or {}).get(SCHEMA_META_KEY)
    if raw is None:
        raise CacheCorruptError(f"{what}: schema has no {SCHEMA_META_KEY.decode()} metadata")
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise CacheCorruptError(f"{what}: bad schema metadata ({e})") from None
    if not isinstance(meta, dict):
        raise CacheCorruptError(f"{what}: schema metadata is not an object")
    return meta


def write_index(path: Path, rows: List[Dict[str, Any]], tag: str = "") -> Dict[str, Any]:
    """Write ``index.arrow`` atomically; returns ``{"file", "bytes", "sha256"}``."""
    cols = [pa.array([r[f.name] for r in rows], type=f.type) for f in INDEX_FIELDS]
    table = pa.table(cols, schema=pa.schema(INDEX_FIELDS))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=1 << 20)
    data = sink.getvalue().to_pybytes()
    atomic_write_bytes(path, data, tag)
    return {"file": path.name, "bytes": len(data), "sha256": sha256_bytes(data)}


def check_name(name: Any, pattern: re.Pattern, what: str) -> str:
    """Manifest file names must be plain names of the expected form (no paths)."""
    if not isinstance(name, str) or not pattern.match(name):
        raise CacheCorruptError(f"{what}: bad file name {name!r}")
    return name


# -- codec_state.arrow --------------------------------------------------------------------------------
def state_to_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """A lossy codec's fitted arrays as an Arrow IPC file: one single-row list column per array."""
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
    """The arrays of `state_to_bytes`; damage raises `CacheCorruptError` naming ``what``."""
    try:
        table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
        return {k: np.asarray(table.column(k).combine_chunks().flatten().to_numpy(zero_copy_only=False))
                for k in table.column_names}
    except ARROW_ERRORS as e:
        raise CacheCorruptError(f"{what}: {e}") from None
