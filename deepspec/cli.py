"""`deepspec` command line: thin dispatch to the stage packages.

    deepspec [-v] [--debug] <command> [--cfg job] [key=value ...]

Every stage composes a typed config from `conf/` (Hydra groups target/, draft/, data/,
cache/, train/, eval/, schedule/, engine/), an optional `recipe=<name>` from `recipes/`,
and the overrides given, writes the resolved config beside its outputs and runs.

A known failure (bad input record, corrupted or mismatched cache or checkpoint, wrong config)
prints one line naming the file, line or key and exits 1, or 2 for a config or usage error;
`--debug` (anywhere on the line) or DEEPSPEC_DEBUG=1 adds the traceback.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import re
import sys
import traceback
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .errors import DeepSpecError
from .config import list_recipes, load_config, to_yaml

# command -> (module:function taking the typed config, help)
STAGES: Dict[str, Tuple[str, str]] = {
    "prepare": ("deepspec.prepare:run", "regenerate answers with the target, then build the hidden-state cache"),
    "train": ("deepspec.train.loop:run", "train a draft model (DSpark / DFlash / Eagle3) on the cache or online"),
    "eval": ("deepspec.eval.runner:run", "lossless speculative decoding on benchmarks; τ, acceptance, plots"),
    "plan": ("deepspec.plan.estimate:run", "estimate tokens, cache bytes and time before spending GPU hours"),
    "calibrate": ("deepspec.schedule.calibrate:run", "sequential temperature scaling of the confidence head"),
    "profile": ("deepspec.schedule.profile_cmd:run", "measure the scheduler's SPS(B) table or SPS(R, B) grid here"),
    "demo": ("deepspec.demo:run", "the whole pipeline on the embedded reference target (CPU, minutes)"),
}
# command -> (module:function taking argv, help): commands with their own arguments
TOOLS: Dict[str, Tuple[str, str]] = {
    "cache": ("deepspec.cache.cli:main", "cache verify|info DIR, cache build|finalize"),
    "gate": ("deepspec.plan.gate:main", "which cache codec: lossless vs lossy, built, trained and evaluated alike"),
    "serve": ("deepspec.engines.server:main", "OpenAI-compatible /v1/chat/completions over the embedded engine"),
    "target": ("deepspec.targets.cli:main", "target fetch NAME: convert a reference target once"),
    "export": ("deepspec.export.cli:main", "export a draft for hf / vllm / sglang"),
    "check": ("deepspec.export.check:main", "train↔serve consistency check of a draft and a target"),
}


def _resolve(spec: str) -> Callable:
    mod, fn = spec.split(":")
    return getattr(importlib.import_module(mod), fn)


def _stage_parser(cmd: str, help_text: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"deepspec {cmd}", description=help_text)
    p.add_argument("--cfg", choices=["job"], help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. draft=dspark train.lr=3e-4 recipe=NAME")
    return p


def run_stage(cmd: str, argv: Sequence[str]) -> int:
    args = _stage_parser(cmd, STAGES[cmd][1]).parse_args(list(argv))
    overrides = list(args.overrides)
    if cmd == "demo" and not any(o.startswith("recipe=") for o in overrides):
        overrides.insert(0, "recipe=demo")
    cfg = load_config(overrides)
    if args.cfg == "job":
        print(to_yaml(cfg), end="")
        return 0
    result = _resolve(STAGES[cmd][0])(cfg)
    return result if isinstance(result, int) else 0


def _config_cmd(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="deepspec config", description="print the resolved config / list recipes")
    p.add_argument("--recipes", action="store_true", help="list the recipes")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(list(argv))
    if args.recipes:
        print("\n".join(list_recipes()))
        return 0
    print(to_yaml(load_config(args.overrides)), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepspec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--debug", action="store_true",
                   help="print the traceback of known errors too (also DEEPSPEC_DEBUG=1)")
    sub = p.add_subparsers(dest="command", metavar="command")
    for name, (_, h) in {**STAGES, **TOOLS}.items():
        sub.add_parser(name, help=h, add_help=False)
    sub.add_parser("config", help="print the resolved config (or --recipes)", add_help=False)
    return p


def error_kind(e: BaseException) -> str:
    """``CacheCorruptError`` → ``cache corrupt error``: the label of a one-line error report."""
    return re.sub(r"(?<!^)(?=[A-Z])", " ", type(e).__name__).lower()


def _split_flags(argv: List[str]) -> Tuple[bool, bool, List[str]]:
    """Leading -v/--verbose; --debug anywhere (it is no stage's or tool's own option)."""
    debug = "--debug" in argv or os.environ.get("DEEPSPEC_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    verbose = argv[:1] in (["-v"], ["--verbose"])
    return verbose, debug, argv[1:] if verbose else argv


def _dispatch(parser: argparse.ArgumentParser, cmd: str, rest: List[str]) -> int:
    if cmd in STAGES:
        return run_stage(cmd, rest)
    if cmd in TOOLS:
        result = _resolve(TOOLS[cmd][0])(rest)
        return result if isinstance(result, int) else 0
    if cmd == "config":
        return _config_cmd(rest)
    parser.print_usage(sys.stderr)
    print(f"deepspec: unknown command {cmd!r}", file=sys.stderr)
    return 2


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    verbose, debug, argv = _split_flags(list(sys.argv[1:] if argv is None else argv))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    cmd, rest = argv[0], argv[1:]
    try:
        return _dispatch(parser, cmd, rest)
    except (DeepSpecError, FileNotFoundError) as e:   # an input file that is missing counts as bad input
        if debug:
            traceback.print_exc()
        message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"deepspec {cmd}: {error_kind(e)}: {message}", file=sys.stderr)
        return getattr(e, "exit_code", 1)
    except KeyboardInterrupt as e:   # SIGTERM (GracefulStop) or Ctrl-C: the stage already rolled back
        code = getattr(e, "exit_code", 130)
        print(f"deepspec {cmd}: {e or 'interrupted'}; finished work is kept, run the same command again "
              "to resume", file=sys.stderr)
        return code
    except OSError as e:
        if e.errno not in _DISK_ERRNOS:
            raise
        if verbose or debug:
            traceback.print_exc()
        print(f"deepspec {cmd}: {e}\nThe last complete state is kept; fix the cause and run the same command "
              "again to resume.", file=sys.stderr)
        return 1


# disk full, quota, permission denied, read-only file system, I/O error: a short message, no traceback
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO}


if __name__ == "__main__":
    sys.exit(main())
