"""Benchmark prompts: ``{"turns": [...]}`` JSONL files under ``eval.data_dir``.

One file per benchmark (``<name>.jsonl``), one conversation per line: the user turns
in order (mt-bench has two).  Files are read in place, never copied.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..data.prompts import read_turns_file
from ..config.loader import project_root

__all__ = ["DOMAINS", "BENCHMARK_DOMAIN", "Sample", "domain_of", "resolve_data_dir", "benchmark_path",
           "load_benchmark", "load_benchmarks"]

DOMAINS: Dict[str, tuple] = {
    "math": ("gsm8k", "math500", "aime25"),
    "code": ("humaneval", "mbpp", "livecodebench"),
    "chat": ("mt-bench", "arena-hard-v2", "alpaca"),
}
BENCHMARK_DOMAIN: Dict[str, str] = {b: d for d, bs in DOMAINS.items() for b in bs}


def domain_of(benchmark: str) -> str:
    """math | code | chat for the paper's benchmarks, ``other`` for anything else."""
    return BENCHMARK_DOMAIN.get(benchmark, "other")


@dataclass
class Sample:
    benchmark: str
    index: int
    turns: List[str]

    @property
    def id(self) -> str:
        return f"{self.benchmark}/{self.index}"

    @property
    def domain(self) -> str:
        return domain_of(self.benchmark)


def resolve_data_dir(data_dir: str | os.PathLike) -> Path:
    """An absolute path as is; a relative one against the working directory, then the repo root."""
    p = Path(data_dir).expanduser()
    if p.is_absolute():
        return p
    if p.is_dir():
        return p.resolve()
    alt = project_root() / p
    return alt.resolve() if alt.is_dir() else p


def benchmark_path(data_dir: str | os.PathLike, name: str) -> Path:
    root = resolve_data_dir(data_dir)
    path = root / f"{name}.jsonl"
    if not path.is_file():
        have = sorted(q.stem for q in root.glob("*.jsonl")) if root.is_dir() else []
        where = f"{root} has: {', '.join(have)}" if have else f"{root} is missing or empty"
        raise FileNotFoundError(f"benchmark {name!r}: no file {path} ({where}); "
                                "set eval.data_dir or eval.benchmarks")
    return path


def load_benchmark(data_dir: str | os.PathLike, name: str, max_samples: Optional[int] = None) -> List[Sample]:
    """The first ``max_samples`` conversations of ``<data_dir>/<name>.jsonl``."""
    path = benchmark_path(data_dir, name)
    return [Sample(benchmark=name, index=i, turns=turns)
            for i, turns in enumerate(read_turns_file(path, max_rows=max_samples))]


def load_benchmarks(data_dir: str | os.PathLike, names: Sequence[str],
                    max_samples: Optional[int] = None) -> Dict[str, List[Sample]]:
    """All requested benchmarks (fails before any model is loaded if one is missing)."""
    return {n: load_benchmark(data_dir, n, max_samples) for n in names}
