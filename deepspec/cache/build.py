"""Build the target hidden-state cache from the regenerated conversations.

Sharding is defined by the input alone: shard ``k`` holds the records on lines
``[k*S, (k+1)*S)`` of the regen JSONL (``S = cache.shard_samples``).  Rank ``r`` of
``W`` builds the shards with ``k % W == r``; inside a shard, samples are sorted by
length and packed into capture batches of at most ``cache.batch_tokens`` padded
tokens (right padding + attention mask).  Shard content therefore does not depend
on the number of ranks nor on restarts: 1 rank, N ranks and a resumed build write
the same shards (bit-identical on the same device and software).

A shard is streamed into ``.tmp-…``, fsynced, renamed, and then committed by its
JSON sidecar.  A restart (after ``kill -9`` at any point) keeps the committed
shards, deletes uncommitted leftovers and builds the missing ones.  Whoever finds
every shard committed (the last rank to finish, a waiting rank, or
``finalize_cache``) writes ``index.arrow`` and then ``manifest.json``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import torch

from .. import paths
from ..targets.adapter import INDEX_CONVENTION
from ..targets.chat import ChatTemplateError
from .codecs import Codec, codec_from_config, encode_array
from ..utils.fs import with_path
from ..utils.signals import GracefulStop, deferred, sigterm_as_interrupt
from .errors import CacheCorruptError, CacheError, CacheMismatchError
from .manifest import check_manifest
from .format import (BUILD_INFO, FORMAT_NAME, FORMAT_VERSION, INDEX, MANIFEST, TMP_PREFIX,
                     ShardWriter, atomic_write_json, read_json, shard_name, sidecar_name, write_index)

log = logging.getLogger(__name__)
_MAX_SKIP_EXAMPLES = 20
# fields of build.json that must agree for a resume (everything but the source path)
_KEY_FIELDS = ("format", "format_version", "target", "layer_ids", "index_convention", "hidden_size",
               "feature_dim", "dtype", "codec", "max_length", "chat_template_kwargs", "source_sha256",
               "num_records", "shard_samples", "num_shards")


# -- ranks ---------------------------------------------------------------------------------------------
def resolve_rank(rank: Optional[int] = None, world_size: Optional[int] = None) -> Tuple[int, int]:
    """Explicit args, else an initialised torch.distributed group, else RANK/WORLD_SIZE, else 0/1."""
    if rank is None or world_size is None:
        try:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                rank = dist.get_rank() if rank is None else rank
                world_size = dist.get_world_size() if world_size is None else world_size
        except Exception:  # pragma: no cover
            pass
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size < 1 or not 0 <= rank < world_size:
        raise CacheError(f"bad rank {rank} for world size {world_size}")
    return int(rank), int(world_size)


# -- input ---------------------------------------------------------------------------------------------
def scan_source(path: Path) -> Tuple[str, int, int]:
    """(sha256, number of lines, bytes) of the regen JSONL."""
    h = hashlib.sha256()
    lines = 0
    size = 0
    last = b"\n"
    with open(path, "rb") as f:
        while True:
            b = f.read(8 << 20)
            if not b:
                break
            h.update(b)
            lines += b.count(b"\n")
            size += len(b)
            last = b[-1:]
    if last != b"\n":
        lines += 1
    return h.hexdigest(), lines, size


def _parse_record(line: bytes, where: str) -> Tuple[Optional[str], List[Dict[str, str]]]:
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a record must be a JSON object")
    conv = rec.get("conversations")
    if not isinstance(conv, list) or not conv:
        raise ValueError(f"{where}: 'conversations' must be a non-empty list")
    rid = rec.get("id")
    return (None if rid is None else str(rid)), conv


def iter_shards(path: Path, wanted: List[int], shard_samples: int
                ) -> Iterator[Tuple[int, List[Tuple[int, bytes]]]]:
    """Yield ``(k, [(line_index, raw_line), ...])`` for the wanted shards, in order, one pass."""
    want = set(wanted)
    if not want:
        return
    cur, buf = None, []
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            k = i // shard_samples
            if k != cur:
                if cur in want:
                    yield cur, buf
                    want.discard(cur)
                    if not want:
                        return
                cur, buf = k, []
            if k in want and line.strip():
                buf.append((i, line))
    if cur in want:
        yield cur, buf
        want.discard(cur)
    for k in sorted(want):  # shards past the end of file hold nothing
        yield k, []


# -- build description -----------------------------------------------------------------------------------
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


def _check_existing(out: Path, info: Dict[str, Any]) -> Optional[Dict[str, Any]]:
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


# -- per-shard work --------------------------------------------------------------------------------------
class _Skip(Exception):
    pass


def _tokenize(target, records, src: Path, max_length: int, on_error: str, skipped: List[Dict[str, Any]]):
    items = []
    for i, line in records:
        where = f"{src.name}:{i + 1}"
        try:
            rid, conv = _parse_record(line, where)
            try:
                enc = target.encode_chat(conv)
            except ChatTemplateError as e:
                raise ValueError(f"{where}: cannot encode the conversation ({e})") from None
            except Exception as e:  # template engines raise their own types on odd content
                raise ValueError(f"{where}: cannot encode the conversation ({type(e).__name__}: {e})") from None
            ids = list(enc.input_ids)[:max_length]
            mask = list(enc.loss_mask)[:max_length]
            if not ids:
                raise _Skip("no tokens")
            if not any(mask):
                raise _Skip("no assistant (loss) tokens within data.max_length")
        except _Skip as e:
            skipped.append({"index": i, "id": rid, "reason": str(e)})
            continue
        except ValueError as e:
            if on_error != "skip":
                raise CacheError(f"{e} (set data.on_error=skip to skip bad records)") from None
            skipped.append({"index": i, "id": None, "reason": str(e)[:300]})
            continue
        items.append({"index": i, "id": rid if rid is not None else str(i),
                      "ids": np.asarray(ids, dtype=np.int32), "mask": np.asarray(mask, dtype=np.uint8)})
    return items


def _batches(items, batch_tokens: int):
    """Sort by length (longest first, then input order) and pack ≤ batch_tokens padded tokens."""
    order = sorted(items, key=lambda it: (-len(it["ids"]), it["index"]))
    batch: List[Dict[str, Any]] = []
    for it in order:
        t = len(it["ids"])
        longest = len(batch[0]["ids"]) if batch else t
        if batch and longest * (len(batch) + 1) > batch_tokens:
            yield batch
            batch = []
        batch.append(it)
    if batch:
        yield batch


def _pad_id(target) -> int:
    tok = target.tokenizer
    if getattr(tok, "pad_token_id", None) is not None:
        return int(tok.pad_token_id)
    eos = target.eos_token_ids
    return int(eos[0]) if eos else 0


def _capture(target, batch, pad_id: int):
    lens = [len(it["ids"]) for it in batch]
    T = max(lens)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    am = torch.zeros((len(batch), T), dtype=torch.long)
    for b, it in enumerate(batch):
        ids[b, : lens[b]] = torch.from_numpy(it["ids"].astype(np.int64))
        am[b, : lens[b]] = 1
    cap = target.capture(ids, attention_mask=None if min(lens) == T else am)
    return cap.features.to(torch.bfloat16).cpu(), cap.last_hidden.to(torch.bfloat16).cpu()


def _encode_row(codec: Codec, it, feats: torch.Tensor, last: torch.Tensor) -> Dict[str, Any]:
    t = len(it["ids"])
    return {"sample_index": it["index"], "id": it["id"], "num_tokens": t,
            "num_loss_tokens": int(it["mask"].sum()),
            "input_ids": encode_array(it["ids"].astype("<i4")), "loss_mask": encode_array(it["mask"]),
            "features": codec.encode(feats[:t], "features"), "last_hidden": codec.encode(last[:t], "last_hidden")}


class _Progress:
    def __init__(self, total: int, enabled: bool, desc: str):
        self.bar = None
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.bytes = 0
        if enabled:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="sample", dynamic_ncols=True, smoothing=0.1)

    def update(self, samples: int, tokens: int, nbytes: int) -> None:
        self.tokens += tokens
        self.bytes += nbytes
        if self.bar is not None:
            dt = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{self.tokens / dt:,.0f} tok/s, {self.bytes / dt / 1e6:,.1f} MB/s",
                                     refresh=False)
            self.bar.update(samples)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _build_shard(out: Path, k: int, records, target, codec: Codec, info: Dict[str, Any], cfg, src: Path,
                 pool: ThreadPoolExecutor, progress: _Progress, tag: str) -> Dict[str, Any]:
    skipped: List[Dict[str, Any]] = []
    items = _tokenize(target, records, src, int(cfg.data.max_length), cfg.data.on_error, skipped)
    meta = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "codec": info["codec"],
            "feature_dim": info["feature_dim"], "hidden_size": info["hidden_size"], "shard": k,
            "build_key": info["build_key"]}
    if info.get("codec_state"):  # lossy codecs: shards are tied to their fitted codec state
        meta["codec_state_sha256"] = info["codec_state"]["sha256"]
    writer = ShardWriter(out, k, meta, tag=tag)
    pad_id = _pad_id(target)
    pending: deque = deque()

    def drain(limit: int) -> None:
        while len(pending) > limit:
            futs = pending.popleft()
            rows = [f.result() for f in futs]
            writer.write_rows(rows)
            progress.update(len(rows), sum(r["num_tokens"] for r in rows),
                            sum(len(r["features"]) + len(r["last_hidden"]) for r in rows))

    try:
        for batch in _batches(items, max(1, int(cfg.cache.batch_tokens))):
            feats, last = _capture(target, batch, pad_id)
            pending.append([pool.submit(_encode_row, codec, it, feats[b], last[b]) for b, it in enumerate(batch)])
            drain(1)  # keep one batch compressing while the target runs the next
        drain(0)
        lo, hi = k * info["shard_samples"], min((k + 1) * info["shard_samples"], info["num_records"])
        with deferred():   # SIGTERM / Ctrl-C wait until the shard is committed
            return writer.commit({"format_version": FORMAT_VERSION, "build_key": info["build_key"],
                                  "range": [lo, hi], "codec": info["codec"], "skipped": skipped})
    except BaseException as e:
        for futs in pending:
            for f in futs:
                f.cancel()
        writer.abort()   # roll back: the shard's temp file is deleted
        if isinstance(e, OSError):
            raise with_path(e, writer.tmp, f"writing {shard_name(k)}; committed shards are kept, "
                                           "re-run the same command to resume") from e
        raise


# -- resume bookkeeping ------------------------------------------------------------------------------------
def _committed(out: Path, k: int, key: str) -> bool:
    """Is shard k committed (sidecar of this build + shard file of the recorded size)?"""
    sc = out / sidecar_name(k)
    if not sc.is_file():
        return False
    try:
        info = read_json(sc)
    except CacheCorruptError:
        return False
    if not isinstance(info, dict) or info.get("build_key") != key:
        raise CacheMismatchError(f"{sc}: written by a different build; delete {out} or set cache.dir")
    shard = out / shard_name(k)
    return shard.is_file() and shard.stat().st_size == info.get("bytes")


def _cleanup_rank(out: Path, rank: int) -> None:
    for p in out.glob(f"{TMP_PREFIX}r{rank}-*"):
        p.unlink(missing_ok=True)


def _remaining(out: Path, info: Dict[str, Any], rank: int, world: int) -> List[int]:
    todo = []
    for k in range(rank, info["num_shards"], world):
        if _committed(out, k, info["build_key"]):
            continue
        # uncommitted leftovers of a killed run: the sidecar goes first, then the shard
        (out / sidecar_name(k)).unlink(missing_ok=True)
        (out / shard_name(k)).unlink(missing_ok=True)
        todo.append(k)
    return todo


# -- finalize ---------------------------------------------------------------------------------------------
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
    shards, rows, skipped = [], [], []
    n_skipped = 0
    fbytes = 0
    col_bytes = {"features": 0, "last_hidden": 0}
    S, N = int(info["shard_samples"]), int(info["num_records"])
    rows_done = False
    k = None
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
            n_skipped += len(sc.get("skipped", []))
            skipped.extend(sc.get("skipped", [])[: max(0, _MAX_SKIP_EXAMPLES - len(skipped))])
            fb = sc.get("blob_bytes", {})
            fbytes += int(fb.get("features", 0)) + int(fb.get("last_hidden", 0))
            for c in col_bytes:
                col_bytes[c] += int(fb.get(c, 0))
            shards.append({"file": shard_name(k), "range": [lo, hi], "samples": int(sc["samples"]),
                           "tokens": int(sc["tokens"]), "loss_tokens": int(sc["loss_tokens"]),
                           "bytes": int(sc["bytes"]), "sha256": sc["sha256"]})
        rows_done = True
        rows.sort(key=lambda r: r["sample_index"])
        for a, b in zip(rows, rows[1:]):
            if a["sample_index"] == b["sample_index"]:
                raise CacheCorruptError(f"{out}: sample {a['sample_index']} appears in two shards")
        index = write_index(out / INDEX, rows, tag="final-")
    except CacheError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, pa.ArrowException) as e:
        where = out / sidecar_name(k) if k is not None and k < n_shards and not rows_done else out
        raise CacheCorruptError(f"{where}: damaged shard sidecar ({type(e).__name__}: {str(e)[:200]}); delete "
                                f"the damaged shard-*.json to rebuild that shard") from None
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
        "shard_samples": S, "num_samples": len(rows), "num_tokens": tokens,
        "num_loss_tokens": sum(s["loss_tokens"] for s in shards),
        "stored_bytes": sum(s["bytes"] for s in shards), "stored_float_bytes": fbytes,
        "raw_float_bytes": tokens * 2 * H * (L + 1),
        "skipped": {"count": n_skipped, "examples": skipped},
        "index": index, "shards": shards, "build_key": info["build_key"],
        "software": _software(),
    }
    manifest["stored_column_bytes"] = col_bytes
    for k in ("codec_state", "codec_error"):  # lossy codecs (lossy.py)
        if info.get(k) is not None:
            manifest[k] = info[k]
    check_manifest(manifest, str(out / MANIFEST))   # damaged sidecar values never make a "finished" cache
    atomic_write_json(out / MANIFEST, manifest, tag="final-")
    # every shard is committed, so shard temps left here belong to killed processes; temps of
    # a killed finalize are removed once old enough not to be a concurrent finalizer's
    now = time.time()
    for p in out.glob(f"{TMP_PREFIX}*"):
        try:
            if "shard-" in p.name or now - p.stat().st_mtime > 600:
                p.unlink()
        except FileNotFoundError:
            pass
    return True


def _software() -> Dict[str, str]:
    import pyarrow
    import transformers
    from .. import __version__
    return {"deepspec": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "pyarrow": pyarrow.__version__}


# -- entry point -----------------------------------------------------------------------------------------
def encode_threads(cfg, world: int) -> int:
    """``cache.encode_threads``; 0 = auto: this rank's share of the CPUs, 1..8."""
    n = int(cfg.cache.encode_threads)
    if n > 0:
        return n
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return max(1, min(8, (os.cpu_count() or 2) // max(1, local) - 1))


def build_cache(cfg, regen_path=None, target=None, *, rank: Optional[int] = None,
                world_size: Optional[int] = None, wait: bool = True, progress: Optional[bool] = None,
                poll_s: float = 1.0, wait_timeout_s: Optional[float] = None) -> Path:
    """Capture the target's hidden states for every regenerated conversation.

    Writes ``deepspec.paths.cache_dir(cfg)`` and returns it.  Under torchrun (or with
    explicit ``rank``/``world_size``) each rank builds its own shards; with ``wait``
    every rank returns only once the manifest exists (``wait=False``: a rank returns
    after its own shards, and the last one to finish writes the manifest;
    ``wait_timeout_s`` bounds the wait, then `CacheError` names the missing shards).

    SIGTERM / Ctrl-C raise `GracefulStop`: the shard being written is rolled back (or, if
    it is being committed, finished first); committed shards stay for the re-run."""
    with sigterm_as_interrupt():
        try:
            return _build_cache(cfg, regen_path, target, rank=rank, world_size=world_size, wait=wait,
                                progress=progress, poll_s=poll_s, wait_timeout_s=wait_timeout_s)
        except GracefulStop as e:
            log.warning("cache build %s; committed shards are kept in %s; run the same command again to resume",
                        e, paths.cache_dir(cfg))
            raise


def _build_cache(cfg, regen_path, target, *, rank, world_size, wait, progress, poll_s, wait_timeout_s) -> Path:
    rank, world = resolve_rank(rank, world_size)
    out = paths.cache_dir(cfg)
    src = Path(regen_path) if regen_path is not None else paths.regen_path(cfg)
    if not src.is_file():
        raise CacheError(f"regenerated conversations not found: {src} (run the regeneration step first "
                         f"or set data.regen_path)")
    if target is None:
        from ..targets import load_target
        device = None
        if world > 1 and cfg.target.device == "auto" and torch.cuda.is_available():
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank % max(torch.cuda.device_count(), 1)))}"
        target = load_target(cfg.target, device=device)
    codec = codec_from_config(cfg.cache)
    sha, n_lines, _ = scan_source(src)
    info = build_info(cfg, target, codec, src, sha, n_lines)
    out.mkdir(parents=True, exist_ok=True)
    old = _check_existing(out, info)
    if (out / MANIFEST).is_file():
        log.info("cache %s is already complete", out)
        return out
    if codec.needs_calibration:  # lossy codecs: fit (or reload) codec_state.arrow (lossy.py)
        from .lossy import prepare_codec_state
        info.update(prepare_codec_state(cfg, target, codec, src, out, old, rank))
    if old is None or (codec.needs_calibration and "codec_state" not in old):
        atomic_write_json(out / BUILD_INFO, info, tag=f"r{rank}-")
    tag = f"r{rank}-"
    _cleanup_rank(out, rank)
    todo = _remaining(out, info, rank, world)
    S = info["shard_samples"]
    total = sum(max(0, min((k + 1) * S, n_lines) - k * S) for k in todo)
    log.info("rank %d/%d: %d of %d shards to build (%d records) into %s", rank, world, len(todo),
             len(range(rank, info["num_shards"], world)), total, out)
    show = (rank == 0) if progress is None else progress
    bar = _Progress(total, bool(show) and total > 0, f"cache r{rank}" if world > 1 else "cache")
    try:
        with ThreadPoolExecutor(max_workers=encode_threads(cfg, world),
                                thread_name_prefix="cache-encode") as pool:
            for k, records in iter_shards(src, todo, S):
                before = bar.bar.n if bar.bar is not None else 0
                _build_shard(out, k, records, target, codec, info, cfg, src, pool, bar, tag)
                if bar.bar is not None:  # skipped records count as processed
                    done = max(0, min((k + 1) * S, n_lines) - k * S)
                    bar.bar.update(max(0, before + done - bar.bar.n))
    finally:
        bar.close()
    done = finalize_cache(out)
    if not done and wait:
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
    try:
        import torch.distributed as dist
        if wait and dist.is_available() and dist.is_initialized():
            dist.barrier()
    except Exception:  # pragma: no cover
        pass
    return out
