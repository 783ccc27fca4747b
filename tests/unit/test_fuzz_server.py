"""`deepspec serve` hardening beyond tests/unit/test_engines_server.py.

* hypothesis: any JSON body → a validated request or `BadRequest` (a 4xx), never another
  exception (a 10**400 ``max_tokens`` raised OverflowError before; now a 400);
* over HTTP: bodies that break `json` itself (nesting 100k deep, 5000-digit numbers), lone
  surrogates, astronomically large numbers → 400 JSON errors; a client that stalls mid-body
  is answered 408 and dropped; the server keeps serving;
* `main()`: binds 127.0.0.1 by default; another address needs ``--allow-remote`` and prints
  a warning (run for real on a tiny target, in a thread, stopped with ``shutdown()``).
"""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import requests
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepspec.engines.chat_request import BadRequest, parse_request
from deepspec.engines.handler import ChatServer
from deepspec.engines.server import main, serve_in_thread

torch.set_num_threads(1)
CHAT = "/v1/chat/completions"

_keys = st.sampled_from(["messages", "role", "content", "max_tokens", "max_completion_tokens", "temperature",
                         "top_p", "top_k", "min_p", "seed", "n", "stream", "type", "text", "model", "x"])
_scalar = (st.none() | st.booleans() | st.integers(-(10 ** 30), 10 ** 30) | st.sampled_from([10 ** 400, -(10 ** 400)])
           | st.floats() | st.text(max_size=6) | st.sampled_from(["user", "assistant", "system", "developer",
                                                                   "\ud800", "text"]))
_json = st.recursive(_scalar, lambda k: st.lists(k, max_size=3) | st.dictionaries(_keys, k, max_size=4),
                     max_leaves=16)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | _json,
                                  "content": _scalar | st.lists(st.fixed_dictionaries(
                                      {"type": st.sampled_from(["text", "image_url"]), "text": _scalar}), max_size=2)})
_body = st.one_of(_json, st.fixed_dictionaries(
    {"messages": st.lists(_message, max_size=3) | _json},
    optional={k: _scalar for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stream",
                                   "max_completion_tokens")}))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_body)
def test_parse_request_accepts_or_raises_bad_request(body):
    try:
        messages, params, seed = parse_request(body, max_tokens_limit=64, default_max_tokens=16)
    except BadRequest as e:
        assert 400 <= e.status < 500
        return
    assert messages and all(m["role"] in ("system", "user", "assistant") and isinstance(m["content"], str)
                            for m in messages)
    for m in messages:
        m["content"].encode("utf-8")
    assert 1 <= params.max_new_tokens <= 64 and 0.0 <= params.temperature <= 100.0 and 0.0 < params.top_p <= 1.0
    assert seed is None or isinstance(seed, int)


@pytest.fixture(scope="module")
def server():
    from deepspec.engines.hf import HFEngine
    from deepspec.targets.tiny import build_tiny
    model, tok = build_tiny("llama")
    engine = HFEngine(model.float(), tok, batch_size=4, max_prompt_tokens=64)
    with serve_in_thread(engine, max_tokens_limit=64, max_body_bytes=1 << 20, client_timeout_s=0.5) as h:
        yield h


_USER = [{"role": "user", "content": "x"}]
HOSTILE = [
    (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),                       # RecursionError inside json
    (b'{"messages": [], "max_tokens": ' + b"9" * 5000 + b"}", "invalid_json"),  # int() digit limit
    (json.dumps({"messages": _USER, "max_tokens": 10 ** 400}).encode(), "invalid_request"),
    (json.dumps({"messages": _USER, "temperature": -(10 ** 400)}).encode(), "invalid_request"),
    (json.dumps({"messages": _USER, "top_k": 10 ** 40}).encode(), "invalid_request"),
    (json.dumps({"messages": [{"role": "user", "content": "\ud800"}]}).encode(), "invalid_request"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "invalid_request"),
    (b'{"messages": [{"role": "user", "content": "x"}], "seed": 1e999}', "invalid_request"),
]


@pytest.mark.parametrize("raw,code", HOSTILE)
def test_hostile_bodies_get_400_and_the_server_survives(server, raw, code):
    r = requests.post(server.url + CHAT, data=raw, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["code"] == code
    ok = requests.post(server.url + CHAT, json={"messages": _USER, "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_stalled_client_gets_408_and_is_dropped(server):
    s = socket.create_connection((server.host, server.port), timeout=10)
    try:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 500\r\n\r\n{\"messages\": [")          # …and then nothing
        t0 = time.monotonic()
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert time.monotonic() - t0 < 5
    finally:
        s.close()
    idle = socket.create_connection((server.host, server.port), timeout=10)   # connects, sends nothing
    try:
        assert idle.recv(1) == b""                                            # closed by the server
    finally:
        idle.close()
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def _run_main(monkeypatch, args):
    """`deepspec serve` for real (tiny target) on a thread; returns (server, thread, exit codes)."""
    servers, codes = [], []
    real_init = ChatServer.__init__

    def record(self, *a, **k):
        real_init(self, *a, **k)
        servers.append(self)

    monkeypatch.setattr(ChatServer, "__init__", record)
    t = threading.Thread(target=lambda: codes.append(main(args + ["target.path=tiny:llama", "target.dtype=float32",
                                                                  "target.device=cpu"])), daemon=True)
    t.start()
    deadline = time.monotonic() + 120
    while not servers and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert servers, f"deepspec serve did not start (exit {codes})"
    return servers[0], t, codes


def test_serve_binds_loopback_by_default(monkeypatch, capsys):
    srv, t, codes = _run_main(monkeypatch, ["--port", "0"])
    try:
        host, port = srv.server_address[:2]
        assert host == "127.0.0.1"
        assert requests.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    finally:
        srv.shutdown()
        t.join(timeout=30)
    assert codes == [0]
    cap = capsys.readouterr()
    assert f"http://127.0.0.1:{port}/v1" in cap.out and "WARNING" not in cap.err


def test_serve_elsewhere_needs_the_flag_and_warns(monkeypatch, capsys):
    assert main(["--host", "0.0.0.0", "--port", "0"]) == 2                     # refused without the flag
    assert "--allow-remote" in capsys.readouterr().err
    srv, t, codes = _run_main(monkeypatch, ["--host", "0.0.0.0", "--port", "0", "--allow-remote"])
    try:
        assert srv.server_address[0] == "0.0.0.0"
    finally:
        srv.shutdown()
        t.join(timeout=30)
    err = capsys.readouterr().err
    assert "WARNING" in err and "reachable from other machines" in err and "no authentication" in err
