"""`deepspec serve`: a small OpenAI-compatible server over the embedded engine.

Endpoints: ``POST /v1/chat/completions`` (non-streaming), ``GET /v1/models``,
``GET /health``.  Built on the standard library (``ThreadingHTTPServer``): request
threads validate and enqueue; one worker thread owns the model and batches the
queued requests into `HFEngine.generate` calls (dynamic batching).

Binds 127.0.0.1 unless told otherwise; any other host needs ``--allow-remote``
and prints a warning.  ``--api-key-env NAME`` requires ``Authorization: Bearer``
with that variable's value (no authentication otherwise).  Bodies are size-limited and
validated: bad JSON, wrong types or absurd values get a 4xx JSON error, never a
crash.  A request's ``seed`` is used as that sample's own seed, so
``seed=sample_seed(s, key)`` reproduces the embedded engine's output exactly.

`Faults` is a **test-only** hook (``serve_in_thread(..., faults=Faults(...))``): it
answers 500 or stalls for chosen requests so the client's retries, timeouts and
error files can be exercised against a real server.
"""
from __future__ import annotations

import argparse
import hmac
import ipaddress
import os
import json
import logging
import math
import queue
import secrets
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, Optional, Tuple

from .base import Completion, Engine, GenerationError, SamplingParams

log = logging.getLogger(__name__)
ROLES = ("system", "user", "assistant")
DEFAULT_MAX_BODY = 8 << 20


class BadRequest(ValueError):
    def __init__(self, message: str, status: int = 400, code: str = "invalid_request"):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class Faults:
    """Test-only fault injection, counted over POST /v1/chat/completions requests (1-based).

    ``fail_every=k``: every k-th request answers HTTP 500.  ``stall_every=k``: every
    k-th request sleeps ``stall_s`` before answering (the client should time out).
    ``fail_when(body) -> bool``: answer 500 whenever it returns True (a permanently
    failing sample).
    """
    fail_every: int = 0
    stall_every: int = 0
    stall_s: float = 5.0
    fail_when: Optional[Callable[[Dict[str, Any]], bool]] = None

    def __post_init__(self):
        self._n = 0
        self._lock = threading.Lock()
        self.failed = 0
        self.stalled = 0

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
        if self.stall_every and n % self.stall_every == 0:
            self.stalled += 1
            return "stall"
        return None


# -- request validation ---------------------------------------------------------------------
def _num(body, key, default, lo, hi, integer=False):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise BadRequest(f"'{key}' must be {'an integer' if integer else 'a number'}, got {type(v).__name__}")
    if isinstance(v, float) and not math.isfinite(v) or not lo <= v <= hi:  # ints compare exactly, any size
        raise BadRequest(f"'{key}'={str(v)[:40]} is out of range [{lo}, {hi}]")
    return v


