"""Build the target hidden-state cache from the regenerated conversations: the per-rank shard writer.

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

The parts: `samples` (read, tokenise, batch, capture, encode), `buildinfo` (``build.json`` and
its key), `calibrate` (a lossy codec's fitted state), `finalize` (index + manifest, waiting for
the other ranks); the on-disk format itself is `deepspec.cache.format`.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from .. import paths
from ..cache.codecs import Codec, codec_from_config
from ..cache.errors import CacheCorruptError, CacheError, CacheMismatchError
from ..cache.format import (BUILD_INFO, FORMAT_NAME, FORMAT_VERSION, MANIFEST, TMP_PREFIX, ShardWriter,
                            atomic_write_json, read_json, shard_name, sidecar_name)
from ..targets import load_target
from ..utils.dist_env import local_rank, local_world_size, rank_world
from ..utils.fs import with_path
from ..utils.signals import GracefulStop, deferred, sigterm_as_interrupt
from .buildinfo import build_info, check_existing
from .calibrate import prepare_codec_state
from .finalize import finalize_cache, wait_for_manifest
from .capture import (capture_batch, encode_row, iter_shards, length_batches, pad_token_id, scan_source,
                      tokenize_records)

log = logging.getLogger(__name__)


# -- ranks ---------------------------------------------------------------------------------------------
def _rank_world(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    """`rank_world`; a rank that does not fit the world size is a `CacheError` (one line at the CLI)."""
    try:
        return rank_world(rank, world_size)
    except ValueError as e:
        raise CacheError(str(e)) from None


# -- per-shard work --------------------------------------------------------------------------------------
class _Progress:
    def __init__(self, total: int, enabled: bool, desc: str):
        self.bar = None
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.bytes = 0
        if enabled:
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


def shard_meta(info: Dict[str, Any], k: int) -> Dict[str, Any]:
    """The schema metadata of shard ``k`` of the build described by ``info`` (build.json)."""
    meta = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "codec": info["codec"],
            "feature_dim": info["feature_dim"], "hidden_size": info["hidden_size"], "shard": k,
            "build_key": info["build_key"]}
    if info.get("codec_state"):  # lossy codecs: shards are tied to their fitted codec state
        meta["codec_state_sha256"] = info["codec_state"]["sha256"]
    return meta


def _build_shard(out: Path, k: int, records, target, codec: Codec, info: Dict[str, Any], cfg, src: Path,
                 pool: ThreadPoolExecutor, progress: _Progress, tag: str) -> Dict[str, Any]:
    skipped: List[Dict[str, Any]] = []
    items = tokenize_records(target, records, src, int(cfg.data.max_length), cfg.data.on_error, skipped)
    writer = ShardWriter(out, k, shard_meta(info, k), tag=tag)
    pad_id = pad_token_id(target)
    pending: deque = deque()

    def drain(limit: int) -> None:
        while len(pending) > limit:
            futs = pending.popleft()
            rows = [f.result() for f in futs]
            writer.write_rows(rows)
            progress.update(len(rows), sum(r["num_tokens"] for r in rows),
                            sum(len(r["features"]) + len(r["last_hidden"]) for r in rows))

    try:
        for batch in length_batches(items, max(1, int(cfg.cache.batch_tokens))):
            feats, last, lse = capture_batch(target, batch, pad_id, codec)
            pending.append([pool.submit(encode_row, codec, it, feats[b], last[b], lse[b])
                            for b, it in enumerate(batch)])
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
def committed(out: Path, k: int, key: str) -> bool:
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


def cleanup_rank(out: Path, rank: int) -> None:
    for p in out.glob(f"{TMP_PREFIX}r{rank}-*"):
        p.unlink(missing_ok=True)


def remaining_shards(out: Path, info: Dict[str, Any], rank: int, world: int) -> List[int]:
    todo = []
    for k in range(rank, info["num_shards"], world):
        if committed(out, k, info["build_key"]):
            continue
        # uncommitted leftovers of a killed run: the sidecar goes first, then the shard
        (out / sidecar_name(k)).unlink(missing_ok=True)
        (out / shard_name(k)).unlink(missing_ok=True)
        todo.append(k)
    return todo

# -- entry point -----------------------------------------------------------------------------------------
def encode_threads(cfg, world: int) -> int:
    """``cache.encode_threads``; 0 = auto: this rank's share of the CPUs, 1..8."""
    n = int(cfg.cache.encode_threads)
    if n > 0:
        return n
    local = local_world_size(default=world)
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
    rank, world = _rank_world(rank, world_size)
    out = paths.cache_dir(cfg)
    src = Path(regen_path) if regen_path is not None else paths.regen_path(cfg)
    if not src.is_file():
        raise CacheError(f"regenerated conversations not found: {src} (run the regeneration step first "
                         f"or set data.regen_path)")
    if target is None:
        device = None
        if world > 1 and cfg.target.device == "auto" and torch.cuda.is_available():
            device = f"cuda:{local_rank(default=rank % max(torch.cuda.device_count(), 1))}"
        target = load_target(cfg.target, device=device)
    codec = codec_from_config(cfg.cache)
    sha, n_lines, _ = scan_source(src)
    info = build_info(cfg, target, codec, src, sha, n_lines)
    out.mkdir(parents=True, exist_ok=True)
    old = check_existing(out, info)
    if (out / MANIFEST).is_file():
        log.info("cache %s is already complete", out)
        return out
    if codec.needs_calibration:  # lossy codecs: fit (or reload) codec_state.arrow
        info.update(prepare_codec_state(cfg, target, codec, src, out, old, rank))
    if old is None or (codec.needs_calibration and "codec_state" not in old):
        atomic_write_json(out / BUILD_INFO, info, tag=f"r{rank}-")
    tag = f"r{rank}-"
    cleanup_rank(out, rank)
    todo = remaining_shards(out, info, rank, world)
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
        wait_for_manifest(out, rank, poll_s, wait_timeout_s)
    if wait and dist.is_available() and dist.is_initialized():
        dist.barrier()
    return out
