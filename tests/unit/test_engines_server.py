"""`deepspec serve` over a tiny target: routes, validation, limits, auth, loopback-only default."""
from __future__ import annotations

import json

import pytest
import requests
import torch

from deepspec.engines.base import SamplingParams, sample_seed
from deepspec.engines.chat_request import parse_request
from deepspec.engines.hf import HFEngine
from deepspec.engines.server import is_loopback, main, serve_in_thread

torch.set_num_threads(1)
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def engine():
    from deepspec.targets.tiny import build_tiny
    model, tok = build_tiny("llama")
    return HFEngine(model.float(), tok, batch_size=4, max_prompt_tokens=64)


@pytest.fixture(scope="module")
def server(engine):
    with serve_in_thread(engine, max_tokens_limit=64, max_body_bytes=4096, model_name="tiny") as h:
        yield h


def _post(h, body, raw=None, **kw):
    data = raw if raw is not None else json.dumps(body).encode()
    return requests.post(h.url + CHAT, data=data, headers={"Content-Type": "application/json"}, timeout=30, **kw)


def test_health_models_and_completion(server, engine):
    assert requests.get(server.url + "/health").json() == {"status": "ok"}
    assert requests.get(server.url + "/v1/models").json()["data"][0]["id"] == "tiny"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6,
            "temperature": 0.8, "seed": 42}
    r = _post(server, body)
    assert r.status_code == 200
    out = r.json()
    assert out["object"] == "chat.completion" and out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["completion_tokens"] == 6 and out["choices"][0]["finish_reason"] == "length"
    # the request seed is the sample's own seed: the embedded engine gives the same text
    ref = engine.generate([body["messages"]], SamplingParams(max_new_tokens=6, temperature=0.8), keys=[42])[0]
    assert out["choices"][0]["message"]["content"] == ref
    assert sample_seed(0, 42) == 42


BAD = [
    (None, b"{nope", 400, "invalid_json"),
    (None, b"\xff\xfe", 400, "invalid_json"),
    ([], None, 400, "invalid_request"),
    ({"messages": []}, None, 400, "invalid_request"),
    ({"messages": "hi"}, None, 400, "invalid_request"),
    ({"messages": [{"role": "user", "content": 3}]}, None, 400, "invalid_request"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, None, 400, "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10 ** 12}, None, 400, "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, None, 400, "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}, None, 400, "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, None, 400, "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, None, 400, "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 2}, None, 400, "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": "abc"}, None, 400, "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 3}, None, 400, "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": True}, None, 400, "invalid_request"),
    ({"messages": [{"role": "user", "content": "long " * 200}]}, None, 400, "prompt_too_long"),
    ({"messages": [{"role": "user", "content": "x" * 5000}]}, None, 413, "body_too_large"),
]


@pytest.mark.parametrize("body,raw,status,code", BAD)
def test_bad_requests_get_4xx_json(server, body, raw, status, code):
    r = _post(server, body, raw)
    assert r.status_code == status
    assert r.json()["error"]["code"] == code
    assert requests.get(server.url + "/health").status_code == 200  # still serving


def test_routes_and_methods(server):
    assert requests.get(server.url + "/nope").status_code == 404
    assert requests.post(server.url + "/v1/nope", data=b"{}").status_code == 404
    assert requests.delete(server.url + CHAT).status_code == 405
    # no Content-Length
    import http.client
    c = http.client.HTTPConnection(server.host, server.port, timeout=10)
    c.putrequest("POST", CHAT)
    c.putheader("Transfer-Encoding", "chunked")
    c.endheaders()
    resp = c.getresponse()
    assert resp.status == 411
    c.close()


def test_api_key_required_when_set(engine):
    with serve_in_thread(engine, api_key="s3cret") as h:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert _post(h, body).status_code == 401
        assert requests.get(h.url + "/v1/models").status_code == 401
        assert requests.get(h.url + "/health").status_code == 200
        r = requests.post(h.url + CHAT, json=body, headers={"Authorization": "Bearer s3cret"}, timeout=30)
        assert r.status_code == 200


def test_parse_request_defaults():
    msgs, params, seed = parse_request({"messages": [{"role": "developer", "content": "S"},
                                                     {"role": "user", "content": [{"type": "text", "text": "x"}]}],
                                        "top_k": -1}, 100, 16)
    assert msgs == [{"role": "system", "content": "S"}, {"role": "user", "content": "x"}]
    assert params.max_new_tokens == 16 and params.top_k == 0 and seed is None


def test_loopback_only_by_default(capsys):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("")
    assert main(["--host", "0.0.0.0", "--port", "0"]) == 2
    assert "--allow-remote" in capsys.readouterr().err
