"""``deepspec cache …``: verify, info, build, finalize.

    deepspec cache verify DIR [--decode]     sha256 + schema of every shard (exit 1 on damage)
    deepspec cache info DIR [--json|--full]  samples, tokens, bytes/token, ratio, manifest
    deepspec cache build [OVERRIDES…] [--rank R --world-size W] [--regen PATH] [--no-wait]
    deepspec cache finalize DIR              merge shard sidecars into index + manifest
    deepspec cache gate [OVERRIDES…] --regen PATH [--codecs bf16,fp8,lowrank] [--out DIR]
                                             lossless vs lossy: build, train, eval, compare τ (gate.py)
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from .errors import CacheError


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _cmd_verify(args) -> int:
    from .reader import CacheReader
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


def _cmd_info(args) -> int:
    from .reader import CacheReader
    reader = CacheReader(args.dir)
    m = reader.manifest
    st = reader.stats()
    if args.json:
        print(json.dumps({"stats": st, "manifest": m}, indent=1))
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
                     f"last_hidden {int(cols.get('last_hidden', 0)) / st['tokens']:,.1f} (+ ids, mask, framing)")
    from .codec_state import format_error_report  # lossy codecs: error measured at build time
    lines += format_error_report(m)
    print("\n".join(lines))
    shown = dict(m)
    if not args.full and len(m["shards"]) > 4:
        shown["shards"] = m["shards"][:4] + [f"... {len(m['shards']) - 4} more (--full)"]
    print("manifest:")
    print(json.dumps(shown, indent=1))
    return 0


def _cmd_build(args) -> int:
    import logging
    from ..config import load_config
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")  # no-op when `deepspec` already configured logging
    from .build import build_cache
    cfg = load_config(args.overrides)
    out = build_cache(cfg, regen_path=args.regen, rank=args.rank, world_size=args.world_size,
                      wait=not args.no_wait, progress=None if not args.no_progress else False)
    print(out)
    return 0


def _cmd_finalize(args) -> int:
    from .build import finalize_cache
    finalize_cache(args.dir, strict=True)
    print(f"{args.dir}: manifest written")
    return 0


def _cmd_gate(args) -> int:
    import logging
    from ..config import load_config
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    from .gate import format_markdown, run
    cfg = load_config(args.overrides)
    rep = run(cfg, codecs=[c for c in args.codecs.split(",") if c], regen_path=args.regen,
              out_dir=args.out, tolerance=args.tolerance)
    print(format_markdown(rep))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepspec cache", description="target hidden-state cache tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", help="check every shard's sha256 and schema")
    v.add_argument("dir")
    v.add_argument("--decode", action="store_true", help="also decode every sample (zstd checksums)")
    v.add_argument("--quiet", "-q", action="store_true")
    v.set_defaults(fn=_cmd_verify)
    i = sub.add_parser("info", help="summary and manifest")
    i.add_argument("dir")
    i.add_argument("--json", action="store_true")
    i.add_argument("--full", action="store_true", help="list every shard")
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
    g = sub.add_parser("gate", help="lossless vs lossy codecs: same drafter, seed, steps, prompts; compare τ")
    g.add_argument("overrides", nargs="*", help="config overrides (target, draft, train.max_steps, eval.*)")
    g.add_argument("--regen", default=None, help="regen JSONL (default: deepspec.paths.regen_path)")
    g.add_argument("--codecs", default="bf16,fp8,lowrank",
                   help="comma list; the first is the baseline; params as lowrank:rank=64:coef=fp8")
    g.add_argument("--out", default=None, help="output directory (default {run_dir}/gate)")
    g.add_argument("--tolerance", type=float, default=0.02, help="allowed relative τ loss (0.02 = 2%%)")
    g.set_defaults(fn=_cmd_gate)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from ..utils.signals import GracefulStop
    try:
        return int(args.fn(args) or 0)
    except (CacheError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except GracefulStop as e:
        print(f"deepspec cache {args.cmd}: {e}; committed shards are kept, run the same command again to "
              "resume", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
