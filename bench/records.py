"""Where benchmark records live, how they are named, and how they are written.

One current record per benchmark, `bench/results/<name>.json`, where ``name`` is the script's name or,
for a script with modes, the record name of the mode (`bench/README.md` lists them); a script kept with
more than one experiment names the others with `--label`: `bench/results/<name>-<label>.json`.  Files
that belong to a record share its stem: `<stem>.md` (its table), `<stem>.png` (its plot) and
`<stem>.<part>.<ext>` for anything else (`verify_batched.sps.json`).  A newer run replaces the record;
older ones stay in git history.

Records name no machine's directories: `write_record` stores every path relative to the checkout
(`repo_relative`), so a record reads the same on every machine that has the checkout.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import sys
from pathlib import Path, PurePath
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
# top-level names of a checkout: an absolute path through one of them is cut to the part from there on
REPO_ENTRIES = ("bench", "conf", "deepspec", "docs", "recipes", "runs", "tests", "tools", ".venv")
ABSOLUTE_PATH = re.compile(r"(?<![\w.~:/…])/[^\s'\",;:=)\]`]+")


def record_path(name: str, label: Optional[str] = None) -> Path:
    """`bench/results/<name>.json`, or `<name>-<label>.json` for a labelled experiment."""
    if label and not re.fullmatch(r"[A-Za-z0-9_]+", label):
        raise SystemExit(f"--label {label!r}: use letters, digits and underscores only")
    return RESULTS / (f"{name}-{label}.json" if label else f"{name}.json")


def part_path(record: Path, part: str, ext: str) -> Path:
    """A file that belongs to ``record``: `<stem>.<part>.<ext>` beside it."""
    record = Path(record)
    return record.with_name(f"{record.stem}.{part}.{ext}")


def repo_relative(text: str) -> str:
    """``text`` (a command line, a path) with every absolute path cut to what a reader can use:
    from the first top-level repository entry on (`/x/checkout/bench/work/a` → `bench/work/a`,
    `/x/checkout/.venv/bin/python` → `.venv/bin/python`), a Python interpreter elsewhere to its
    name, any other absolute path to `…/<name>`.  Applying it twice changes nothing."""
    def cut(m: re.Match) -> str:
        parts = m.group(0).split("/")
        for i, part in enumerate(parts):
            if part in REPO_ENTRIES:
                return "/".join(parts[i:])
        name = parts[-1]
        return name if name.startswith("python") else f"…/{name}"
    return ABSOLUTE_PATH.sub(cut, text)


def relative_paths(obj: Any) -> Any:
    """``obj`` (a record: dicts, lists, strings, paths, numbers) with `repo_relative` applied to every
    string and path in it, dictionary keys included."""
    if isinstance(obj, (str, PurePath)):
        return repo_relative(str(obj))
    if isinstance(obj, dict):
        return {relative_paths(k) if isinstance(k, str) else k: relative_paths(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [relative_paths(v) for v in obj]
    return obj


def header(**fields: Any) -> dict:
    """The fields every record starts with: the date (UTC), the command line and the machine (its torch
    and thread count when torch is loaded), then ``fields``."""
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "python": platform.python_version(), "cpus": os.cpu_count(), "loadavg_start": _loadavg()}
    torch = sys.modules.get("torch")
    if torch is not None:
        machine.update(torch=torch.__version__, threads=torch.get_num_threads())
    return {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([sys.executable, *sys.argv]), "machine": machine, **fields}


def _loadavg():
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def write_record(record: dict, script: str, out: Optional[str] = None, label: Optional[str] = None,
                 markdown: Optional[str] = None) -> Path:
    """Write ``record`` as JSON, every path in it repo-relative, to ``out`` or `record_path(script,
    label)`; ``markdown`` (its table) goes beside it as `<stem>.md`.  Adds the machine's load average at
    the end to a `header` record.  Prints and returns the record's path."""
    path = Path(out) if out else record_path(script, label)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(record.get("machine"), dict) and "loadavg_start" in record["machine"]:
        record["machine"].setdefault("loadavg_end", _loadavg())
    path.write_text(json.dumps(relative_paths(record), indent=2, default=str) + "\n")
    if markdown is not None:
        path.with_suffix(".md").write_text(repo_relative(markdown).rstrip("\n") + "\n")
    print(f"→ {path}")
    return path
