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

`handler.Faults` is a **test-only** hook (``serve_in_thread(..., faults=Faults(...))``): it
answers 500 or stalls for chosen requests so the client's retries, timeouts and
error files can be exercised against a real server.

This module starts and stops servers (`serve_in_thread`, ``main``); the parts are
`chat_request` (validation), `batcher` (dynamic batching) and `handler` (`ChatServer`, the
HTTP handler, `Faults`).
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import threading

from ..config import ConfigError, load_config
from .base import Engine
from .handler import DEFAULT_MAX_BODY, ChatServer


# -- starting and stopping servers --------------------------------------------------------------------
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
