"""OpenAI-compatible client (`/v1/chat/completions`) for SGLang, vLLM, TGI or `deepspec serve`.

* several servers, ``concurrency`` requests in flight per server (worker threads);
* a health probe (``/v1/models``, then ``/health``) drops dead servers and says so;
* retries with exponential backoff (and jitter) on 5xx, 429, timeouts and
  connection errors; a server refusing connections several times in a row is
  dropped mid-run and its work goes to the others;
* the API key comes from an environment variable or a file and is only ever put
  in the ``Authorization`` header: never logged, never written anywhere.
"""
from __future__ import annotations

import email.utils
import logging
import os
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import requests

from .base import (Completion, Engine, EngineError, GenerationError, Messages, Result, SamplingParams, SeedKey,
                   sample_seed)

log = logging.getLogger(__name__)
_TOO_LONG_HINTS = ("prompt_too_long", "context length", "context_length", "too long", "maximum context",
                   "max_model_len", "input length")


def normalise_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    if url.endswith("/v1"):
        url = url[:-3]
    return url


def read_api_key(env_name: Optional[str] = None, key_file: Optional[str] = None) -> Optional[str]:
    """The API key from ``$env_name`` or ``key_file`` (first non-empty line); None if neither."""
    if env_name and os.environ.get(env_name):
        return os.environ[env_name].strip()
    if key_file:
        p = Path(key_file).expanduser()
        if not p.is_file():
            raise EngineError(f"engine.api_key_file: no such file {p}")
        for line in p.read_text().splitlines():
            if line.strip():
                return line.strip()
        raise EngineError(f"engine.api_key_file {p} is empty")
    return None


@dataclass
class ServerState:
    url: str
    alive: bool = True
    reason: str = ""
    models: List[str] = field(default_factory=list)
    connect_failures: int = 0      # consecutive
    requests: int = 0
    failures: int = 0


