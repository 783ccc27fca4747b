"""`regenerate(cfg)` end to end on tiny targets: both engines, faults, errors, resume, kill -9."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from deepspec.data.split import is_heldout

from deepspec.config import load_config
from deepspec.engines.handler import Faults
from deepspec.engines.server import serve_in_thread
from deepspec.prepare.regen import regenerate
from deepspec.prepare.regen_job import RegenError

pytestmark = pytest.mark.integration
torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]


def _write_input(path: Path, n: int, bad_line: bool = False) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            if i % 3 == 0:  # ShareGPT, two user turns, a system prompt
                rec = {"id": f"s{i}", "conversations": [
                    {"from": "system", "value": "You are terse."}, {"from": "human", "value": f"question {i}"},
                    {"from": "gpt", "value": "old answer"}, {"from": "human", "value": "and why?"},
                    {"from": "gpt", "value": "old answer 2"}]}
            elif i % 3 == 1:
                rec = {"id": f"s{i}", "turns": [f"tell me about {i}"]}
            else:
                rec = {"conversations": [{"role": "user", "content": f"hello {i}"}]}  # no id: hashed
            f.write(json.dumps(rec) + "\n")
            if bad_line and i == 1:
                f.write("{this is not json\n")
    return path


def _overrides(tmp: Path, data: Path, *extra: str):
    return ["target.path=tiny:llama", "target.dtype=float32", "target.device=cpu", "data=jsonl",
            f"data.path={data}", f"run_dir={tmp / 'run'}", "data.heldout_fraction=0.25", "data.split_seed=1",
            "engine.max_new_tokens=6", "engine.batch_size=4", "engine.temperature=0.8", "engine.progress=false",
            *extra]


def _read(p: Path):
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def test_hf_engine_end_to_end(tmp_path, capsys):
    data = _write_input(tmp_path / "in.jsonl", 12, bad_line=True)
    cfg = load_config(_overrides(tmp_path, data, "data.on_error=skip"))
    out = regenerate(cfg)
    regen_dir = tmp_path / "run" / "regen"
    assert out == regen_dir / "regen.jsonl"
    rows = _read(out)
    held = _read(regen_dir / "heldout.jsonl")
    ingest_errors = _read(regen_dir / "errors.jsonl")
    assert len(ingest_errors) == 1 and ingest_errors[0]["origin"].endswith("in.jsonl:3")
    assert ingest_errors[0]["reason"] == "invalid_json"
    # every valid sample regenerated exactly once (input order); the held-out ones (by id hash) also
    # have their prompts in heldout.jsonl, for evaluation
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 12 and {h["id"] for h in held} < set(ids)
    assert {h["id"] for h in held} == {i for i in ids if is_heldout(i, 0.25, 1)}
    order = [r["meta"]["origin"] for r in rows]
    assert order == sorted(order, key=lambda o: int(o.rsplit(":", 1)[1]))
    assert held and all(h["turns"] for h in held)
    for r in rows:
        conv, meta = r["conversations"], r["meta"]
        assert conv[-1]["role"] == "assistant"
        users = [m for m in conv if m["role"] == "user"]
        assert len([m for m in conv if m["role"] == "assistant"]) == len(users) == meta["turns"]
        assert "old answer" not in [m["content"] for m in conv]
        assert meta["engine"] == "hf" and meta["sampling"]["temperature"] == 0.8
        assert meta["num_tokens"] == sum(meta["turn_tokens"]) > 0 and meta["finish_reason"] in ("stop", "length")
        if r["id"] in {"s0", "s3", "s6", "s9"}:   # the ShareGPT records with a system prompt
            assert conv[0] == {"role": "system", "content": "You are terse."} and len(users) == 2
    assert _read(regen_dir / "regen.errors.jsonl") == []
    assert not (regen_dir / "regen.jsonl.parts").exists()
    job = json.loads((regen_dir / "regen.jsonl.job.json").read_text())
    assert job["complete"] and job["ok"] == len(rows) and job["failed"] == 0
    sp = job["speed"]   # this run's generation rate, in the record and the summary line
    assert sp["new_tokens"] == job["num_tokens"] and sp["seconds"] > 0 and sp["tokens_per_s"] > 0
    printed = capsys.readouterr().out
    assert "1 skipped" in printed and "held-out" in printed and " tok/s" in printed
    # a re-run with the same config does nothing (and builds no engine)
    before = out.read_bytes()
    regenerate(cfg)
    assert "already complete" in capsys.readouterr().out and out.read_bytes() == before
    # a different config refuses to mix with this job
    cfg2 = load_config(_overrides(tmp_path, data, "data.on_error=skip", "engine.temperature=0.5"))
    with pytest.raises(RegenError, match="engine.resume=false"):
        regenerate(cfg2)
    cfg3 = load_config(_overrides(tmp_path, data, "data.on_error=skip", "engine.temperature=0.5",
                                  "engine.resume=false"))
    regenerate(cfg3)
    assert [r["id"] for r in _read(out)] == ids and out.read_bytes() != before


def test_too_long_prompt_is_a_final_failure(tmp_path, capsys):
    """A prompt longer than the engine takes fails with a named code; a re-run keeps that failure
    instead of loading the engine again to retry it (it would fail the same way)."""
    data = tmp_path / "in.jsonl"
    rows = [{"id": f"q{i}", "turns": [f"short question {i}"]} for i in range(6)]
    rows[2] = {"id": "long", "turns": ["word " * 400]}
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(_overrides(tmp_path, data, "data.heldout_fraction=0", "engine.max_prompt_tokens=64"))
    out = regenerate(cfg)
    errs = _read(out.parent / "regen.errors.jsonl")
    assert [(e["id"], e["code"]) for e in errs] == [("long", "prompt_too_long")]
    assert [r["id"] for r in _read(out)] == [f"q{i}" for i in range(6) if i != 2]
    printed = capsys.readouterr().out
    assert "1 failed" in printed and "final" in printed and "re-run to retry" not in printed
    job = json.loads((out.parent / "regen.jsonl.job.json").read_text())
    assert job["failed"] == 1 and job["retryable"] == 0
    before = out.read_bytes()
    regenerate(cfg)
    assert "already complete (5 samples, 1 failed)" in capsys.readouterr().out and out.read_bytes() == before


def test_bad_input_stops_with_file_and_line(tmp_path):
    from deepspec.data import DataError
    data = _write_input(tmp_path / "in.jsonl", 4, bad_line=True)
    with pytest.raises(DataError, match=r"in\.jsonl:3"):
        regenerate(load_config(_overrides(tmp_path, data)))


def test_openai_engine_with_faults_errors_and_retry(tmp_path):
    """Through the real server: retried 500s and stalls, a permanently failing sample goes to the
    error file, and a re-run retries just that sample.  Texts equal the embedded engine's."""
    data = _write_input(tmp_path / "in.jsonl", 9)
    hf_cfg = load_config(_overrides(tmp_path / "hf", data))
    from deepspec.engines.hf import HFEngine
    engine = HFEngine.from_config(hf_cfg, device="cpu")
    ref = _read(regenerate(hf_cfg, engine=engine))

    victim = "tell me about 4"
    faults = Faults(fail_every=4, stall_every=7, stall_s=2.5,
                    fail_when=lambda b: any(m.get("content") == victim for m in b.get("messages", [])))
    with serve_in_thread(engine, faults=faults) as h:
        os.environ["DEEPSPEC_TEST_KEY"] = "not-a-real-key-123"
        try:
            ov = _overrides(tmp_path / "oa", data, "engine.kind=openai", f"engine.servers=[{h.url}]",
                            "engine.concurrency=3", "engine.max_retries=3", "engine.backoff_s=0.01",
                            "engine.timeout_s=1", "engine.api_key_env=DEEPSPEC_TEST_KEY")
            cfg = load_config(ov)
            out = regenerate(cfg)
        finally:
            del os.environ["DEEPSPEC_TEST_KEY"]
        assert faults.failed > 1 and faults.stalled >= 1
    regen_dir = out.parent
    rows, errs = _read(out), _read(regen_dir / "regen.errors.jsonl")
    want = [r["id"] for r in ref]
    assert [e["id"] for e in errs] == ["s4"] and errs[0]["attempts"] == 4 and errs[0]["code"] == "http_error"
    assert [r["id"] for r in rows] == [i for i in want if i != "s4"]
    # same per-sample seeds → same text as the embedded engine
    ref_by_id = {r["id"]: r["conversations"] for r in ref}
    assert all(r["conversations"] == ref_by_id[r["id"]] for r in rows)
    assert rows[0]["meta"]["engine"] == "openai"
    assert (regen_dir / "regen.jsonl.parts").is_dir()  # kept: failures are retried on a re-run
    for f in regen_dir.rglob("*"):
        if f.is_file():
            assert "not-a-real-key-123" not in f.read_text(errors="replace")

    with serve_in_thread(engine) as h2:  # healthy server now: only s4 is regenerated
        cfg = load_config([o if not o.startswith("engine.servers=") else f"engine.servers=[{h2.url}]"
                           for o in ov])
        regenerate(cfg)
    rows = _read(out)
    assert [r["id"] for r in rows] == want and _read(regen_dir / "regen.errors.jsonl") == []
    assert all(r["conversations"] == ref_by_id[r["id"]] for r in rows)
    assert not (regen_dir / "regen.jsonl.parts").exists()


