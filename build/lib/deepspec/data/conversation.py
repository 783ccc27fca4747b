"""The one in-memory shape of a prompt sample and the record → conversation rules.

Every source (HF dataset, JSONL, JSON array, Parquet, the offline ShareGPT corpus)
produces plain records; `record_to_conversation` turns one into a `Conversation`
or raises `DataError` naming where the record came from and what is wrong.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from ..errors import DeepSpecError

ROLES = ("system", "user", "assistant")
# Source role names → the three chat roles.
ROLE_ALIASES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "model": "assistant",
}
# Canonical field names a `data.columns` mapping may rename.
CANONICAL_FIELDS = ("id", "conversations", "turns", "system", "role", "content")


class DataError(DeepSpecError, ValueError):
    """A bad input record or source; the message names the file and line (or row).

    ``reason`` is a short machine-readable code (invalid_json, missing_key, bad_type,
    empty, unknown_role, invalid_utf8, truncated, source); ``origin`` is ``file:line``.
    """

    def __init__(self, message: str, *, origin: str = "", reason: str = "invalid", raw: Any = None):
        self.origin = origin
        self.reason = reason
        self.problem = message
        self.raw = raw
        super().__init__(f"{origin}: {message}" if origin else message)


class UnknownRoleError(DataError):
    """A message role we cannot map onto system/user/assistant (always a counted skip)."""


@dataclass
class Conversation:
    id: str
    messages: List[Dict[str, str]]
    # Where the record came from (``file:line`` / ``hf:name/split:row N``).
    origin: str = field(default="", compare=False)

    def user_turns(self) -> List[str]:
        return [m["content"] for m in self.messages if m["role"] == "user"]

    def system_prompt(self) -> Optional[str]:
        sys = [m["content"] for m in self.messages if m["role"] == "system"]
        return "\n\n".join(sys) if sys else None

    def to_dict(self) -> Dict[str, Any]:
        return {"id": self.id, "conversations": [dict(m) for m in self.messages]}

    def content_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.messages, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


def normalise_role(role: Any) -> Optional[str]:
    """``human``/``gpt``/… → ``user``/``assistant``/``system``; None when unknown."""
    if not isinstance(role, str):
        return None
    return ROLE_ALIASES.get(role.strip().lower())


def fallback_id(source_key: str, line: int) -> str:
    """A stable id for a record without one: hash of the source name and the line."""
    return "h" + hashlib.sha256(f"{source_key}\x00{line}".encode()).hexdigest()[:16]


def apply_columns(rec: Mapping[str, Any], columns: Mapping[str, str]) -> Dict[str, Any]:
    """Rename source columns to canonical names (``columns`` = canonical → source)."""
    out = dict(rec)
    for canon, src in columns.items():
        if canon in ("role", "content"):
            continue  # applied per message
        if src in rec:
            out[canon] = rec[src]
            if src != canon:
                out.pop(src, None)
    return out


def _messages_from_turns(turns: Any, origin: str, raw: Any) -> List[Dict[str, str]]:
    if not isinstance(turns, list):
        raise DataError(f"'turns' must be a list of strings, got {type(turns).__name__}",
                        origin=origin, reason="bad_type", raw=raw)
    msgs = []
    for k, t in enumerate(turns):
        if not isinstance(t, str):
            raise DataError(f"turns[{k}] must be a string, got {type(t).__name__}",
                            origin=origin, reason="bad_type", raw=raw)
        msgs.append({"role": "user", "content": t})
    return msgs


def _messages_from_list(conv: Any, origin: str, raw: Any, role_key: Optional[str],
                        content_key: Optional[str]) -> List[Dict[str, str]]:
    if not isinstance(conv, list):
        raise DataError(f"'conversations' must be a list of messages, got {type(conv).__name__}",
                        origin=origin, reason="bad_type", raw=raw)
    msgs = []
    for k, m in enumerate(conv):
        if not isinstance(m, Mapping):
            raise DataError(f"conversations[{k}] must be an object with role/content (or from/value), "
                            f"got {type(m).__name__}", origin=origin, reason="bad_type", raw=raw)
        rk = role_key if role_key and role_key in m else ("role" if "role" in m else "from" if "from" in m else None)
        ck = (content_key if content_key and content_key in m
              else "content" if "content" in m else "value" if "value" in m else None)
        if rk is None or ck is None:
            missing = "role (or from)" if rk is None else "content (or value)"
            raise DataError(f"conversations[{k}] has no {missing} key (keys: {sorted(m)})",
                            origin=origin, reason="missing_key", raw=raw)
        role = normalise_role(m[rk])
        if role is None:
            raise UnknownRoleError(f"conversations[{k}] has unknown role {m[rk]!r}",
                                   origin=origin, reason="unknown_role", raw=raw)
        content = m[ck]
        if isinstance(content, list):  # OpenAI-style content parts: keep text parts only
            if all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
                content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise DataError(f"conversations[{k}].{ck} must be a string, got {type(content).__name__}",
                            origin=origin, reason="bad_type", raw=raw)
        msgs.append({"role": role, "content": content})
    return msgs


def record_to_conversation(rec: Any, *, origin: str, default_id: str,
                           columns: Optional[Mapping[str, str]] = None) -> Conversation:
    """One source record → `Conversation`, or `DataError` naming ``origin``.

    Accepted shapes: ``{"turns": [str, ...]}`` (user turns, optional ``"system"``),
    ``{"conversations"|"messages": [{"role", "content"}, ...]}`` and ShareGPT
    ``{"conversations": [{"from", "value"}, ...]}``.  An ``id`` field, when present,
    is the sample id; otherwise ``default_id``.
    """
    columns = dict(columns or {})
    if not isinstance(rec, Mapping):
        raise DataError(f"a record must be a JSON object, got {type(rec).__name__}",
                        origin=origin, reason="bad_type", raw=rec)
    r = apply_columns(rec, columns)
    if "turns" in r and r["turns"] is not None:
        msgs = _messages_from_turns(r["turns"], origin, rec)
    elif "conversations" in r and r["conversations"] is not None:
        msgs = _messages_from_list(r["conversations"], origin, rec, columns.get("role"), columns.get("content"))
    elif "messages" in r and r["messages"] is not None:
        msgs = _messages_from_list(r["messages"], origin, rec, columns.get("role"), columns.get("content"))
    else:
        raise DataError(f"missing key: expected 'turns', 'conversations' or 'messages' (keys: {sorted(r)[:10]})",
                        origin=origin, reason="missing_key", raw=rec)
    system = r.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise DataError(f"'system' must be a string, got {type(system).__name__}",
                            origin=origin, reason="bad_type", raw=rec)
        if system.strip() and not any(m["role"] == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": system})
    if not msgs:
        raise DataError("empty turns: the conversation has no messages", origin=origin, reason="empty", raw=rec)
    users = [m for m in msgs if m["role"] == "user"]
    if not users:
        raise DataError("empty turns: the conversation has no user turn", origin=origin, reason="empty", raw=rec)
    for k, m in enumerate(msgs):
        if m["role"] == "user" and not m["content"].strip():
            raise DataError(f"empty turns: user message {k} is empty", origin=origin, reason="empty", raw=rec)
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate ("\\ud800" in JSON) breaks tokenizers and writers
            raise DataError(f"message {k} is not valid Unicode ({e.reason} at character {e.start})",
                            origin=origin, reason="invalid_utf8", raw=rec) from None
    sid = r.get("id")
    if sid is None or (isinstance(sid, str) and not sid.strip()):
        sid = default_id
    elif not isinstance(sid, (str, int)) or isinstance(sid, bool):
        raise DataError(f"'id' must be a string or an integer, got {type(sid).__name__}",
                        origin=origin, reason="bad_type", raw=rec)
    sid = str(sid)
    try:
        sid.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"'id' is not valid Unicode ({e.reason})", origin=origin, reason="invalid_utf8",
                        raw=rec) from None
    return Conversation(id=sid, messages=msgs, origin=origin)
