"""Real processes: a build killed with SIGKILL resumes to the same bytes; torchrun 2 ranks == 1 rank."""
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
from deepspec.cache.format import MANIFEST
from deepspec.cache.writer import build_cache
from tests.support.synthetic import write_regen_jsonl
from deepspec.config import load_config
from deepspec.targets import load_target

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
BASE = ["target.path=tiny:qwen3", "target.dtype=float32", "data.max_length=128", "cache.batch_tokens=256",
        "cache.encode_threads=1"]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _overrides(run_dir, shard_samples):
    return BASE + [f"run_dir={run_dir}", f"cache.shard_samples={shard_samples}"]


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return load_target(load_config(BASE).target)


def _same_cache(a: Path, b: Path) -> None:
    ma, mb = json.loads((a / MANIFEST).read_text()), json.loads((b / MANIFEST).read_text())
    assert [s["sha256"] for s in ma["shards"]] == [s["sha256"] for s in mb["shards"]]
    ra, rb = CacheReader(a), CacheReader(b)
    assert len(ra) == len(rb) == ma["num_samples"]
    assert ra.ids == rb.ids
    for i in range(len(ra)):
        x, y = ra[i], rb[i]
        for k in x:
            u, v = x[k], y[k]
            if u.is_floating_point():
                u, v = u.view(torch.int16), v.view(torch.int16)
            assert torch.equal(u, v), (i, k)
    assert not rb.verify()


def test_kill9_mid_build_then_resume_is_bit_identical(tmp_path, target):
    regen = write_regen_jsonl(tmp_path / "regen.jsonl", 120, seed=7, max_words=25)
    ref = build_cache(load_config(_overrides(tmp_path / "ref", 4)), regen_path=regen, target=target,
                      progress=False)
    run = tmp_path / "run"
    cache = run / "cache"
    cmd = [sys.executable, "-m", "deepspec.cli", "cache", "build", *_overrides(run, 4), "--regen", str(regen),
           "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    killed_mid_write = False
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if cache.is_dir():
                names = os.listdir(cache)
                committed = sum(n.endswith(".json") and n.startswith("shard-") for n in names)
                writing = any(n.startswith(".tmp-") and n.endswith(".arrow") for n in names)
                if committed >= 2 and writing:
                    os.kill(proc.pid, signal.SIGKILL)
                    killed_mid_write = True
                    break
            time.sleep(0.005)
    finally:
        if proc.poll() is None and not killed_mid_write:
            proc.kill()
        out = proc.communicate(timeout=60)[0].decode(errors="replace")
    assert killed_mid_write, f"the build ended before it could be killed:\n{out[-3000:]}"
    assert proc.returncode == -signal.SIGKILL
    assert not (cache / MANIFEST).exists()
    leftovers = [n for n in os.listdir(cache) if n.startswith(".tmp-")]
    assert leftovers  # the interrupted shard is only a temp file, never a visible shard
    # restart (in this process: same code path as the CLI) → finishes the missing shards only
    done_before = {n for n in os.listdir(cache) if n.startswith("shard-") and n.endswith(".json")}
    mtimes = {n: (cache / n).stat().st_mtime_ns for n in done_before}
    build_cache(load_config(_overrides(run, 4)), regen_path=regen, target=target, progress=False)
    assert all((cache / n).stat().st_mtime_ns == t for n, t in mtimes.items())  # not rebuilt
    _same_cache(ref, cache)


def test_torchrun_two_ranks_equal_one_rank(tmp_path, target):
    regen = write_regen_jsonl(tmp_path / "regen.jsonl", 40, seed=11, max_words=25)
    one = build_cache(load_config(_overrides(tmp_path / "one", 3)), regen_path=regen, target=target,
                      progress=False)
    run = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "deepspec.cli", "cache", "build", *_overrides(run, 3), "--regen", str(regen), "--no-progress"]
    res = subprocess.run(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         timeout=300)
    out = res.stdout.decode(errors="replace")
    assert res.returncode == 0, out[-4000:]
    assert "rank 0/2" in out and "rank 1/2" in out
    _same_cache(one, run / "cache")