def parse_request(body: Any, max_tokens_limit: int, default_max_tokens: int) -> Tuple[List[Dict[str, str]], SamplingParams, Optional[int]]:
    """Validate a chat-completions body → (messages, sampling params, seed or None)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by this server")
    n = body.get("n", 1)
    if n not in (1, None) or isinstance(n, bool):
        raise BadRequest("only n=1 is supported")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list")
    if len(msgs) > 10000:
        raise BadRequest("too many messages")
    out = []
    for k, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{k}] must be an object")
        role, content = m.get("role"), m.get("content")
        if role == "developer":
            role = "system"
        if role not in ROLES:
            raise BadRequest(f"messages[{k}].role must be one of {ROLES}, got {role!r:.40}")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{k}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{k}].content must be a string")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(f"messages[{k}].content is not valid Unicode (lone surrogate)") from None
        out.append({"role": role, "content": content})
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    mt = default_max_tokens if mt is None else _num({"max_tokens": mt}, "max_tokens", None, 1, max_tokens_limit,
                                                    integer=True)
    temperature = float(_num(body, "temperature", 1.0, 0.0, 100.0))
    top_p = float(_num(body, "top_p", 1.0, 0.0, 1.0))
    if top_p == 0.0:
        raise BadRequest("'top_p' must be > 0")
    top_k = int(_num(body, "top_k", 0, -1, 1 << 30, integer=True))
    min_p = float(_num(body, "min_p", 0.0, 0.0, 1.0))
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < (1 << 64)):
        raise BadRequest("'seed' must be a 64-bit integer")
    params = SamplingParams(max_new_tokens=int(mt), temperature=temperature, top_p=top_p,
                            top_k=max(top_k, 0), min_p=min_p, seed=0)
    return out, params, seed


# -- the batching worker ----------------------------------------------------------------------
class Batcher:
    """One thread owns the engine; requests queue up and are generated in batches."""

    def __init__(self, engine: Engine, max_batch: int = 16, wait_s: float = 0.005):
        self.engine = engine
        self.max_batch = max(1, max_batch)
        self.wait_s = wait_s
        self.q: "queue.Queue[Optional[Tuple[list, SamplingParams, int, Future]]]" = queue.Queue()
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name="deepspec-serve-batcher", daemon=True)
        self.thread.start()

    def submit(self, messages, params: SamplingParams, seed: int) -> Future:
        f: Future = Future()
        self.q.put((messages, params, seed, f))
        return f

    def close(self) -> None:
        self._stop = True
        self.q.put(None)
        self.thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop:
            item = self.q.get()
            if item is None:
                break
            items = [item]
            deadline = time.monotonic() + self.wait_s
            while len(items) < self.max_batch:
                try:
                    nxt = self.q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None:
                    self._stop = True
                    break
                items.append(nxt)
            groups: Dict[SamplingParams, list] = {}
            for it in items:
                groups.setdefault(it[1], []).append(it)
            for params, group in groups.items():
                try:
                    res = self.engine.generate([g[0] for g in group], params, keys=[g[2] for g in group])
                except Exception as e:  # never take the server down
                    log.exception("generation failed")
                    res = [GenerationError(f"{type(e).__name__}: {e}", code="exception")] * len(group)
                for g, r in zip(group, res):
                    if not g[3].done():
                        g[3].set_result(r)
        while True:  # fail whatever is still queued
            try:
                it = self.q.get_nowait()
            except queue.Empty:
                break
            if it is not None and not it[3].done():
                it[3].set_result(GenerationError("server shutting down", code="exception", retryable=True))


# -- HTTP ------------------------------------------------------------------------------------------
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

    def _send(self, status: int, obj: Dict[str, Any], close: bool = False) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
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


# -- helpers -----------------------------------------------------------------------------------------
class ServerHandle:
    def __init__(self, server: ChatServer, thread: threading.Thread):
        self.server, self.thread = server, thread
        host, port = server.server_address[:2]
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve_in_thread(engine: Engine, host: str = "127.0.0.1", port: int = 0, **kw) -> ServerHandle:
    """Start a server on a background thread (port 0 = any free port); ``.url``, ``.close()``."""
    server = ChatServer((host, port), engine, **kw)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True,
                         name="deepspec-serve")
    t.start()
    return ServerHandle(server, t)


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="deepspec serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--allow-remote", action="store_true",
                   help="required to bind anything but loopback (there is no authentication)")
    p.add_argument("--model-name", default=None, help="id reported by /v1/models (default target.name)")
    p.add_argument("--max-tokens-limit", type=int, default=8192, help="largest max_tokens a request may ask")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY)
    p.add_argument("--batch-wait-ms", type=float, default=5.0, help="how long to gather a batch")
    p.add_argument("--api-key-env", default=None, metavar="NAME",
                   help="require 'Authorization: Bearer $NAME' on every request but /health")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. target=qwen3_8b engine.batch_size=32")
    args = p.parse_args(argv)
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            print(f"deepspec serve: --api-key-env {args.api_key_env}: the variable is not set", file=sys.stderr)
            return 2
    if not is_loopback(args.host):
        if not args.allow_remote:
            print(f"deepspec serve: refusing to bind {args.host!r}: it is not a loopback address and the server "
                  "has no authentication; pass --allow-remote to do it anyway", file=sys.stderr)
            return 2
        print(f"WARNING: deepspec serve is binding {args.host}:{args.port}, reachable from other machines"
              + ("" if api_key else ", with no authentication (see --api-key-env)"), file=sys.stderr)
    from ..config import ConfigError, load_config
    try:
        cfg = load_config(args.overrides)
    except ConfigError as e:
        print(f"deepspec serve: config error: {e}", file=sys.stderr)
        return 2
    from .hf import HFEngine
    engine = HFEngine.from_config(cfg)
    server = ChatServer((args.host, args.port), engine, model_name=args.model_name or cfg.target.name,
                        max_body_bytes=args.max_body_bytes, max_tokens_limit=args.max_tokens_limit,
                        default_max_tokens=cfg.engine.max_new_tokens, max_batch=cfg.engine.batch_size,
                        batch_wait_s=args.batch_wait_ms / 1000.0, api_key=api_key)
    print(f"deepspec serve: {cfg.target.path} on http://{args.host}:{server.server_address[1]}/v1 "
          f"(model id {server.model_name!r})", flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
