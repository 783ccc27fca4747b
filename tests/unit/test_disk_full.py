"""Disk full during regeneration, cache build and checkpointing (injected ENOSPC).

The error is injected exactly where the component writes (its ``open``/``write``/``os.replace``
or safetensors' ``save_file``), the way a full disk reports it: a partial write followed by
``OSError(ENOSPC)`` without a file name (safetensors: ``SafetensorError`` "... os error 28").
Each stage must stop with a message naming the file, keep the last complete state intact and
verifiable (part lines, committed shards, older checkpoints; no temp files left behind), and —
once space is back — resume to exactly the result of an uninterrupted run.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from deepspec.config import load_config

torch.set_num_threads(1)


class _FullDisk:
    """A real file whose ``fail_at``-th write stores half of its bytes, then reports ENOSPC."""

    def __init__(self, f, state):
        self._f, self._state = f, state

    def write(self, b):
        self._state["writes"] += 1
        if self._state["writes"] >= self._state["fail_at"]:
            half = bytes(b)[: len(b) // 2]
            self._f.write(half)
            self._state["failed"] += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._f.write(b)

    def __getattr__(self, name):
        return getattr(self._f, name)


def _enospc():
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _read(p: Path):
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


# -- regeneration --------------------------------------------------------------------------------
def _prompts(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "turns": [f"tell me about {i}"]}) + "\n" for i in range(n)))
    return path


def _regen_args(run_dir: Path, data: Path):
    return ["target.path=tiny:llama", "target.dtype=float32", "target.device=cpu", "data=jsonl",
            f"data.path={data}", f"run_dir={run_dir}", "data.heldout_fraction=0", "engine.max_new_tokens=5",
            "engine.batch_size=2", "engine.chunk_size=2", "engine.temperature=0.8", "engine.progress=false"]


def _regen_cfg(run_dir: Path, data: Path):
    return load_config(_regen_args(run_dir, data))


@pytest.fixture(scope="module")
def engine():
    from deepspec.engines.hf import HFEngine
    return HFEngine.from_config(_regen_cfg(Path("/tmp/unused"), Path("/tmp/unused.jsonl")), device="cpu")


def test_regeneration_disk_full_keeps_whole_lines_and_resumes(tmp_path, engine, monkeypatch, capsys):
    from deepspec.prepare import parts
    from deepspec.prepare.regen import regenerate
    from deepspec.prepare.regen_job import RegenPaths
    data = _prompts(tmp_path / "in.jsonl", 8)
    ref = _read(regenerate(_regen_cfg(tmp_path / "ref", data), engine=engine))
    cfg = _regen_cfg(tmp_path / "run", data)
    paths = RegenPaths.from_config(cfg)

    # 1) the third append (third chunk of 2 samples) hits a full disk half-way
    state = {"writes": 0, "fail_at": 3, "failed": 0}
    real_open = open

    def opener(path, *a, **k):   # only the part files (job.json etc. are written through other opens)
        f = real_open(path, *a, **k)
        return _FullDisk(f, state) if Path(path).name.startswith("rank") else f

    monkeypatch.setattr(parts, "open", opener, raising=False)
    with pytest.raises(OSError) as ei:
        regenerate(cfg, engine=engine)
    monkeypatch.undo()
    assert state["failed"] == 1 and ei.value.errno == errno.ENOSPC
    part = paths.parts / "rank00000.jsonl"
    assert str(part) in str(ei.value) and "re-run" in str(ei.value)
    raw = part.read_bytes()
    assert raw.endswith(b"\n"), "the half-written line was not cut off"
    kept = [json.loads(x) for x in raw.splitlines()]
    assert [e["i"] for e in kept] == [0, 1, 2, 3] and all(e["ok"] for e in kept)
    assert not paths.output.exists()

    # 2) space is back, but the final file cannot be written at first: no half file is left
    real_replace = os.replace

    def replace(src, dst, *a, **k):
        if Path(dst) == paths.output:
            raise _enospc()
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="regen.jsonl") as ei:
        regenerate(cfg, engine=engine)
    assert ei.value.errno == errno.ENOSPC and not paths.output.exists()
    # the same through `deepspec prepare`: one line naming the file, exit status 1, no traceback
    from deepspec.cli import main as cli
    capsys.readouterr()
    assert cli(["prepare", *_regen_args(tmp_path / "run", data)]) == 1
    err = capsys.readouterr().err
    assert f"deepspec prepare: [Errno {errno.ENOSPC}]" in err and str(paths.output) in err
    assert "Traceback" not in err and "run the same command again" in err
    monkeypatch.undo()
    assert not [p for p in paths.output.parent.iterdir() if ".tmp." in p.name]
    assert len(_read(part)) == 8      # every sample finished and kept

    # 3) resume: nothing is generated twice and the result is the uninterrupted one
    out = regenerate(cfg, engine=engine)
    got = _read(out)
    assert [r["id"] for r in got] == [r["id"] for r in ref]
    assert [r["conversations"] for r in got] == [r["conversations"] for r in ref]


# -- cache build -----------------------------------------------------------------------------------
def _cache_cfg(run_dir):
    return load_config(["target.path=tiny:llama", "target.dtype=float32", "cache.shard_samples=2",
                        "data.max_length=64", "cache.batch_tokens=200", "cache.encode_threads=1", f"run_dir={run_dir}"])


def test_cache_build_disk_full_keeps_committed_shards_and_resumes(tmp_path, monkeypatch):
    from deepspec.cache import CacheReader
    from deepspec.cache import format as fmt
    from deepspec.cache.format import MANIFEST, shard_name, sidecar_name
    from deepspec.cache.writer import build_cache
    from tests.support.synthetic import write_regen_jsonl
    from deepspec.targets import load_target
    regen = write_regen_jsonl(tmp_path / "regen.jsonl", 8, seed=5, max_words=8)
    target = load_target(_cache_cfg(tmp_path).target)
    ref = build_cache(_cache_cfg(tmp_path / "ref"), regen_path=regen, target=target, progress=False)
    cfg = _cache_cfg(tmp_path / "run")
    from deepspec.paths import cache_dir
    out = cache_dir(cfg)

    # 1) the disk fills up in the middle of the third shard (its third write)
    state = {"writes": 0, "fail_at": 10 ** 9, "failed": 0}
    real_open = open

    def opener(path, *a, **k):
        f = real_open(path, *a, **k)
        if shard_name(2) in str(path):
            state["fail_at"] = state["writes"] + 3
            return _FullDisk(f, state)
        return f

    monkeypatch.setattr(fmt, "open", opener, raising=False)
    with pytest.raises(OSError) as ei:
        build_cache(cfg, regen_path=regen, target=target, progress=False)
    monkeypatch.undo()
    assert state["failed"] >= 1 and ei.value.errno == errno.ENOSPC   # (rolling back may hit the full disk again)
    assert shard_name(2) in str(ei.value) and str(out) in str(ei.value)
    names = sorted(os.listdir(out))
    assert not [n for n in names if n.startswith(".tmp-")], names        # the torn shard was rolled back
    assert MANIFEST not in names and shard_name(2) not in names
    for k in (0, 1):   # the committed shards are intact: size and sha256 as recorded at commit
        sc = json.loads((out / sidecar_name(k)).read_text())
        data = (out / shard_name(k)).read_bytes()
        assert len(data) == sc["bytes"] and hashlib.sha256(data).hexdigest() == sc["sha256"]
    committed = {n: (out / n).stat().st_mtime_ns for n in names if n.endswith(".json") and n.startswith("shard-")}

    # 2) space is back, but the manifest cannot be written at first: no manifest, no temp file
    real_replace = os.replace

    def replace(src, dst, *a, **k):
        if Path(dst).name == MANIFEST:
            raise _enospc()
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match=MANIFEST):
        build_cache(cfg, regen_path=regen, target=target, progress=False)
    monkeypatch.undo()
    assert not (out / MANIFEST).exists() and not [n for n in os.listdir(out) if n.startswith(".tmp-")]

    # 3) resume: the committed shards are not rebuilt; the cache equals the uninterrupted one
    build_cache(cfg, regen_path=regen, target=target, progress=False)
    assert all((out / n).stat().st_mtime_ns == t for n, t in committed.items())
    ma, mb = (json.loads((d / MANIFEST).read_text()) for d in (ref, out))
    assert [s["sha256"] for s in ma["shards"]] == [s["sha256"] for s in mb["shards"]]
    with CacheReader(out) as r:
        assert r.verify(decode=True) == [] and len(r) == ma["num_samples"]


# -- checkpointing ---------------------------------------------------------------------------------
def _train_overrides(run_dir: Path, regen: Path):
    kw = {"target.path": "tiny:llama", "target.dtype": "float32", "target.num_feature_layers": 2,
          "draft.algorithm": "dspark", "draft.num_layers": 1, "draft.gamma": 4, "draft.head_rank": 16,
          "data.online": "true", "data.regen_path": str(regen), "run_dir": str(run_dir),
          "train.global_batch_sequences": 4, "train.micro_batch_sequences": 2, "train.anchors_per_sequence": 8,
          "train.max_steps": 4, "train.save_every": 2, "train.eval_every": 0, "train.bf16": "false",
          "data.heldout_fraction": 0.2, "train.warmup_ratio": 0.25, "train.keep_last": 0,
          "train.strategy": "single"}
    return [f"{k}={v}" for k, v in kw.items()]


def test_checkpoint_disk_full_keeps_the_last_checkpoint_and_resumes(tmp_path, monkeypatch):
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from tests.support.synthetic import write_regen_jsonl
    from deepspec.train import checkpoint as ckpt
    from deepspec.train.loop import run
    monkeypatch.setenv("DEEPSPEC_NO_PROGRESS", "1")
    regen = write_regen_jsonl(tmp_path / "regen.jsonl", 16, seed=2, max_words=12)
    ref = run(load_config(_train_overrides(tmp_path / "ref", regen)))
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"

    # 1) writing step_4's optimizer state fills the disk (safetensors' own error, no file name)
    real_save = ckpt.save_file

    def save_file(tensors, filename, *a, **k):
        if "step_4" in str(filename) and filename.endswith("optimizer.safetensors"):
            real_save(tensors, filename, *a, **k)
            with open(filename, "r+b") as f:     # what reached the disk: a torn file
                f.truncate(os.path.getsize(filename) // 2)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real_save(tensors, filename, *a, **k)

    monkeypatch.setattr(ckpt, "save_file", save_file)
    with pytest.raises(RuntimeError) as ei:
        run(load_config(_train_overrides(run_dir, regen)))
    monkeypatch.setattr(ckpt, "save_file", real_save)
    msg = str(ei.value)
    assert str(root / "step_4") in msg and "No space left on device" in msg and "step_2" in msg
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [2]
    assert not [p.name for p in root.iterdir() if p.name.startswith("step_4")]   # partial copy removed
    assert ckpt.load_training_state(root / "step_2").step == 2                    # intact and loadable

    # 2) space is back: resume from step_2 and finish exactly like the uninterrupted run
    final = run(load_config(_train_overrides(run_dir, regen)))
    assert final == root / "step_4"
    wa = load_file(str(ref / "training_state" / "master_weights.safetensors"))
    wb = load_file(str(final / "training_state" / "master_weights.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
