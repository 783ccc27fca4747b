"""Synthetic regenerated conversations for tests, smoke runs and probes (deterministic)."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Dict, List

_WORDS = ("the quick brown fox jumps over lazy dog def add return print range import math sqrt "
          "speculative decoding drafts several tokens verifies target pass what is times let then "
          "write poem about sea waves roll gulls cry hello how can help you today sure here answer "
          "with some detail natalia sold clips friends april may half many").split()


def make_conversation(rng: random.Random, i: int, max_words: int = 60) -> Dict[str, Any]:
    turns = rng.randint(1, 3)
    conv: List[Dict[str, str]] = []
    if rng.random() < 0.3:
        conv.append({"role": "system", "content": "You are a helpful assistant."})
    for _ in range(turns):
        for role in ("user", "assistant"):
            n = rng.randint(1, max_words)
            text = " ".join(rng.choice(_WORDS) for _ in range(n))
            conv.append({"role": role, "content": text.capitalize() + rng.choice([".", "?", "!", ""])})
    return {"id": f"s{i:05d}", "conversations": conv, "meta": {"synthetic": True}}


def write_regen_jsonl(path, n: int, seed: int = 0, max_words: int = 60) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps(make_conversation(rng, i, max_words)) + "\n")
    return path


def tiny_cache_config(tmp, codec: str, **extra):
    """A config building a small cache of ``tmp/regen.jsonl`` with ``codec`` on the tiny Llama target
    (2 feature layers, 4 records per shard, a 400-token codec calibration) into ``tmp/cache-<codec>``."""
    from deepspec.config import load_config
    kw = {"run_dir": str(Path(tmp) / "run"), "target.path": "tiny:llama", "target.dtype": "float32",
          "target.num_feature_layers": 2, "data.regen_path": str(Path(tmp) / "regen.jsonl"),
          "data.max_length": 96, "cache.dir": str(Path(tmp) / f"cache-{codec}"), "cache.codec": codec,
          "cache.shard_samples": 4, "cache.rank": 16, "cache.calib_tokens": 400}
    kw.update(extra)
    return load_config([f"{k}={v}" for k, v in kw.items()])
