"""The HTTP side of `deepspec serve` (`server`): `ChatServer` and its request handler.

Routes: ``POST /v1/chat/completions`` (validated by `chat_request`, generated through the
`batcher`), ``GET /v1/models``, ``GET /health``; optional Bearer-key check; size-limited
bodies, client timeouts, and a JSON error (4xx / 5xx) for anything that goes wrong.
`Faults` is the test-only fault injection the handler consults.
"""
from __future__ import annotations

import hmac
import json
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, Optional

from .base import Completion, Engine, GenerationError
from .batcher import Batcher
from .chat_request import BadRequest, parse_request

log = logging.getLogger(__name__)
DEFAULT_MAX_BODY = 8 << 20


@dataclass
class Faults:
    """Test-only fault injection, counted over POST /v1/chat/completions requests (1-based).

    ``fail_every=k``: every k-th request answers HTTP 500.  ``stall_every=k``: every
    k-th request sleeps ``stall_s`` before answering (the client should time out).
    ``fail_when(body) -> bool``: answer 500 whenever it returns True (a permanently
    failing sample).  ``busy_every=k``: every k-th request answers HTTP 429 with
    ``Retry-After: busy_retry_after`` (seconds, as an overloaded server does).
    """
    fail_every: int = 0
    busy_every: int = 0
    busy_retry_after: int = 1
    stall_every: int = 0
    stall_s: float = 5.0
    fail_when: Optional[Callable[[Dict[str, Any]], bool]] = None

    def __post_init__(self):
        self._n = 0
        self._lock = threading.Lock()
        self.failed = 0
        self.stalled = 0
        self.busy = 0

    def decide(self, body: Dict[str, Any]) -> Optional[str]:
        with self._lock:
            self._n += 1
            n = self._n
        if self.fail_when is not None and self.fail_when(body):
            self.failed += 1
            return "fail"
        if self.fail_every and n % self.fail_every == 0:
            self.failed += 1
            return "fail"
        if self.busy_every and n % self.busy_every == 0:
            self.busy += 1
            return "busy"
        if self.stall_every and n % self.stall_every == 0:
            self.stalled += 1
            return "stall"
        return None


class ChatServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr, engine: Engine, *, model_name: str = "deepspec", max_body_bytes: int = DEFAULT_MAX_BODY,
                 max_tokens_limit: int = 8192, default_max_tokens: int = 1024, max_batch: int = 16,
                 batch_wait_s: float = 0.005, request_timeout_s: float = 3600.0, faults: Optional[Faults] = None,
                 api_key: Optional[str] = None, client_timeout_s: float = 120.0):
        super().__init__(addr, _Handler)
        self.client_timeout_s = client_timeout_s  # a client silent this long mid-request is dropped (408)
        self._api_key = api_key
        self.engine = engine
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.max_tokens_limit = max_tokens_limit
        self.default_max_tokens = min(default_max_tokens, max_tokens_limit)
        self.request_timeout_s = request_timeout_s
        self.faults = faults
        self.batcher = Batcher(engine, max_batch=max_batch, wait_s=batch_wait_s)
        self.created = int(time.time())

    def server_close(self) -> None:
        super().server_close()
        self.batcher.close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ChatServer

    def setup(self):
        self.timeout = self.server.client_timeout_s  # socket timeout: a stalled client never pins a thread
        super().setup()

    def log_message(self, fmt, *args):  # quiet by default; errors still go to the logger
        log.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, status: int, obj: Dict[str, Any], close: bool = False,
              headers: Optional[Dict[str, str]] = None) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, code: str = "invalid_request", close: bool = False) -> None:
        etype = "invalid_request_error" if status < 500 else "server_error"
        self._send(status, {"error": {"message": message, "type": etype, "code": code}}, close=close)

    def _authorized(self) -> bool:
        key = self.server._api_key
        if not key:
            return True
        got = self.headers.get("Authorization") or ""
        if hmac.compare_digest(got.encode(), f"Bearer {key}".encode()):
            return True
        self._error(401, "missing or wrong API key", code="unauthorized", close=True)
        return False

    def do_GET(self):
        try:
            path = self.path.split("?", 1)[0].rstrip("/")
            if path == "/health":
                self._send(200, {"status": "ok"})
            elif not self._authorized():
                return
            elif path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": self.server.model_name, "object": "model",
                                                              "created": self.server.created,
                                                              "owned_by": "deepspec"}]})
            else:
                self._error(404, f"no route GET {path}", code="not_found")
        except Exception as e:  # pragma: no cover - defensive
            log.exception("GET failed")
            self._error(500, f"{type(e).__name__}: {e}", code="internal_error", close=True)

    def do_POST(self):
        try:
            self._post()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # never crash the server
            log.exception("request failed")
            try:
                self._error(500, f"{type(e).__name__}: {e}", code="internal_error", close=True)
            except Exception:
                self.close_connection = True

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raise BadRequest("chunked request bodies are not supported; send Content-Length", 411, "length_required")
        length = self.headers.get("Content-Length")
        if length is None:
            raise BadRequest("Content-Length is required", 411, "length_required")
        try:
            n = int(length)
        except ValueError:
            raise BadRequest("bad Content-Length") from None
        if n < 0:
            raise BadRequest("bad Content-Length")
        if n > self.server.max_body_bytes:
            raise BadRequest(f"request body of {n} bytes exceeds the limit of {self.server.max_body_bytes}",
                             413, "body_too_large")
        try:
            return self.rfile.read(n)
        except TimeoutError:
            raise BadRequest(f"timed out reading the request body ({self.server.client_timeout_s:g} s)",
                             408, "timeout") from None

    def _put(self):
        return self._error(405, "method not allowed", code="method_not_allowed")

    do_PUT = do_DELETE = do_PATCH = _put

    def _post(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path not in ("/v1/chat/completions", "/chat/completions"):
            # do not read an unknown body: answer and close the connection
            return self._error(404, f"no route POST {path}", code="not_found", close=True)
        if not self._authorized():
            return
        try:
            raw = self._read_body()
        except BadRequest as e:
            return self._error(e.status, str(e), e.code, close=True)
        try:
            body = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as e:  # bad UTF-8/JSON, nesting too deep, 5000-digit numbers
            return self._error(400, f"invalid JSON body: {type(e).__name__}: {str(e)[:200]}", code="invalid_json")
        srv = self.server
        if srv.faults is not None:
            fault = srv.faults.decide(body if isinstance(body, dict) else {})
            if fault == "fail":
                return self._error(500, "injected failure (test fault injection)", code="injected")
            if fault == "busy":
                return self._send(429, {"error": {"message": "injected overload (test fault injection)",
                                                  "type": "server_error", "code": "busy"}},
                                  headers={"Retry-After": str(srv.faults.busy_retry_after)})
            if fault == "stall":
                time.sleep(srv.faults.stall_s)
        try:
            messages, params, seed = parse_request(body, srv.max_tokens_limit, srv.default_max_tokens)
        except (BadRequest, ValueError) as e:
            status = getattr(e, "status", 400)
            return self._error(status, str(e), getattr(e, "code", "invalid_request"))
        if seed is None:
            seed = secrets.randbits(63)
        fut = srv.batcher.submit(messages, params, int(seed))
        try:
            res = fut.result(timeout=srv.request_timeout_s)
        except Exception:
            return self._error(504, "generation timed out", code="timeout")
        if isinstance(res, GenerationError):
            if res.code in ("prompt_too_long", "bad_request"):
                return self._error(400, res.message, code=res.code)
            return self._error(503 if res.retryable else 500, res.message, code=res.code)
        comp: Completion = res
        self._send(200, {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": srv.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": comp.text},
                         "finish_reason": comp.finish_reason}],
            "usage": {"prompt_tokens": comp.prompt_tokens, "completion_tokens": comp.num_tokens,
                      "total_tokens": comp.prompt_tokens + comp.num_tokens},
        })
