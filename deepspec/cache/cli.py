"""``deepspec cache …``: every command about the hidden-state cache.

    deepspec cache verify DIR [--decode]     sha256 + schema of every shard (exit 1 on damage)
    deepspec cache info DIR [--json|--full] [--vocab-size N ...] [--no-coverage]
                                             samples, tokens, bytes/token, ratio, draft-vocabulary
                                             coverage of the answer tokens, manifest
    deepspec cache build [OVERRIDES…] [--rank R --world-size W] [--regen PATH] [--no-wait]
    deepspec cache finalize DIR              merge shard sidecars into index + manifest
    deepspec cache transcode SRC DST [cache=fp8 | cache.codec=lowrank cache.rank=64 …]
                                             re-encode a finished cache with another codec (no target)

Which codec to build with (lossless against lossy, end to end) is ``deepspec gate`` (`deepspec.plan.gate`).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ..config import load_config
from ..data.vocab import REPORT_SIZES, count_answer_tokens, top_coverage
from ..utils.signals import GracefulStop
from .reconstruction import format_error_report
from .errors import CacheError
from .finalize import finalize_cache
from .reader import CacheReader
from .transcode import transcode_cache
from .writer import build_cache


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _cmd_verify(args) -> int:
    reader = CacheReader(args.dir, check_files=False)

    def report(name, err):
        if err is None and not args.quiet:
            print(f"ok       {name}")
        elif err is not None:
            print(f"CORRUPT  {err}", file=sys.stderr)

    errors = reader.verify(decode=args.decode, on_shard=report)
    n = len(reader.manifest["shards"])
    if errors:
        print(f"{args.dir}: {len(errors)} of {n} shards damaged: "
              + ", ".join(e.split(":", 1)[0] for e in errors), file=sys.stderr)
        return 1
    print(f"{args.dir}: all {n} shards verified ({len(reader)} samples"
          f"{', every sample decoded' if args.decode else ''})")
    return 0


def vocab_coverage(reader: CacheReader, sizes: Sequence[int] = REPORT_SIZES, progress: Optional[bool] = None
                   ) -> Dict[str, Any]:
    """Coverage of the cache's answer (loss-masked) tokens by the N most frequent of them, per N in ``sizes``:
    the fraction a drafter with ``draft.vocab_size = N`` can propose at all (`deepspec.data.vocab`).

    Reads ``input_ids`` and ``loss_mask`` of every sample (`CacheReader.tokens`, no feature decoding),
    with a progress bar on a terminal.  All samples count (the trainer selects from its training split
    and forces the target's EOS tokens in, which the cache does not record)."""
    n = len(reader)
    samples = (reader.tokens(i) for i in range(n))
    if progress is not False:
        from tqdm import tqdm
        samples = tqdm(samples, total=n, desc="answer tokens", unit="sample", file=sys.stderr,
                       disable=None if progress is None else not progress, leave=False)
    counts = count_answer_tokens(samples, None)
    return {"answer_tokens": int(counts.sum()), "distinct": int(np.count_nonzero(counts)),
            "coverage": {int(k): top_coverage(counts, int(k)) for k in sorted(set(int(x) for x in sizes))}}


def format_coverage(cov: Dict[str, Any]) -> List[str]:
    row = "  ".join(f"N={k:,}: {100 * v:.2f}%" for k, v in cov["coverage"].items())
    return [f"draft vocab      {row}",
            f"                 (share of the {cov['answer_tokens']:,} answer tokens among the N most frequent; "
            f"{cov['distinct']:,} distinct; draft.vocab_size=N)"]


def _cmd_info(args) -> int:
    reader = CacheReader(args.dir)
    m = reader.manifest
    st = reader.stats()
    sizes = list(REPORT_SIZES) + [int(v) for v in args.vocab_size or []]
    bad = [v for v in sizes if v < 1]
    if bad:
        raise CacheError(f"--vocab-size {bad[0]}: must be a positive number of tokens")
    cov = None if args.no_coverage else vocab_coverage(reader, sizes)
    if args.json:
        out = {"stats": st, "manifest": m}
        if cov is not None:
            out["draft_vocab_coverage"] = cov
        print(json.dumps(out, indent=1))
        return 0
    t = m["target"]
    L, H = len(m["layer_ids"]), m["hidden_size"]
    lines = [
        f"cache            {reader.path}",
        f"target           {t.get('name')} ({t.get('model_type')}, {t.get('num_layers')} layers)  "
        f"weights {t['weights_sha256'][:12]}…",
        f"layers           {m['layer_ids']}  hidden {H}  feature_dim {m['feature_dim']}",
        f"codec            {m['codec']['name']} {json.dumps(m['codec']['params'], sort_keys=True)}",
        f"samples          {st['samples']:,}  (skipped {m.get('skipped', {}).get('count', 0):,})",
        f"tokens           {st['tokens']:,}  (loss tokens {st['loss_tokens']:,})",
        f"shards           {st['shards']:,}  ({m['shard_samples']} records each)",
        f"stored           {_human(st['stored_bytes'])}  = {st['bytes_per_token']:,.1f} bytes/token",
        f"raw layout       {st['raw_bytes_per_token']:,} bytes/token (6 + 2*H*(L+1) = 6 + 2*{H}*{L + 1})",
        f"compression      {st['ratio_vs_raw']:.3f}x vs raw layout, "
        f"{st['float_ratio_vs_bf16']:.3f}x on the bf16 tensors alone",
    ]
    cols = m.get("stored_column_bytes")
    if isinstance(cols, dict) and st["tokens"]:
        lines.append(f"bytes/token      features {int(cols.get('features', 0)) / st['tokens']:,.1f}, "
                     f"last_hidden {int(cols.get('last_hidden', 0)) / st['tokens']:,.1f}, "
                     f"target_lse {int(cols.get('target_lse', 0)) / st['tokens']:,.1f} (+ ids, mask, framing)")
    if m["format_version"] < 2:
        lines.append("target_lse       not stored (format version 1): a draft-vocabulary loss computes it "
                     "from last_hidden each step; rebuild the cache to store it")
    lines += format_error_report(m)  # lossy codecs: error measured at build time
    if cov is not None:
        lines += format_coverage(cov)
    print("\n".join(lines))
    shown = dict(m)
    if not args.full and len(m["shards"]) > 4:
        shown["shards"] = m["shards"][:4] + [f"... {len(m['shards']) - 4} more (--full)"]
    print("manifest:")
    print(json.dumps(shown, indent=1))
    return 0


def _cmd_build(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")  # no-op when `deepspec` already configured logging
    out = build_cache(load_config(args.overrides), regen_path=args.regen, rank=args.rank, world_size=args.world_size,
                      wait=not args.no_wait, progress=None if not args.no_progress else False)
    print(out)
    return 0


def _cmd_finalize(args) -> int:
    finalize_cache(args.dir, strict=True)
    print(f"{args.dir}: manifest written")
    return 0


def _cmd_transcode(args) -> int:
    bad = [o for o in args.overrides if not o.lstrip("+~").startswith("cache")]
    if bad:
        raise CacheError(f"transcode takes cache overrides only (cache=fp8, cache.rank=64, …), got {bad[0]!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    cfg = load_config(list(args.overrides))
    out = transcode_cache(args.src, args.dst, cfg.cache, progress=not args.no_progress)
    a, b = CacheReader(args.src).stats(), CacheReader(out).stats()
    print(f"{out}: {b['samples']:,} samples, {b['bytes_per_token']:,.1f} bytes/token "
          f"({b['bytes_per_token'] / a['bytes_per_token']:.3f}x of {args.src}, "
          f"compression {b['ratio_vs_raw']:.2f}x vs the raw layout)")
    return 0


def add_commands(sub) -> None:
    """``verify``, ``info``, ``build``, ``finalize`` and ``transcode`` on a subparsers object."""
    v = sub.add_parser("verify", help="check every shard's sha256 and schema")
    v.add_argument("dir")
    v.add_argument("--decode", action="store_true", help="also decode every sample (zstd checksums)")
    v.add_argument("--quiet", "-q", action="store_true")
    v.set_defaults(fn=_cmd_verify)
    i = sub.add_parser("info", help="summary and manifest")
    i.add_argument("dir")
    i.add_argument("--json", action="store_true")
    i.add_argument("--full", action="store_true", help="list every shard")
    i.add_argument("--vocab-size", type=int, action="append", metavar="N",
                   help="also report the answer-token coverage of a draft vocabulary of N tokens (your "
                        f"draft.vocab_size; repeatable; {', '.join(map(str, REPORT_SIZES))} are always reported)")
    i.add_argument("--no-coverage", action="store_true",
                   help="skip the draft-vocabulary coverage (it reads the token ids of every sample)")
    i.set_defaults(fn=_cmd_info)
    b = sub.add_parser("build", help="build (or resume) the cache for a config")
    b.add_argument("overrides", nargs="*", help="config overrides, e.g. target.path=tiny:llama run_dir=…")
    b.add_argument("--regen", default=None, help="regen JSONL (default: deepspec.paths.regen_path)")
    b.add_argument("--rank", type=int, default=None)
    b.add_argument("--world-size", type=int, default=None)
    b.add_argument("--no-wait", action="store_true", help="return after this rank's shards")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(fn=_cmd_build)
    f = sub.add_parser("finalize", help="write index + manifest once every shard is built")
    f.add_argument("dir")
    f.set_defaults(fn=_cmd_finalize)
    t = sub.add_parser("transcode", help="re-encode a finished cache with another codec (no target forward)")
    t.add_argument("src", help="a finished cache")
    t.add_argument("dst", help="the new cache's directory (resumes a killed transcode)")
    t.add_argument("overrides", nargs="*", help="the codec as cache overrides: cache=fp8, or cache=lowrank "
                                                "cache.rank=64 cache.lowrank_coef=fp8, cache.calib_tokens=…")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(fn=_cmd_transcode)


def run_command(args) -> int:
    """Run a parsed ``deepspec cache`` subcommand: a cache or OS error is one line (exit 1); a
    graceful stop (SIGTERM, Ctrl-C) says what was kept and exits with its signal code."""
    try:
        return int(args.fn(args) or 0)
    except (CacheError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except GracefulStop as e:
        print(f"deepspec cache {args.cmd}: {e}; committed shards are kept, run the same command again to "
              "resume", file=sys.stderr)
        return e.exit_code


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="deepspec cache", description="target hidden-state cache tools")
    add_commands(p.add_subparsers(dest="cmd", required=True))
    return run_command(p.parse_args(list(sys.argv[1:] if argv is None else argv)))
