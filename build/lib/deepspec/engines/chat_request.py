"""The chat-completions request contract of `deepspec serve` (`server`): validate a JSON body.

`parse_request` turns a ``POST /v1/chat/completions`` body into (messages, `SamplingParams`,
seed or None); anything malformed, of the wrong type or out of range raises `BadRequest`
carrying the HTTP status and error code to answer with.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

from .base import SamplingParams

ROLES = ("system", "user", "assistant")


class BadRequest(ValueError):
    def __init__(self, message: str, status: int = 400, code: str = "invalid_request"):
        super().__init__(message)
        self.status, self.code = status, code


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
