"""The OpenAI-compatible client against the real `deepspec serve` server on loopback."""
from __future__ import annotations

import socket

import pytest
import torch

from deepspec.engines.base import EngineError, GenerationError, SamplingParams
from deepspec.engines.handler import Faults
from deepspec.engines.hf import HFEngine
from deepspec.engines.openai_client import OpenAIEngine, normalise_url, read_api_key
from deepspec.engines.server import serve_in_thread

torch.set_num_threads(1)
SP = SamplingParams(max_new_tokens=5, temperature=0.9, seed=3)


@pytest.fixture(scope="module")
def engine():
    from deepspec.targets.tiny import build_tiny
    model, tok = build_tiny("llama")
    return HFEngine(model.float(), tok, batch_size=4, max_prompt_tokens=64)


def _prompts(n):
    return [[{"role": "user", "content": f"question {i}"}] for i in range(n)]


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _client(urls, **kw):
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("backoff_max_s", 0.05)
    kw.setdefault("timeout_s", 30)
    kw.setdefault("concurrency", 2)
    return OpenAIEngine(urls, **kw)


def test_same_text_as_embedded_engine(engine):
    keys = [f"k{i}" for i in range(6)]
    ref = engine.generate(_prompts(6), SP, keys=keys)
    with serve_in_thread(engine, model_name="tiny") as h:
        c = _client([h.url + "/v1/"])
        assert c.model == "tiny"
        out = c.generate(_prompts(6), SP, keys=keys)
    assert out == ref and all(o.num_tokens == 5 for o in out)


def test_retries_on_500_and_stalls(engine):
    with serve_in_thread(engine, faults=Faults(fail_every=2, stall_every=5, stall_s=3.0)) as h:
        c = _client([h.url], timeout_s=1.0, max_retries=6)
        out = c.generate(_prompts(8), SP, keys=[str(i) for i in range(8)])
        assert all(isinstance(o, str) for o in out), out
        assert h.server.faults.failed > 0 and h.server.faults.stalled > 0


def test_permanent_failure_after_retries(engine):
    faults = Faults(fail_when=lambda body: body.get("messages", [{}])[0].get("content") == "question 1")
    with serve_in_thread(engine, faults=faults) as h:
        out = _client([h.url], max_retries=2).generate(_prompts(3), SP)
    assert isinstance(out[0], str) and isinstance(out[2], str)
    assert isinstance(out[1], GenerationError) and out[1].attempts == 3 and out[1].code == "http_error"


def test_client_errors_are_not_retried(engine):
    with serve_in_thread(engine, max_tokens_limit=3) as h:
        out = _client([h.url], max_retries=5).generate(_prompts(1), SP)  # max_tokens 5 > 3
        assert isinstance(out[0], GenerationError) and out[0].code == "bad_request" and out[0].attempts == 1
    with serve_in_thread(engine) as h:
        long = _client([h.url]).generate([[{"role": "user", "content": "x " * 300}]], SP)[0]
        assert long.code == "prompt_too_long" and long.attempts == 1


def test_dead_servers_dropped_and_reported(engine, capsys):
    dead = f"http://127.0.0.1:{_free_port()}"
    with serve_in_thread(engine) as h:
        c = _client([dead, h.url])
        assert [s.url for s in c.live_servers] == [h.url] and c.dropped[0][0] == dead
        assert "dropped" in capsys.readouterr().out
        assert all(isinstance(o, str) for o in c.generate(_prompts(3), SP))
    with pytest.raises(EngineError, match="no healthy server"):
        _client([dead])


def test_server_dying_mid_run_moves_work_to_the_others(engine):
    with serve_in_thread(engine) as a:
        b = serve_in_thread(engine)
        c = _client([a.url, b.url], dead_after=2)
        b.close()  # b passed the health probe, then went away
        out = c.generate(_prompts(6), SP, keys=[str(i) for i in range(6)])
        assert all(isinstance(o, str) for o in out)
        assert [s.url for s in c.live_servers] == [a.url] and c.healthy()


def test_api_key_from_env_or_file_and_never_shown(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("MY_KEY", "sk-secret-123")
    assert read_api_key("MY_KEY", None) == "sk-secret-123"
    kf = tmp_path / "key"
    kf.write_text("\nsk-from-file\n")
    assert read_api_key("UNSET_VAR_X", str(kf)) == "sk-from-file"
    assert read_api_key("UNSET_VAR_X", None) is None
    with pytest.raises(EngineError):
        read_api_key(None, str(tmp_path / "missing"))
    with serve_in_thread(engine, api_key="sk-secret-123") as h:
        with pytest.raises(EngineError, match="API key rejected"):
            _client([h.url])
        c = _client([h.url], api_key=read_api_key("MY_KEY"))
        assert isinstance(c.generate(_prompts(1), SP)[0], str)
        assert "sk-secret" not in repr(c) and "sk-secret" not in str(c.describe())


def test_normalise_url():
    assert normalise_url("localhost:30000/v1/") == "http://localhost:30000"
    assert normalise_url("https://x.y/") == "https://x.y"


def test_retry_after_is_honoured_on_429(engine):
    from deepspec.engines.openai_client import retry_after_s
    assert retry_after_s("3") == 3.0 and retry_after_s(None) is None and retry_after_s("soon") is None
    assert retry_after_s("Thu, 01 Jan 1970 00:00:10 GMT", now=4.0) == 6.0
    with serve_in_thread(engine, faults=Faults(busy_every=2, busy_retry_after=1)) as h:
        c = _client([h.url], max_retries=4, backoff_s=0.001, backoff_max_s=2.0, concurrency=1)
        waits, backoff = [], c._backoff
        c._backoff = lambda attempt, retry_after=None: waits.append(backoff(attempt, retry_after)) or waits[-1]
        out = c.generate(_prompts(3), SP, keys=[str(i) for i in range(3)])
    assert all(isinstance(o, str) for o in out), out
    busy = h.server.faults.busy
    assert busy >= 1 and len(waits) == busy and all(w >= 1.0 for w in waits)   # Retry-After, not the 1 ms backoff
