"""Where benchmark records live and how they are named.

One current record per benchmark, `bench/results/<script>.json`; a script kept with more than one
experiment names the others with `--label`: `bench/results/<script>-<label>.json`.  Files that belong
to a record share its stem: `<stem>.md` (its table), `<stem>.png` (its plot) and `<stem>.<part>.<ext>`
for anything else (`verify_batched.sps.json`).  A newer run replaces the record; older ones stay in
git history.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
# top-level names of a checkout: an absolute path through one of them is cut to the part from there on
REPO_ENTRIES = ("bench", "conf", "deepspec", "docs", "recipes", "runs", "tests", "tools", ".venv")
ABSOLUTE_PATH = re.compile(r"(?<![\w.~:/])/[^\s'\",;:=)\]`]+")


def record_path(script: str, label: Optional[str] = None) -> Path:
    """`bench/results/<script>.json`, or `<script>-<label>.json` for a labelled experiment."""
    if label and not re.fullmatch(r"[A-Za-z0-9_]+", label):
        raise SystemExit(f"--label {label!r}: use letters, digits and underscores only")
    return RESULTS / (f"{script}-{label}.json" if label else f"{script}.json")


def part_path(record: Path, part: str, ext: str) -> Path:
    """A file that belongs to ``record``: `<stem>.<part>.<ext>` beside it."""
    record = Path(record)
    return record.with_name(f"{record.stem}.{part}.{ext}")


def repo_relative(text: str) -> str:
    """``text`` (a command line, a path) with every absolute path cut to what a reader can use:
    from the first top-level repository entry on (`/x/checkout/bench/work/a` → `bench/work/a`,
    `/x/checkout/.venv/bin/python` → `.venv/bin/python`), a Python interpreter elsewhere to its
    name, any other absolute path to `…/<name>`."""
    def cut(m: re.Match) -> str:
        parts = m.group(0).split("/")
        for i, part in enumerate(parts):
            if part in REPO_ENTRIES:
                return "/".join(parts[i:])
        name = parts[-1]
        return name if name.startswith("python") else f"…/{name}"
    return ABSOLUTE_PATH.sub(cut, text)


def write_record(record: dict, script: str, out: Optional[str] = None, label: Optional[str] = None) -> Path:
    """Write ``record`` as JSON to ``out`` or the script's `record_path`; print and return where."""
    import json
    path = Path(out) if out else record_path(script, label)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"→ {path}")
    return path