SCRIPT = ("import sys, torch; torch.set_num_threads(1); "
          "from deepspec.config import load_config; from deepspec.prepare.regen import regenerate; "
          "regenerate(load_config(sys.argv[1:]))")


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    return env


def test_kill_dash_9_and_resume(tmp_path, capsys):
    """A real subprocess killed with SIGKILL mid-run; the re-run finishes with every sample once,
    in input order, and the same texts as an uninterrupted run (per-sample seeds)."""
    n = 40
    data = _write_input(tmp_path / "in.jsonl", n)
    job = ("engine.max_new_tokens=16", "engine.batch_size=2", "engine.chunk_size=2")
    ov = _overrides(tmp_path / "killed", data, *job)
    parts = tmp_path / "killed" / "run" / "regen" / "regen.jsonl.parts"
    log = open(tmp_path / "child.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, *ov], cwd=REPO, env=_env(), stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            lines = sum(len(f.read_bytes().splitlines()) for f in parts.glob("*.jsonl")) if parts.is_dir() else 0
            if lines >= 4:
                break
            time.sleep(0.02)
        assert proc.poll() is None, f"the child ended before it could be killed:\n{(tmp_path / 'child.log').read_text()}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert proc.returncode == -signal.SIGKILL
    out = tmp_path / "killed" / "run" / "regen" / "regen.jsonl"
    assert not out.exists()
    done_before = sum(len(f.read_bytes().splitlines()) for f in parts.glob("*.jsonl"))
    assert 0 < done_before
    with open(next(parts.glob("*.jsonl")), "ab") as f:  # and a torn line, as a kill mid-write leaves
        f.write(b'{"i": 999, "id": "torn", "ok": tr')

    capsys.readouterr()
    regenerate(load_config(ov))  # the same command again
    assert "resuming" in capsys.readouterr().out
    rows = _read(out)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids))
    # an uninterrupted run of the same job, for comparison
    straight = _read(regenerate(load_config(_overrides(tmp_path / "straight", data, *job))))
    assert ids == [r["id"] for r in straight]
    assert [r["conversations"] for r in rows] == [r["conversations"] for r in straight]
    held = _read(out.parent / "heldout.jsonl")
    assert len(ids) == n and {h["id"] for h in held} < set(ids)
