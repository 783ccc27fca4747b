"""A real `deepspec cache build` process stopped with SIGTERM mid-shard.

Unlike SIGKILL (test_cache_procs.py, which leaves a temp file for the resume to clean up),
SIGTERM is a graceful stop: the shard being written is rolled back (or, if it was being
committed, finished), the process says what it kept and exits with 143, and no temp file is
left.  Every committed shard is intact, and the resumed build equals an uninterrupted one.
"""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deepspec.cache import CacheReader
from deepspec.cache.format import MANIFEST, shard_name, sidecar_name
from deepspec.cache.writer import build_cache
from tests.support.synthetic import write_regen_jsonl
from deepspec.config import load_config
from deepspec.targets import load_target

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
BASE = ["target.path=tiny:qwen3", "target.dtype=float32", "data.max_length=128", "cache.batch_tokens=256",
        "cache.encode_threads=1", "cache.shard_samples=4"]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def test_sigterm_mid_build_rolls_back_the_shard_and_resumes(tmp_path):
    torch.set_num_threads(1)
    regen = write_regen_jsonl(tmp_path / "regen.jsonl", 48, seed=11, max_words=25)
    target = load_target(load_config(BASE).target)
    ref = build_cache(load_config(BASE + [f"run_dir={tmp_path / 'ref'}"]), regen_path=regen, target=target,
                      progress=False)
    run = tmp_path / "run"
    cache = run / "cache"
    cmd = [sys.executable, "-m", "deepspec.cli", "cache", "build", *BASE, f"run_dir={run}", "--regen", str(regen),
           "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sent = False
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if cache.is_dir():
                names = os.listdir(cache)
                committed = sum(n.startswith("shard-") and n.endswith(".json") for n in names)
                writing = any(n.startswith(".tmp-") and n.endswith(".arrow") for n in names)
                if committed >= 2 and writing:
                    proc.send_signal(signal.SIGTERM)
                    sent = True
                    break
            time.sleep(0.005)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sent, f"the build ended before it could be stopped:\n{err[-3000:]}"
    assert proc.returncode == 143, err[-3000:]
    assert "stopped by SIGTERM" in err and "resume" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    names = sorted(os.listdir(cache))
    assert not [n for n in names if n.startswith(".tmp-")], names    # rolled back, nothing half-written
    assert MANIFEST not in names
    done = sorted(int(n[6:12]) for n in names if n.startswith("shard-") and n.endswith(".json"))
    assert len(done) >= 2 and len(done) < 12
    for k in done:   # each committed shard is complete: size and sha256 as recorded at commit
        sc = json.loads((cache / sidecar_name(k)).read_text())
        data = (cache / shard_name(k)).read_bytes()
        assert len(data) == sc["bytes"] and hashlib.sha256(data).hexdigest() == sc["sha256"]
    assert not [n for n in names if n.startswith("shard-") and n.endswith(".arrow") and int(n[6:12]) not in done]

    mtimes = {k: (cache / sidecar_name(k)).stat().st_mtime_ns for k in done}
    build_cache(load_config(BASE + [f"run_dir={run}"]), regen_path=regen, target=target, progress=False)
    assert all((cache / sidecar_name(k)).stat().st_mtime_ns == t for k, t in mtimes.items())   # not rebuilt
    ma, mb = (json.loads((d / MANIFEST).read_text()) for d in (ref, cache))
    assert [s["sha256"] for s in ma["shards"]] == [s["sha256"] for s in mb["shards"]]
    with CacheReader(cache) as r:
        assert r.verify() == [] and len(r) == ma["num_samples"]