class OpenAIEngine(Engine):
    name = "openai"

    def __init__(self, servers: Sequence[str], *, model: Optional[str] = None, concurrency: int = 8,
                 connect_timeout_s: float = 10.0, timeout_s: float = 600.0, max_retries: int = 4,
                 backoff_s: float = 1.0, backoff_max_s: float = 60.0, api_key: Optional[str] = None,
                 health_check: bool = True, chat_template_kwargs: Optional[Dict[str, Any]] = None,
                 dead_after: int = 3):
        if not servers:
            raise EngineError("engine.kind=openai needs at least one server URL in engine.servers")
        self.servers = [ServerState(normalise_url(u)) for u in servers]
        self.model = model
        self.concurrency = max(1, int(concurrency))
        self.timeout = (float(connect_timeout_s), float(timeout_s))
        self.max_retries = max(0, int(max_retries))
        self.backoff_s, self.backoff_max_s = float(backoff_s), float(backoff_max_s)
        self._api_key = api_key
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.dead_after = max(1, int(dead_after))
        self._lock = threading.Lock()
        if health_check:
            self.probe()
        if self.model is None:
            self.model = self._discover_model()

    @classmethod
    def from_config(cls, cfg) -> "OpenAIEngine":
        e = cfg.engine
        kw = dict(cfg.target.chat_template_kwargs or {})
        if cfg.target.enable_thinking is not None:
            kw["enable_thinking"] = cfg.target.enable_thinking
        return cls(e.servers, model=e.model, concurrency=e.concurrency, connect_timeout_s=e.connect_timeout_s,
                   timeout_s=e.timeout_s, max_retries=e.max_retries, backoff_s=e.backoff_s,
                   backoff_max_s=e.backoff_max_s, api_key=read_api_key(e.api_key_env, e.api_key_file),
                   health_check=e.health_check, chat_template_kwargs=kw)

    # -- plumbing ----------------------------------------------------------------------
    def _headers(self) -> Dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self._api_key:
            h["Authorization"] = f"Bearer {self._api_key}"
        return h

    def __repr__(self) -> str:  # never show the key
        return f"OpenAIEngine(servers={[s.url for s in self.servers]}, model={self.model!r})"

    @property
    def live_servers(self) -> List[ServerState]:
        return [s for s in self.servers if s.alive]

    @property
    def dropped(self) -> List[Tuple[str, str]]:
        return [(s.url, s.reason) for s in self.servers if not s.alive]

    @property
    def parallelism(self) -> int:
        return max(1, len(self.live_servers)) * self.concurrency

    def healthy(self) -> bool:
        return bool(self.live_servers)

    def describe(self) -> Dict[str, Any]:
        return {"engine": self.name, "model": self.model, "servers": [s.url for s in self.live_servers],
                "chat_template_kwargs": dict(self.chat_template_kwargs)}

    # -- health ------------------------------------------------------------------------
    def probe(self) -> List[ServerState]:
        """Check every server; drop (and report) the ones that do not answer."""
        for s in self.servers:
            ok, why = False, ""
            for path in ("/v1/models", "/health"):
                try:
                    r = requests.get(s.url + path, headers=self._headers(), timeout=self.timeout[0] + 5)
                except requests.Timeout:
                    why = "unreachable: timed out"
                    break  # unreachable: the other path will not answer either
                except requests.RequestException as e:
                    why = f"unreachable: {type(e).__name__}"
                    break  # unreachable: the other path will not answer either
                if r.status_code in (401, 403):
                    why = f"API key rejected (HTTP {r.status_code} on {path}; see engine.api_key_env)"
                    break
                if r.status_code == 200:
                    ok = True
                    if path == "/v1/models":
                        try:
                            s.models = [m["id"] for m in r.json().get("data", []) if isinstance(m, dict)]
                        except (ValueError, AttributeError, KeyError, TypeError):
                            pass
                    break
                why = f"HTTP {r.status_code} on {path}"
            s.alive, s.reason = ok, ("" if ok else why)
            if not ok:
                log.warning("server %s is not healthy (%s): dropped", s.url, why)
        live = self.live_servers
        if not live:
            raise EngineError("no healthy server: " + "; ".join(f"{s.url}: {s.reason}" for s in self.servers))
        if self.dropped:
            print(f"openai engine: {len(live)}/{len(self.servers)} servers healthy; dropped: "
                  + ", ".join(f"{u} ({why})" for u, why in self.dropped), flush=True)
        return live

    def _discover_model(self) -> str:
        for s in self.live_servers:
            if s.models:
                return s.models[0]
        try:
            s = self.live_servers[0]
            r = requests.get(s.url + "/v1/models", headers=self._headers(), timeout=self.timeout[0] + 5)
            data = r.json().get("data", [])
            if data:
                return data[0]["id"]
        except Exception:
            pass
        raise EngineError("cannot tell the served model name: set engine.model")

    # -- one request -------------------------------------------------------------------
    def _body(self, messages: Messages, params: SamplingParams, seed: int) -> Dict[str, Any]:
        body: Dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": params.max_new_tokens,
                                "temperature": params.temperature, "top_p": params.top_p,
                                "seed": seed, "n": 1, "stream": False}
        if params.top_k:
            body["top_k"] = params.top_k
        if params.min_p:
            body["min_p"] = params.min_p
        if self.chat_template_kwargs:
            body["chat_template_kwargs"] = dict(self.chat_template_kwargs)
        return body

    def _request(self, session: requests.Session, server: ServerState, body: Dict[str, Any]) -> Result:
        url = server.url + "/v1/chat/completions"
        try:
            r = session.post(url, json=body, headers=self._headers(), timeout=self.timeout)
        except requests.Timeout as e:
            return GenerationError(f"{server.url}: timed out ({type(e).__name__})", code="timeout", retryable=True)
        except requests.ConnectionError as e:
            return GenerationError(f"{server.url}: connection error: {e}", code="connection", retryable=True)
        except requests.RequestException as e:
            return GenerationError(f"{server.url}: {type(e).__name__}: {e}", code="connection", retryable=True)
        if r.status_code != 200:
            return _http_error(server, r)
        return _completion(server, r)

    def _backoff(self, attempt: int, retry_after: Optional[float] = None) -> float:
        """Exponential backoff with jitter; a server's ``Retry-After`` (429/503) is honoured as the least
        wait, up to ``engine.backoff_max_s``."""
        base = min(self.backoff_max_s, self.backoff_s * (2 ** attempt))
        wait = base * (0.5 + 0.5 * random.random())
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.backoff_max_s))
        return wait

    # -- many requests -----------------------------------------------------------------
    def generate(self, prompts: Sequence[Messages], params: SamplingParams,
                 keys: Optional[Sequence[SeedKey]] = None) -> List[Result]:
        n = len(prompts)
        if keys is not None and len(keys) != n:
            raise ValueError(f"{len(keys)} keys for {n} prompts")
        if n == 0:
            return []
        batch = _Batch(n)
        seeds = [sample_seed(params.seed, None if keys is None else keys[i]) for i in range(n)]
        threads = [threading.Thread(target=self._worker, args=(s, batch, prompts, params, seeds), daemon=True,
                                    name=f"openai-{k}-{j}")
                   for k, s in enumerate(self.live_servers) for j in range(self.concurrency)]
        for t in threads:
            t.start()
        batch.wait(threads)
        for t in threads:
            t.join(timeout=0.1)
        batch.fail_leftovers()   # every server went away: whatever is left fails (and is retried on a re-run)
        return batch.results  # type: ignore[return-value]

    def _worker(self, server: ServerState, batch: "_Batch", prompts: Sequence[Messages], params: SamplingParams,
                seeds: Sequence[int]) -> None:
        """Take (prompt, attempt) items off the batch's queue and send them to ``server`` while it lives."""
        session = requests.Session()
        try:
            while server.alive:
                if batch.complete():
                    return
                try:
                    item = batch.work.get(timeout=0.1)
                except queue.Empty:
                    continue
                if item is None:
                    return
                i, attempt = item
                r = self._request(session, server, self._body(prompts[i], params, seeds[i]))
                self._record(server, r)
                if isinstance(r, GenerationError) and self._retry_later(batch, i, attempt, r):
                    continue
                batch.finish(i, r)
        finally:
            session.close()

    def _record(self, server: ServerState, r: Result) -> None:
        """Count the request against ``server``; drop it after ``dead_after`` connection failures in a row."""
        with self._lock:
            server.requests += 1
            if isinstance(r, GenerationError):
                server.failures += 1
                server.connect_failures = server.connect_failures + 1 if r.code == "connection" else 0
                if server.connect_failures >= self.dead_after and server.alive:
                    server.alive, server.reason = False, r.message
                    log.warning("server %s dropped after %d connection failures in a row",
                                server.url, server.connect_failures)
                    print(f"openai engine: dropped {server.url} ({r.message})", flush=True)
            else:
                server.connect_failures = 0

    def _retry_later(self, batch: "_Batch", i: int, attempt: int, err: GenerationError) -> bool:
        """Stamp the attempt count on ``err``; if it may be retried, wait the backoff and requeue the prompt."""
        err.attempts = attempt + 1
        if err.retryable and attempt < self.max_retries and self.live_servers:
            time.sleep(self._backoff(attempt, getattr(err, "retry_after", None)))
            batch.work.put((i, attempt + 1))
            return True
        return False


