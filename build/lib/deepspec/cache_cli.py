"""``deepspec cache …``: every command about the hidden-state cache, from the package that owns it.

    deepspec cache verify DIR [--decode]     sha256 + schema of every shard (exit 1 on damage)
    deepspec cache info DIR [--json|--full]  samples, tokens, bytes/token, ratio, manifest
    deepspec cache build [OVERRIDES…] [--rank R --world-size W] [--regen PATH] [--no-wait]
    deepspec cache finalize DIR              merge shard sidecars into index + manifest
    deepspec cache gate [OVERRIDES…] --regen PATH [--codecs bf16,fp8,lowrank] [--out DIR]
                                             lossless vs lossy: build, train, eval, compare τ

``verify`` and ``info`` read a cache (`deepspec.cache.cli`); ``build`` and ``finalize`` write one
(`deepspec.prepare`); ``gate`` builds, trains and evaluates per codec (`deepspec.experiments.gate`).
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from .cache.cli import add_commands, run_command
from .config import load_config
from .experiments.gate import format_markdown, run as run_gate
from .prepare.build import build_cache
from .prepare.finalize import finalize_cache


def _log_to_stderr() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")  # no-op when `deepspec` already configured logging


def _cmd_build(args) -> int:
    _log_to_stderr()
    cfg = load_config(args.overrides)
    out = build_cache(cfg, regen_path=args.regen, rank=args.rank, world_size=args.world_size,
                      wait=not args.no_wait, progress=None if not args.no_progress else False)
    print(out)
    return 0


def _cmd_finalize(args) -> int:
    finalize_cache(args.dir, strict=True)
    print(f"{args.dir}: manifest written")
    return 0


def _cmd_gate(args) -> int:
    _log_to_stderr()
    cfg = load_config(args.overrides)
    rep = run_gate(cfg, codecs=[c for c in args.codecs.split(",") if c], regen_path=args.regen,
                   out_dir=args.out, tolerance=args.tolerance)
    print(format_markdown(rep))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepspec cache", description="target hidden-state cache tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_commands(sub)
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
    return run_command(parser().parse_args(list(sys.argv[1:] if argv is None else argv)))
