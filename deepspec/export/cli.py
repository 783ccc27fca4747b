"""`deepspec export --to hf|vllm|sglang CKPT OUT [target.key=value ...]`."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional

from ..config import ConfigError
from .api import FORMATS, export_draft
from .common import target_overrides
from .errors import ExportError, ExportUnsupported

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepspec export",
        description="Export a draft checkpoint for serving. hf: our from_pretrained directory + model card; "
                    "vllm: speculators DSpark format; sglang: SGLang DSpark draft, which SpecForge loads too (eagle3 "
                    "drafts in the engine layout, draft=eagle3's default: speculators / SGLang EAGLE-3). Engine "
                    "formats need the "
                    "target (from the checkpoint's run.yaml, --target-path or target.* overrides); whatever an "
                    "engine cannot run exactly is refused with an explanation.")
    p.add_argument("--to", dest="fmt", required=True, choices=list(FORMATS))
    p.add_argument("checkpoint", help="draft checkpoint directory (config.json + model.safetensors)")
    p.add_argument("out", help="output directory (must not exist or be empty unless --force)")
    p.add_argument("overrides", nargs="*", help="target overrides, e.g. target.path=Qwen/Qwen3-4B target.dtype=bfloat16")
    p.add_argument("--target", action="append", default=[], metavar="KEY=VALUE",
                   help="target override (repeatable): dtype=float32, target.layer_ids=[1,9], or a conf/target "
                        "choice NAME")
    p.add_argument("--target-path", help="target model (HF id, directory, .gguf, reference:NAME, tiny:FAMILY)")
    p.add_argument("--results", help="eval results.json (or its directory) to put τ in the model card")
    p.add_argument("--allow-drop-heads", action="store_true",
                   help="write the parallel backbone even if the engine cannot run the draft's heads "
                        "(a loud warning goes into the model card)")
    p.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--no-verify", action="store_true", help="skip the re-read + independent-forward self-check")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    try:
        res = export_draft(args.checkpoint, args.out, args.fmt, target_path=args.target_path,
                           overrides=[*args.overrides, *target_overrides(args.target)], results=args.results,
                           allow_drop_heads=args.allow_drop_heads, force=args.force, verify=not args.no_verify)
    except ExportUnsupported as e:
        print(f"deepspec export: unsupported: {e}", file=sys.stderr)
        return 3
    except (ExportError, ConfigError) as e:
        print(f"deepspec export: error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.fmt} → {res.out} ({', '.join(res.files)})")
    for d in res.dropped:
        print(f"WARNING: dropped {d}", file=sys.stderr)
    for w in res.warnings:
        print(f"note: {w}")
    if res.verified:
        print("self-check: " + ", ".join(f"{k}={v:.2e}" for k, v in res.verified.items()))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main())
