"""SIGTERM / Ctrl-C as a graceful stop (`deepspec.utils.signals`) and regeneration stopped by a real SIGTERM.

The training loop has its own guard (tests/unit/test_train_signals.py, tests/integration/
test_train_resume.py); the cache build is stopped by SIGTERM in a real subprocess in
tests/integration/test_sigterm_cache.py.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from deepspec.config import load_config
from deepspec.utils.signals import GracefulStop, deferred, sigterm_as_interrupt

torch.set_num_threads(1)


def _deliver(sig):
    os.kill(os.getpid(), sig)
    time.sleep(0.05)   # the handler runs in the main thread at the next bytecode boundary


def test_sigterm_raises_graceful_stop_only_inside_the_block():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(GracefulStop) as ei:
        with sigterm_as_interrupt():
            _deliver(signal.SIGTERM)
            raise AssertionError("SIGTERM did not stop the block")
    assert isinstance(ei.value, KeyboardInterrupt) and ei.value.exit_code == 143
    assert "SIGTERM" in str(ei.value)
    assert signal.getsignal(signal.SIGTERM) is before


def test_commits_are_never_interrupted():
    sigint_before = signal.getsignal(signal.SIGINT)   # SIG_IGN when pytest runs in a background job
    done = []
    with pytest.raises(GracefulStop) as ei:
        with sigterm_as_interrupt():
            with deferred():              # e.g. appending + fsyncing finished samples
                _deliver(signal.SIGTERM)
                _deliver(signal.SIGINT)
                done.append("committed")  # still runs: both signals are held
            raise AssertionError("the held signal was not delivered after the commit")
    assert done == ["committed"] and ei.value.signum == signal.SIGTERM
    with pytest.raises(GracefulStop) as ei:   # Ctrl-C is held too, and reported as such (exit 130)
        with deferred():
            _deliver(signal.SIGINT)
            done.append("again")
    assert done[-1] == "again" and ei.value.exit_code == 130
    with pytest.raises(OSError):             # an error inside the commit wins over a held signal
        with sigterm_as_interrupt():
            with deferred():
                _deliver(signal.SIGTERM)
                raise OSError(28, "No space left on device")
    assert signal.getsignal(signal.SIGINT) is sigint_before   # every handler was restored


def test_other_threads_are_left_alone():
    seen = []

    def work():
        with sigterm_as_interrupt(), deferred():
            seen.append(signal.getsignal(signal.SIGTERM))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == [signal.getsignal(signal.SIGTERM)]


# -- regeneration stopped by SIGTERM ------------------------------------------------------------------
def _args(run_dir: Path, data: Path):
    return ["target.path=tiny:llama", "target.dtype=float32", "target.device=cpu", "data=jsonl",
            f"data.path={data}", f"run_dir={run_dir}", "data.heldout_fraction=0", "engine.max_new_tokens=5",
            "engine.batch_size=2", "engine.chunk_size=2", "engine.temperature=0.8", "engine.progress=false"]


def _cfg(run_dir: Path, data: Path):
    return load_config(_args(run_dir, data))


def _read(p: Path):
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def test_regeneration_stops_on_sigterm_with_whole_lines_and_resumes(tmp_path, capsys):
    from deepspec.engines.hf import HFEngine
    from deepspec.prepare.regen import main, regenerate
    from deepspec.prepare.regen_job import RegenPaths
    n = 24
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "turns": [f"say {i}"]}) + "\n" for i in range(n)))
    engine = HFEngine.from_config(_cfg(tmp_path, data), device="cpu")
    ref = _read(regenerate(_cfg(tmp_path / "ref", data), engine=engine))
    cfg = _cfg(tmp_path / "run", data)
    part = RegenPaths.from_config(cfg).parts / "rank00000.jsonl"

    stop = threading.Event()
    handler = signal.getsignal(signal.SIGTERM)

    def terminate_after_two_chunks():   # a real SIGTERM to this process, as a scheduler sends it
        while not stop.is_set():
            if part.is_file() and part.read_bytes().count(b"\n") >= 4:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.002)

    t = threading.Thread(target=terminate_after_two_chunks, daemon=True)
    t.start()
    try:
        with pytest.raises(GracefulStop) as ei:
            regenerate(cfg, engine=engine)
    finally:
        stop.set()
        t.join()
    assert ei.value.exit_code == 143
    err = capsys.readouterr().err
    assert "stopped by SIGTERM" in err and str(part.parent) in err and "resume" in err
    raw = part.read_bytes()
    assert raw.endswith(b"\n")                       # whole lines only: nothing half-written
    kept = [json.loads(x) for x in raw.splitlines()]
    assert 4 <= len(kept) < n and [e["i"] for e in kept] == list(range(len(kept)))
    assert not RegenPaths.from_config(cfg).output.exists()
    assert signal.getsignal(signal.SIGTERM) is handler   # the stage's handler is gone again

    # the re-run (through the stage's CLI entry point) resumes and equals the uninterrupted run
    assert main(_args(tmp_path / "run", data)) == 0
    assert f"resuming, {len(kept)} sample(s) already done" in capsys.readouterr().out
    got = _read(RegenPaths.from_config(cfg).output)
    assert [r["id"] for r in got] == [r["id"] for r in ref]
    assert [r["conversations"] for r in got] == [r["conversations"] for r in ref]