class _Batch:
    """Shared state of one `OpenAIEngine.generate` call: a queue of (prompt index, attempt) and the results."""

    def __init__(self, n: int):
        self.results: List[Optional[Result]] = [None] * n
        self.work: "queue.Queue[Optional[Tuple[int, int]]]" = queue.Queue()
        for i in range(n):
            self.work.put((i, 0))
        self.remaining = n
        self.done = threading.Condition()

    def finish(self, i: int, r: Result) -> None:
        """Set the first result for prompt ``i``; later ones are ignored."""
        with self.done:
            if self.results[i] is None:
                self.results[i] = r
                self.remaining -= 1
                self.done.notify_all()

    def complete(self) -> bool:
        with self.done:
            return self.remaining == 0

    def wait(self, threads: Sequence[threading.Thread]) -> None:
        """Until every prompt has a result or no worker is left."""
        with self.done:
            while self.remaining > 0:
                self.done.wait(timeout=0.5)
                if not any(t.is_alive() for t in threads):
                    break

    def fail_leftovers(self) -> None:
        """Fail whatever is still queued or unanswered with a retryable "no live server left"."""
        while True:
            try:
                item = self.work.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self.finish(item[0], GenerationError("no live server left", code="connection", retryable=True,
                                                     attempts=item[1]))
        for i in range(len(self.results)):
            if self.results[i] is None:
                self.finish(i, GenerationError("no live server left", code="connection", retryable=True))


def _http_error(server: ServerState, r: requests.Response) -> GenerationError:
    """The error for a non-200 answer: prompt too long, retryable (5xx, 408, 429) or a bad request."""
    msg, ecode = _error_info(r)
    low = f"{msg} {ecode}".lower()
    if r.status_code in (400, 413, 422) and any(h in low for h in _TOO_LONG_HINTS):
        return GenerationError(f"{server.url}: HTTP {r.status_code}: {msg}", code="prompt_too_long")
    retry = r.status_code >= 500 or r.status_code in (408, 429)
    err = GenerationError(f"{server.url}: HTTP {r.status_code}: {msg}",
                          code="http_error" if retry else "bad_request", retryable=retry)
    err.retry_after = retry_after_s(r.headers.get("Retry-After"))
    return err


def _completion(server: ServerState, r: requests.Response) -> Result:
    """The completion in a 200 answer, thinking put back inline; a retryable error if it is malformed."""
    try:
        data = r.json()
        choice = data["choices"][0]
        msg = choice.get("message") or {}
        content = msg.get("content") or ""
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if reasoning:  # server split the thinking out: put it back where the model wrote it
            content = f"<think>\n{reasoning}\n</think>\n\n{content}"
        usage = data.get("usage") or {}
        return Completion(content, num_tokens=int(usage.get("completion_tokens") or 0),
                          finish_reason=choice.get("finish_reason") or "stop",
                          prompt_tokens=int(usage.get("prompt_tokens") or 0))
    except (ValueError, KeyError, IndexError, TypeError) as e:
        return GenerationError(f"{server.url}: malformed response ({type(e).__name__}: {e})",
                               code="http_error", retryable=True)


def retry_after_s(value: Optional[str], now: Optional[float] = None) -> Optional[float]:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date); None if absent or bad."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _error_info(r: requests.Response) -> Tuple[str, str]:
    """(message, code) of an error response, whatever shape the server uses."""
    try:
        data = r.json()
        err = data.get("error", data) if isinstance(data, dict) else data
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:500], str(err.get("code") or "")
        return str(err)[:500], ""
    except ValueError:
        return (r.text or r.reason or "")[:500], ""
